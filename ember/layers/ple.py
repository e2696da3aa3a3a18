"""PLE, qwen4_exp's per-layer n-gram embedding: hashed 2..N-gram rows of a large table added to every
hyper-connection stream of one Gated DeltaNet layer (../shared/research/qwen4exp.md, section 4).

Hashing (exactly transformers' Qwen4ExpTextNGramEmbedding): each token t has a context c_0 = its own id,
c_s = the token s back, where walking back from t - 1 the first EOS and everything before it, and
anything before the sequence, read as EOS (t's own EOS does not cut; `<|im_end|>` is not EOS). For each
n in 2..N, mix_n = XOR_{i<n} c_i * m_i in int64 (the multipliers m_i are odd and below 2^63 / vocab, so
no product overflows), and head g of that n reads row offset_g + mix_n mod size_g, size_g a prime. The
(N - 1) x heads_per_ngram rows, concatenated, are the token's embedding e.

The layer (X: the layer's [T, n*H] residual before its mixer):
    k = norm_k(key_proj(e)) [n, H],  v = value_proj(e) [H],  q = norm_q(X) [n, H]
    g_s = <k_s, q_s> / sqrt(H);  g_s = sign(g_s) sqrt(max(|g_s|, 1e-6));  u_s = sigmoid(g_s) v
    c = SiLU(causal depthwise conv of norm_c(u), kernel K, dilation N)
    X += u + c
Its per-sequence state (PLEState): the conv's last (K - 1) N input columns and the last N - 1 token ids,
carried across chunks, snapshotted with the Gated DeltaNet state, kept per token on a verify.

A step: the model calls start() before its first layer (the rows hashed, their gather begun on a thread:
ember.layers.ple_gather), forward() takes them; everything after the two projections is mix() (the C++
kernel, ember.kernels.cpu_ple, or mix_reference). A fixed-shape step (a compiled graph) does the same for
all its sequences at once, by the step's slot tensors (_forward_fixed).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ember.config.model_config import PLEConfig
from ember.distributed.parallel_state import get_tp_rank_size
from ember.errors import ModelLoadError
from ember.kernels import cpu_ple
from ember.kernels.cpu_kernels import CpuKernels
from ember.kernels.metadata import AttentionMetadata
from ember.layers import ple_gather
from ember.layers.expert_placement import current_placement
from ember.layers.hyper_connection import GroupedZeroCenteredRMSNorm
from ember.layers.linear import ReplicatedLinear, copy_checked
from ember.layers.recurrent_state import RecurrentState
from ember.layers.table_rows import resident_rows, table_rows

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(z: int) -> int:
    z = (z + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """m_i = 2 (splitmix64(seed + 10007 ple_index + gamma (i + 1)) mod h) + 1, h = ((2^63 - 1) // vocab) // 2."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_sizes(base: int, num_heads: int, ple_index: int) -> list[int]:
    """Head g of PLE layer ple_index has the (ple_index * num_heads + g + 1)-th prime at or above base."""
    sizes, p = [], base - 1
    while len(sizes) < (ple_index + 1) * num_heads:
        p += 1
        while not _is_prime(p):
            p += 1
        sizes.append(p)
    return sizes[ple_index * num_heads :]


class NGramHash:
    """Token ids -> table rows, with the EOS restart (the module docstring)."""

    def __init__(self, cfg: PLEConfig, vocab_size: int, ple_index: int):
        self.ngram_size, self.heads_per_ngram, self.eos = cfg.ngram_size, cfg.heads_per_ngram, cfg.eos_token_id
        self.multipliers = layer_multipliers(vocab_size, cfg.ngram_size, ple_index, cfg.seed)
        self.sizes = head_sizes(cfg.vocab_size_base, cfg.num_heads, ple_index)
        self.offsets = [sum(self.sizes[:g]) for g in range(len(self.sizes))]
        total = sum(self.sizes)
        self.num_rows = -(-total // cfg.vocab_divisible_by) * cfg.vocab_divisible_by
        # each n's heads as [1, heads] int64, built once (rows() runs every step)
        per = [
            slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram) for n in range(2, self.ngram_size + 1)
        ]
        self._head_sizes = [torch.tensor(self.sizes[g], dtype=torch.int64)[None] for g in per]
        self._head_offsets = [torch.tensor(self.offsets[g], dtype=torch.int64)[None] for g in per]

    def contexts(self, history: torch.Tensor) -> list[torch.Tensor]:
        """history [..., N - 1 + L] int64 (the carried ids, then the chunk's) -> c_0..c_{N-1}, each [..., L]."""
        C = self.ngram_size - 1
        L = history.shape[-1] - C
        own = history[..., C:]
        out, cut = [own], torch.zeros_like(own, dtype=torch.bool)
        for s in range(1, self.ngram_size):
            prev = history[..., C - s : C - s + L]
            out.append(torch.where(cut, torch.full_like(prev, self.eos), prev))
            cut = cut | (prev == self.eos)  # an EOS s back cuts everything further back
        return out

    def rows(self, history: torch.Tensor) -> torch.Tensor:
        """history as in contexts() -> rows [..., L, (N - 1) * heads_per_ngram] of the table."""
        ctx, heads, dev = self.contexts(history), [], history.device
        for n, sizes, offsets in zip(range(2, self.ngram_size + 1), self._head_sizes, self._head_offsets):
            mix = ctx[0] * self.multipliers[0]
            for i in range(1, n):
                mix = torch.bitwise_xor(mix, ctx[i] * self.multipliers[i])
            heads.append(torch.remainder(mix[..., None], sizes.to(dev)) + offsets.to(dev))
        return torch.cat(heads, dim=-1)


class NGramTable:
    """The table, read by row only: held as the checkpoint's row shards (equal runs of rows, in order, each
    a row source: ember.layers.table_rows), never concatenated, dequantized or copied whole.
    gather(rows) -> [*rows.shape, dim] in `dtype`."""

    def __init__(self, num_rows: int, dim: int, columns: slice | None = None):
        """columns: the window of each row this tensor-parallel rank reads (None: every column)."""
        self.num_rows, self.dim, self.columns = num_rows, dim, columns
        self.width = dim if columns is None else columns.stop - columns.start
        self.shards: list = []

    def add_shard(self, index: int, source, parts: int) -> None:
        if len(self.shards) < parts:
            self.shards += [None] * (parts - len(self.shards))
        self.shards[index] = source

    @property
    def complete(self) -> bool:
        return bool(self.shards) and all(s is not None for s in self.shards)

    @property
    def mapped_bytes(self) -> int:
        """Bytes left in the file's mapping (read by row, not resident)."""
        return sum(s.nbytes for s in self.shards if s is not None and s.mapped)

    def to_device(self, device, dtype: torch.dtype) -> None:
        """Read every shard onto the device (--no-ple-offload), where gather then runs."""
        self.shards = [resident_rows(s, device, dtype) for s in self.shards]

    def gather(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered where the table lives: in host memory (its file's mapping, --ple-offload), the rows then
        copied into the step's input on the device; or on the device, where it was read whole."""
        return self.finish(self.fetch(rows), dtype).to(rows.device)

    def fetch(self, rows: torch.Tensor) -> tuple:
        """The part of gather() that waits on the file: each shard's rows read (fetch), with no torch op that
        would run on OpenMP threads. ember.layers.ple_gather runs it on a thread of its own, and a parallel
        region entered from a second thread gives OpenMP more threads than cores, after which its workers
        stop spinning between a step's ops (the Q4_K_M bench file's decode step: 33 -> 21 ms without it)."""
        ids = rows.reshape(-1).cpu().numpy()
        shard = ids // self.shards[0].num_rows
        parts = []
        for i in np.unique(shard).tolist():
            at = np.flatnonzero(shard == i)
            local = torch.from_numpy(ids[at] - i * self.shards[0].num_rows)
            parts.append((torch.from_numpy(at), i, self.shards[i].fetch(local, self.columns)))
        return rows.shape, parts

    def finish(self, fetched: tuple, dtype: torch.dtype) -> torch.Tensor:
        """fetch()'s result -> [*rows.shape, width] in dtype where the table lives (the rows dequantized where
        they are not; a table read whole onto the device, --no-ple-offload, is indexed there)."""
        shape, parts = fetched
        home = self.shards[0].tensor.device
        out = torch.empty(math.prod(shape), self.width, dtype=dtype, device=home)
        for at, i, part in parts:
            out[at.to(home)] = self.shards[i].finish(part, dtype, self.columns)
        return out.view(*shape, self.width)


class PLEInputs(NamedTuple):
    """What PLELayer.start hands its forward: the step's table rows [T, R], the ids they were hashed from
    (per sequence [N - 1 + n] eagerly, [B, N - 1 + n] in a fixed-shape step), and the prefetch's ticket
    (a traced step's: it orders the gather op after the prefetch op; None eagerly)."""

    rows: torch.Tensor
    history: list[torch.Tensor] | torch.Tensor
    ticket: torch.Tensor | None


class WindowInputLinear(ReplicatedLinear):
    """A PLE projection whose inputs are the gathered rows: [out, heads x row width] in the checkpoint, and
    under tensor parallelism only this rank's table columns of each head's row (NGramTable.columns), the
    partial products summed by the caller's all-reduce."""

    def __init__(self, table: NGramTable, heads: int, out_features: int, dtype, device):
        super().__init__(heads * table.width, out_features, dtype=dtype, device=device)
        object.__setattr__(self, "table", table)  # not a submodule: the PLE layer holds it

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard_id=None):
        if not isinstance(tensor, torch.Tensor):  # a quantized GGUF matrix (llama.cpp quantizes these too)
            tensor = tensor.dequantize(torch.float32)
        columns, dim = self.table.columns, self.table.dim
        if (
            param_name == "weight"
            and columns is not None
            and tensor.shape[-1] == dim * (self.in_features // self.table.width)
        ):
            tensor = tensor.view(tensor.shape[0], -1, dim)[:, :, columns].reshape(tensor.shape[0], -1)
        return super().load_weight(param_name, tensor, shard_id)


# --ple-offload's default keeps the table in host memory unless it takes at most this share of the device's
# free memory at load (the KV cache and the steps need the rest)
TABLE_DEVICE_SHARE = 0.5


def offload_table(offload: bool | None, nbytes: int, device) -> bool:
    """Whether the n-gram table stays in host memory: as --ple-offload says, else (None) on CPU always (the
    file's mapping is host memory; read whole it would be resident), on a GPU where it does not fit."""
    if offload is not None:
        return offload
    device = torch.device(device)
    if device.type == "cpu":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes > TABLE_DEVICE_SHARE * free


class PLEState(RecurrentState):
    """A Gated DeltaNet layer's state (RecurrentState) plus its PLE's: per slot the conv's last
    (K - 1) N input columns [window, n*H] (model dtype) and the last N - 1 token ids (int64). Both pools have
    one row past the slots, which a fixed-shape step's padding rows (slot -1) write and read instead of a
    slot (scratch_index): a graph scatters with no data-dependent shapes."""

    POOL_DIMS = ("slots", "slots", "slots+1", "slots+1")

    def __init__(self, num_slots: int, window: int, width: int, context: int, *args, **kwargs):
        super().__init__(num_slots, *args, **kwargs)
        dev = self.conv.device
        self.ple_window = torch.zeros(num_slots + 1, window, width, dtype=self.conv.dtype, device=dev)
        self.ple_ids = torch.zeros(num_slots + 1, context, dtype=torch.int64, device=dev)
        self._ple_pending: list[tuple[int, torch.Tensor, torch.Tensor, list[tuple[int, int]]]] = []

    def _bind(self, tensors: tuple[torch.Tensor, ...]) -> None:
        super()._bind(tensors[:2])
        self.ple_window, self.ple_ids = tensors[2:]
        self._ple_pending = []

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*super().tensors(), self.ple_window, self.ple_ids)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.ple_window.nbytes + self.ple_ids.nbytes

    def scratch_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots [B] (-1: none) -> rows of the PLE pools: the slot, or the scratch row past them for -1."""
        return torch.where(slots >= 0, slots, self.ple_ids.shape[0] - 1)

    def keep_ple_verify(self, slot: int, columns: torch.Tensor, history: torch.Tensor, snapshots) -> None:
        """A verify's PLE inputs: columns [window + L, n*H] (the carried window, then its L tokens') and
        history [N - 1 + L] ids; commit keeps the state after the accepted tokens."""
        self._ple_pending.append((slot, columns, history, list(snapshots)))

    def write_ple(self, slot: int, columns: torch.Tensor, history: torch.Tensor, t: int) -> None:
        """The PLE state after t of the tokens whose inputs columns / history carry (see keep_ple_verify)."""
        self.ple_window[slot] = columns[t : t + self.ple_window.shape[1]]
        self.ple_ids[slot] = history[t : t + self.ple_ids.shape[1]]

    def commit(self, accepted: dict[int, int]) -> None:
        for slot, columns, history, snapshots in self._ple_pending:
            kept = accepted[slot] + 1
            for t, snap in snapshots:
                if t <= kept:
                    self.write_ple(snap, columns, history, t)
            self.write_ple(slot, columns, history, kept)
        self._ple_pending.clear()
        super().commit(accepted)

    def copy(self, src: int, dst: int) -> None:
        super().copy(src, dst)
        self.ple_window[dst] = self.ple_window[src]
        self.ple_ids[dst] = self.ple_ids[src]


class PLELayer(nn.Module):
    def __init__(
        self,
        cfg: PLEConfig,
        vocab_size: int,
        hidden: int,
        count: int,
        eps: float,
        ple_index: int,
        dtype,
        device,
        kernels: CpuKernels | None = None,
    ):
        super().__init__()
        self.cfg, self.hidden, self.count = cfg, hidden, count
        width = hidden * count
        self.hash = NGramHash(cfg, vocab_size, ple_index)
        # under tensor parallelism each rank reads a window of every row's columns (only those bytes: the
        # table stays cold), and the projections take the matching inputs; one all-reduce sums k and v
        dim, (rank, size) = cfg.embed_dim // cfg.num_heads, get_tp_rank_size()
        columns = slice(rank * dim // size, (rank + 1) * dim // size) if size > 1 and dim % size == 0 else None
        self.table = NGramTable(self.hash.num_rows, dim, columns)
        self.key_proj = WindowInputLinear(self.table, cfg.num_heads, width, dtype=dtype, device=device)
        self.value_proj = WindowInputLinear(self.table, cfg.num_heads, hidden, dtype=dtype, device=device)
        norm = lambda: GroupedZeroCenteredRMSNorm(width, hidden, eps, dtype, device)  # noqa: E731
        self.norm_key, self.norm_query, self.norm_conv = norm(), norm(), norm()
        self.conv_weight = nn.Parameter(
            torch.zeros(width, cfg.conv_kernel, dtype=dtype, device=device), requires_grad=False
        )
        placement = current_placement()  # --ple-offload (None: where the table does not fit the device)
        self.offload, self.device, self.dtype = placement.ple_offload if placement else None, device, dtype
        self._pending_shards: dict[int, object] = {}  # the table's row shards as they load
        self._pending_scales: dict[int, float] = {}  # fp8 shards' per-tensor weight_scale, by shard
        self._gather_key: str | None = None
        self.cpu_kernel = (kernels or CpuKernels()).ple  # the C++ gate and conv where it applies

    def held_weights(self) -> list[torch.Tensor]:
        """The n-gram table's resident shards: weights held outside the parameters
        (model_loader.resident_weight_bytes); shards left in the file's mapping are not resident."""
        return [s.tensor for s in self.table.shards if s is not None and not s.mapped]

    def mapped_weight_bytes(self) -> int:
        return self.table.mapped_bytes

    def table_bytes(self) -> int:
        return sum(s.nbytes for s in self.table.shards if s is not None)

    def make_state(self, gdn_args: tuple, num_slots: int) -> PLEState:
        """The state of the Gated DeltaNet layer this PLE sits on (gdn_args: its RecurrentState's arguments
        after num_slots), with the PLE's."""
        return PLEState(num_slots, self.cfg.conv_window, self.hidden * self.count, self.cfg.ngram_size - 1, *gdn_args)

    @property
    def gather_key(self) -> str:
        """The key ember::ple_rows finds this layer's table by (ember.layers.ple_gather), once it is complete."""
        if self._gather_key is None:
            self._gather_key = ple_gather.register_table(self.table)
        return self._gather_key

    def start(self, input_ids: torch.Tensor, state: PLEState, meta: AttentionMetadata) -> PLEInputs:
        """Hash the step's tokens to their table rows and start gathering them (a thread preads them while the
        layers before this one run): what the model calls before its first layer. Reads the carried ids,
        which only forward() writes."""
        C, eos = self.cfg.ngram_size - 1, self.cfg.eos_token_id
        if meta.fixed_shape:  # B sequences of n tokens, each from its source slot (-1: a new one)
            src = meta.recurrent.device_sources
            B = src.shape[0]
            ids0 = torch.where(src[:, None] >= 0, state.ple_ids[state.scratch_index(src)], eos)
            history = torch.cat([ids0, input_ids.view(B, -1).to(torch.int64)], dim=1)
            rows = self.hash.rows(history).flatten(0, 1)
        else:
            history, s = [], 0
            for n, slot, has in zip(meta.query_lens_cpu, meta.recurrent.slots, meta.recurrent.has_state):
                ids0 = state.ple_ids[slot] if has else input_ids.new_full((C,), eos)
                history.append(torch.cat([ids0.to(torch.int64), input_ids[s : s + n].to(torch.int64)]))
                s += n
            rows = torch.cat([self.hash.rows(h) for h in history])
        dtype = self.conv_weight.dtype
        return PLEInputs(rows, history, ple_gather.prefetch(self.gather_key, rows, dtype))

    def forward(
        self, X: torch.Tensor, input_ids: torch.Tensor, state: PLEState, meta: AttentionMetadata, inputs=None
    ) -> torch.Tensor:
        """X [T, n*H] -> what the layer adds to it, [T, n*H]. inputs: start()'s (None: started here)."""
        inputs = inputs if inputs is not None else self.start(input_ids, state, meta)
        e = ple_gather.gather(self.gather_key, inputs.rows, X.dtype, inputs.ticket).flatten(1)  # [T, embed_dim]
        kp, v = self._project(e)
        if meta.fixed_shape:
            return self._forward_fixed(X, kp, v, inputs.history, state, meta.recurrent)
        rec, out, s = meta.recurrent, torch.empty_like(X), 0
        for n, slot, has, d, snaps, history in zip(
            meta.query_lens_cpu, rec.slots, rec.has_state, rec.num_drafts, rec.snapshots, inputs.history
        ):
            if n == 0:
                continue
            rows = slice(s, s + n)
            window0 = state.ple_window[slot] if has else X.new_zeros(state.ple_window.shape[1:])
            o, columns = self.mix(X[rows], kp[rows], v[rows], window0[None], n)
            out[rows], columns = o, columns[0]
            if d > 0:  # a verify: the state after each token, for the commit to pick
                state.keep_ple_verify(slot, columns, history, snaps)
            else:
                for t, snap in [*snaps, (n, slot)]:
                    state.write_ple(snap, columns, history, t)
            s += n
        return out

    def _forward_fixed(self, X, kp, v, history: torch.Tensor, state: PLEState, rec) -> torch.Tensor:
        """A fixed-shape step (a compiled graph: ember.engine.executor.decode_batch): B sequences of n tokens,
        each read from its source slot and written to its slot in place, padding rows (-1) to the pools'
        scratch row; no per-sequence work, no host sync."""
        B = history.shape[0]
        n = X.shape[0] // B
        src, dst = state.scratch_index(rec.device_sources), state.scratch_index(rec.device_slots)
        window0 = torch.where((rec.device_sources >= 0)[:, None, None], state.ple_window[src], 0)
        out, columns = self.mix(X, kp, v, window0, n)
        state.ple_window[dst] = columns[:, n:]
        state.ple_ids[dst] = history[:, n:]
        return out

    def _project(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered rows e [T, embed_dim] (this rank's columns) -> key_proj(e) [T, n*H], value_proj(e) [T, H]."""
        k, v = self.key_proj(e), self.value_proj(e)
        if self.table.columns is not None:  # each rank's columns' share, summed
            from ember.distributed.comm import all_reduce

            k, v = all_reduce(torch.cat([k, v], dim=-1)).split([k.shape[-1], v.shape[-1]], dim=-1)
        return k, v

    def mix(self, X, kp, v, window0, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and the conv of B sequences of n tokens: X, kp [B n, n*H] (the streams, key_proj(e)),
        v [B n, H], window0 [B, window, n*H] (each sequence's carried conv input) -> (what the layer adds
        [B n, n*H], the conv's input columns [B, window + n, n*H]). The C++ kernel where it takes the
        tensors (ember.kernels.cpu_ple), else mix_reference."""
        if self.cpu_kernel and cpu_ple.supports(X, kp, v, window0):
            return cpu_ple.ple_mix(
                X,
                kp,
                v,
                self.norm_key.weight,
                self.norm_query.weight,
                self.norm_conv.weight,
                self.conv_weight,
                window0,
                self.norm_key.eps,
                self.cfg.ngram_size,
            )
        return self.mix_reference(X, kp, v, window0, n)

    def mix_reference(self, X, kp, v, window0, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """mix() in torch ops (the reference)."""
        B = window0.shape[0]
        k = self.norm_key(kp).unflatten(-1, (self.count, self.hidden))
        q = self.norm_query(X).unflatten(-1, (self.count, self.hidden))
        g = (k * q).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        g = g.abs().clamp_min(1e-6).sqrt() * g.sign()
        u = (torch.sigmoid(g) * v.unsqueeze(-2)).flatten(-2)  # [B n, n*H]
        columns = torch.cat([window0, self.norm_conv(u).view(B, n, -1)], dim=1)
        # SiLU of the causal depthwise conv (dilation N) at the last n columns
        w = self.conv_weight.unsqueeze(1)  # [n*H, 1, K]
        y = F.conv1d(columns.transpose(1, 2), w, groups=w.shape[0], dilation=self.cfg.ngram_size)  # [B, n*H, n]
        return u + F.silu(y.transpose(1, 2).reshape(B * n, -1)), columns

    # ---- weights -------------------------------------------------------------------------

    def load_weight(self, name: str, tensor: torch.Tensor, shard=None):
        """A checkpoint tensor named relative to the PLE ("key_proj.weight", "conv1d.weight",
        "ple_embedding.ngram_embedding.shard_3.weight", ...) -> (our name, shard) as the model's loader wants."""
        if name.startswith("ple_embedding.ngram_embedding."):
            rest = name.removeprefix("ple_embedding.ngram_embedding.")
            index = 0 if rest in ("weight", "weight_scale") else int(rest.split(".")[0].removeprefix("shard_"))
            if rest.endswith("weight_scale"):  # an fp8 shard's per-tensor scale: its rows read times it
                self._pending_scales[index] = float(tensor.float().reshape(-1)[0])
            else:
                self._add_table_shard(index, tensor)
            return "table", None
        if name.startswith("ple_embedding."):  # its int64 buffers (multipliers, sizes, offsets): checked, not kept
            self._check_constant(name.removeprefix("ple_embedding."), tensor)
            return name, None
        if name == "conv1d.weight":
            copy_checked(self.conv_weight, tensor.reshape(tensor.shape[0], -1), "ple.conv1d.weight")
            return "conv_weight", None
        module, _, suffix = name.partition(".")
        target = getattr(self, module, None)
        if isinstance(target, ReplicatedLinear):
            target.load_weight(suffix, tensor)
            return name, None
        if isinstance(target, GroupedZeroCenteredRMSNorm) and suffix == "weight":
            copy_checked(target.weight, tensor, f"ple.{name}")
            return name, None
        raise ModelLoadError(f"unexpected PLE weight ple.{name}")

    def _add_table_shard(self, index: int, tensor: torch.Tensor) -> None:
        if tensor.shape[-1] != self.table.dim:
            raise ModelLoadError(
                f"ple n-gram table shard {index}: rows of {tensor.shape[-1]}, the config needs {self.table.dim}"
            )
        self._pending_shards[index] = table_rows(tensor)

    def finish_table(self, parts: int) -> None:
        """Once every tensor is in: the shards in order, checked against the hash's row count."""
        got = self._pending_shards
        missing = sorted(set(range(parts)) - set(got))
        if missing:
            raise ModelLoadError(
                f"the checkpoint lacks PLE n-gram table shards {missing[:8]} of {parts} "
                "(ple_embedding.ngram_embedding.shard_N.weight); download every shard"
            )
        rows = sum(t.num_rows for t in got.values())
        if rows != self.hash.num_rows or len({t.num_rows for t in got.values()}) != 1:
            raise ModelLoadError(
                f"the PLE n-gram table has {rows} rows in {parts} shards; the config's hash needs "
                f"{self.hash.num_rows} in equal shards"
            )
        for i in range(parts):
            got[i].scale = self._pending_scales.get(i)
            if got[i].tensor.dtype.itemsize == 1 and got[i].scale is None:
                raise ModelLoadError(
                    f"PLE n-gram table shard {i} is {got[i].tensor.dtype} but the checkpoint has no "
                    f"ple_embedding.ngram_embedding.shard_{i}.weight_scale; the checkpoint is incomplete"
                )
            self.table.add_shard(i, got[i], parts)
        self._pending_shards, self._pending_scales = {}, {}
        if not offload_table(self.offload, self.table_bytes(), self.device):
            self.table.to_device(self.device, self.dtype)
        self._gather_key = ple_gather.register_table(self.table)

    def _check_constant(self, name: str, tensor: torch.Tensor) -> None:
        ours = {
            "layer_multipliers": self.hash.multipliers,
            "ngram_heads_vocab_sizes": self.hash.sizes,
            "ngram_heads_offsets": self.hash.offsets,
        }.get(name)
        if ours is not None and tensor.to(torch.int64).tolist() != ours:
            raise ModelLoadError(
                f"the checkpoint's ple_embedding.{name} {tensor.tolist()[:4]}... differs from what its config "
                f"derives {ours[:4]}...; the config (seed, ngram sizes, vocab) does not belong to these weights"
            )
