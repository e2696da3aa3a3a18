"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5, over the engine's varlen
step with its state in a RecurrentState slot per sequence.

Projections are held in one canonical layout whichever checkpoint layout they came from:
in_proj_qkvz = [q | k | v | z] (value heads in grouped order: head j reads key head j // r) and
in_proj_ba = [b | a]. Qwen3.5 stores these as four tensors (in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a); Qwen3-Next as two, interleaved per key-head group ([q_g, k_g, v_g, z_g] and [b_g, a_g]):
load_weight undoes the interleave. b and a stay separate from qkvz so that a quantized checkpoint
can keep them dense (hybrid.md, pitfall 5).

A step's sequences take one of three paths: decodes (one token) together, one recurrent step
for all of them; prefill chunks one at a time; verifies (a decode with drafts) token by token,
keeping every token's state for the runner to commit. All three run in two fused ops (conv + SiLU,
then the gated delta rule in place in the slot): C++ on CPU (ember/kernels/cpu_gated_delta_net.py,
unless CpuKernels turned them off), Triton on a GPU (ember/kernels/triton_gated_delta_net.py, one
interface). A prefill's recurrence runs token by token in them, except on a GPU with fla-core
installed, whose chunked kernels take it (ember/kernels/triton_chunked_delta_rule.py). The torch
path below (the chunked form for prefills) is their reference and the fallback.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ember.config.model_config import ModelConfig
from ember.errors import EmberError, ModelLoadError
from ember.kernels import cpu_gated_delta_net, triton_chunked_delta_rule
from ember.kernels.cpu_kernels import CpuKernels
from ember.kernels.metadata import AttentionMetadata
from ember.layers import gated_delta_rule as gdr
from ember.layers.linear import MergedColumnLinear, RowParallelLinear, copy_checked, get_tp_rank_size
from ember.layers.norm import GatedRMSNorm
from ember.layers.recurrent_state import RecurrentState


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device, quant_config=None, prefix: str = "", kernels=None):
        super().__init__()
        # device type -> the module of fused kernels for it: C++ on CPU where asked for (and built:
        # CpuKernels says), Triton on a GPU. Chosen here, not per step: a compiled step traces none of it.
        wanted = (kernels or CpuKernels()).gated_delta_net
        self.fused_ops = {"cpu": cpu_gated_delta_net} if wanted and cpu_gated_delta_net.available() else {}
        if torch.device(device).type == "cuda":
            from ember.kernels import triton_gated_delta_net  # imports triton: a GPU's dependency only

            self.fused_ops["cuda"] = triton_gated_delta_net
        # Tensor parallelism splits by key-head group: a rank holds nk / tp key heads, the value
        # heads that read them, and their state.
        self.tp_rank, self.tp_size = get_tp_rank_size()
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if nk % self.tp_size:
            raise ModelLoadError(f"linear_num_key_heads {nk} is not divisible by --tensor-parallel-size {self.tp_size}")
        self.nk, self.nv = nk // self.tp_size, nv // self.tp_size  # this rank's
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        key_dim, value_dim = nk * self.dk, nv * self.dv  # full sizes: the Linears narrow them

        def method(ours: str, *checkpoint_names: str):
            # dense unless every checkpoint tensor this layer fuses is quantized: an AWQ checkpoint keeps
            # in_proj_b / in_proj_a (the decay and beta gates) unquantized (hybrid.md, pitfall 5)
            if quant_config is None:
                return None
            methods = [quant_config.linear_method(f"{prefix}.{n}") for n in (ours, *checkpoint_names)]
            return None if any(m is None for m in methods) else methods[0]

        self.in_proj_qkvz = MergedColumnLinear(
            cfg.hidden_size,
            [key_dim, key_dim, value_dim, value_dim],
            dtype=dtype,
            device=device,
            quant_method=method("in_proj_qkvz", "in_proj_qkv", "in_proj_z"),
            shard_ids=("q", "k", "v", "z"),
        )
        self.in_proj_ba = MergedColumnLinear(
            cfg.hidden_size,
            [nv, nv],
            dtype=dtype,
            device=device,
            quant_method=method("in_proj_ba", "in_proj_b", "in_proj_a"),
            shard_ids=("b", "a"),
        )
        self.conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
        self.conv_weight = nn.Parameter(
            torch.empty(self.conv_dim, self.kernel, dtype=dtype, device=device), requires_grad=False
        )
        self.A_log = nn.Parameter(torch.empty(self.nv, dtype=dtype, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv, dtype=dtype, device=device), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, dtype, device, kernels, cfg.output_gate_type)
        self.out_proj = RowParallelLinear(
            value_dim, cfg.hidden_size, dtype=dtype, device=device, quant_method=method("out_proj")
        )

    def make_state(self, num_slots: int, device) -> RecurrentState:
        return RecurrentState(num_slots, *self.state_args(device))

    def state_args(self, device) -> tuple:
        """RecurrentState's arguments after num_slots (a PLE layer's state extends it: ember.layers.ple)."""
        return self.conv_dim, self.kernel, self.nv, self.dk, self.dv, self.conv_weight.dtype, device

    # ---- forward -------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, state: RecurrentState, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkvz = self.in_proj_qkvz(x)
        mixed, z = qkvz.split([self.conv_dim, qkvz.shape[-1] - self.conv_dim], dim=-1)  # [q | k | v]: the conv's
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)
        ops = self._kernels(mixed, state)
        if meta.fixed_shape:  # a compiled or captured decode step: its index tensors, no per-sequence work
            return self.out_proj(self._decode_graph(ops, mixed, z, a, b, state, meta.recurrent).flatten(1))
        gates = self._gates(a, b) if ops is None else None  # (g, beta) for the torch path
        out = torch.empty(T, self.nv, self.dv, dtype=x.dtype, device=x.device)
        rec = meta.recurrent
        decodes, s = [], 0
        for n, slot, has, d, snaps in zip(meta.query_lens_cpu, rec.slots, rec.has_state, rec.num_drafts, rec.snapshots):
            rows = slice(s, s + n)
            if n == 1 and d == 0:
                decodes.append((s, slot, has, snaps))
            elif n and ops and d > 0:
                out[rows] = self._verify_fused(ops, mixed[rows], a[rows], b[rows], state, slot, has, snaps)
            elif n and ops:
                out[rows] = self._prefill_fused(ops, mixed[rows], a[rows], b[rows], state, slot, has, snaps)
            elif n:
                g, beta = gates[0][rows], gates[1][rows]
                out[rows] = self._sequence(mixed[rows], g, beta, state, slot, has, d > 0, snaps)
            s += n
        if decodes and ops:
            self._decode_fused(ops, mixed, a, b, state, decodes, rec, out)
        elif decodes:
            self._decode(mixed, *gates, state, decodes, out)
        o = self.norm(out, z.view(T, self.nv, self.dv))
        return self.out_proj(o.flatten(1))

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta): the log decay -exp(A_log) softplus(a + dt_bias) in float32, beta = sigmoid(b)."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()

    def _kernels(self, mixed: torch.Tensor, state: RecurrentState):
        """The module of fused kernels this step's tensors fit (one dtype, one the kernels take), or None
        for the torch path."""
        ops = self.fused_ops.get(mixed.device.type)
        if (
            ops is None
            or not mixed.dtype == self.conv_weight.dtype == state.conv.dtype
            or mixed.dtype not in ops.DTYPES
        ):
            return None
        return ops

    def _decode_graph(self, ops, mixed, z, a, b, state: RecurrentState, rec) -> torch.Tensor:
        """A fixed-shape decode step (ember.engine.executor.decode_batch): one token per row, each
        updating its slot in place from its source (-1: zeros; padding rows touch no slot). Returns the
        gated norm's output [T, nv, dv]. Its snapshots are the executor's to take, after the step."""
        if ops is None:
            raise EmberError(
                "a compiled or captured hybrid decode step needs the fused Gated DeltaNet kernels; "
                "the executor should have kept this model eager"
            )
        T = mixed.shape[0]
        o = self._fused_step(ops, mixed, a, b, state, rec.device_sources, rec.device_slots)
        return self.norm(o.view(T, self.nv, self.dv), z.view(T, self.nv, self.dv))

    def _fused_step(self, ops, mixed, a, b, state: RecurrentState, src, dst) -> torch.Tensor:
        """One token per row through the fused kernels, each row's state from slot src to slot dst
        (in place; -1: zeros / not written) -> o [rows, nv * dv]."""
        conv_out = ops.causal_conv1d_silu(mixed, self.conv_weight, state.conv, src, dst)
        return ops.gated_delta_net(conv_out, a, b, self.A_log, self.dt_bias, state.ssm, src, dst)

    def _split(self, mixed: torch.Tensor):
        """conv output [L, C] -> q, k [L, nv, dk] (prepared, float32), v [L, nv, dv]."""
        key_dim = self.nk * self.dk
        q, k, v = mixed.split([key_dim, key_dim, self.nv * self.dv], dim=-1)
        L = mixed.shape[0]
        q, k = gdr.prepare_qk(q.reshape(L, self.nk, self.dk), k.reshape(L, self.nk, self.dk), self.nv)
        return q, k, v.reshape(L, self.nv, self.dv)

    def _sequence(
        self,
        mixed,
        g,
        beta,
        state: RecurrentState,
        slot: int,
        has: bool,
        verify: bool,
        snapshots: list[tuple[int, int]],
    ) -> torch.Tensor:
        """A prefill chunk (or a verify) of one sequence -> its core output [L, nv, dv]. snapshots:
        (t, slot) -> the state after t tokens is copied there (a verify's at commit)."""
        K = self.kernel
        conv0 = state.conv[slot] if has else torch.zeros_like(state.conv[slot])
        ssm0 = state.ssm[slot] if has else torch.zeros_like(state.ssm[slot])
        conv_out, window = gdr.causal_conv(mixed, conv0, self.conv_weight)
        q, k, v = self._split(conv_out)
        if verify:
            o, states = gdr.recurrent(q, k, v, g, beta, ssm0, keep_states=True)
            state.keep_verify(slot, states, window, snapshots)
            return o.to(mixed.dtype)
        outs, ssm, t0 = [], ssm0, 0
        for t, snap in [*snapshots, (q.shape[0], slot)]:  # the chunked form, cut at each snapshot
            if t > t0:
                o, ssm = gdr.chunked(q[t0:t], k[t0:t], v[t0:t], g[t0:t], beta[t0:t], ssm)
                outs.append(o)
            state.write(snap, ssm, window[:, t : t + K - 1])
            t0 = t
        return torch.cat(outs).to(mixed.dtype)

    def _decode(self, mixed, g, beta, state: RecurrentState, decodes: list[tuple], out) -> None:
        """One token for each of several sequences, batched: (row, slot, has a state, snapshots)."""
        rows = torch.tensor([r for r, _, _, _ in decodes], device=mixed.device)
        slots = torch.tensor([s for _, s, _, _ in decodes], device=mixed.device)
        conv0, ssm0 = state.conv[slots], state.ssm[slots]
        if not all(h for _, _, h, _ in decodes):  # a one-token prompt starts from zero
            keep = torch.tensor([h for _, _, h, _ in decodes], device=mixed.device)
            conv0 = torch.where(keep[:, None, None], conv0, 0)
            ssm0 = torch.where(keep[:, None, None, None], ssm0, 0)
        conv_out, conv1 = gdr.causal_conv_step(mixed[rows], conv0, self.conv_weight)
        q, k, v = self._split(conv_out)
        o, ssm1 = gdr.recurrent(q[None], k[None], v[None], g[rows][None], beta[rows][None], ssm0)
        state.conv[slots] = conv1
        state.ssm[slots] = ssm1
        for i, (_, slot, _, snaps) in enumerate(decodes):
            for _, snap in snaps:  # after its one token: the new state
                state.copy(slot, snap)
        out[rows] = o[0].to(out.dtype)

    def _decode_fused(self, ops, mixed, a, b, state: RecurrentState, decodes: list[tuple], rec, out) -> None:
        """_decode in the fused kernels: each slot's conv and SSM state updated in place (a sequence
        without one starts from zeros), no gather or scatter of the states. The index tensors are the
        step's (rec), built by the first layer and reused by the others."""
        dev = mixed.device
        slots = rec.index_tensor("decode_slots", lambda: [s for _, s, _, _ in decodes], dev)
        src = rec.index_tensor("decode_sources", lambda: [s if h else -1 for _, s, h, _ in decodes], dev)
        if len(decodes) < mixed.shape[0]:  # prefills or verifies beside them: this step's decode rows
            rows = rec.index_tensor("decode_rows", lambda: [r for r, _, _, _ in decodes], dev)
            mixed, a, b = mixed[rows], a[rows], b[rows]
        o = self._fused_step(ops, mixed, a, b, state, src, slots)
        for _, slot, _, snaps in decodes:
            for _, snap in snaps:  # after its one token: the new state
                state.copy(slot, snap)
        if len(decodes) < out.shape[0]:
            out[rows] = o.view(-1, self.nv, self.dv)
        else:
            out.copy_(o.view(out.shape))

    def _verify_fused(self, ops, mixed, a, b, state: RecurrentState, slot: int, has: bool, snapshots) -> torch.Tensor:
        """A verify in the fused kernels: the slot is left as it is; the conv window and the state after
        every token go to keep_verify, for the commit to pick the last accepted one."""
        L, dev = mixed.shape[0], mixed.device
        src = torch.tensor([slot if has else -1], dtype=torch.int64, device=dev)
        none = torch.tensor([-1], dtype=torch.int64, device=dev)
        windows = mixed.new_empty(1, self.conv_dim, self.kernel - 1 + L)
        conv_out = ops.causal_conv1d_silu(mixed, self.conv_weight, state.conv, src, none, windows)
        states = torch.empty(1, L, self.nv, self.dk, self.dv, dtype=torch.float32, device=dev)
        o = ops.gated_delta_net(conv_out, a, b, self.A_log, self.dt_bias, state.ssm, src, none, states)
        state.keep_verify(slot, states[0], windows[0], snapshots)
        return o.view(L, self.nv, self.dv)

    def _prefill_fused(self, ops, mixed, a, b, state: RecurrentState, slot: int, has: bool, snapshots) -> torch.Tensor:
        """A prefill chunk in the fused kernels (one sequence of L tokens): the conv in one call, then
        the recurrence piece by piece between the snapshots, each piece starting from the slot the last
        one wrote (the snapshot's), so nothing is gathered or copied and the last piece ends in the slot.
        On CPU the recurrence runs token by token in the C++ op: at 512 and 2,000 tokens it beats the
        torch chunked form by 2x (`ember bench gdn-prefill`, docs/tuning.md)."""
        L, K, dev = mixed.shape[0], self.kernel, mixed.device
        one = lambda i: torch.tensor([i], dtype=torch.int64, device=dev)  # noqa: E731
        if snapshots:  # their conv windows (the K - 1 inputs before t), before the conv below overwrites the slot's
            conv0 = state.conv[slot] if has else state.conv.new_zeros(state.conv.shape[1:])
            for t, snap in snapshots:
                if t >= K - 1:
                    state.conv[snap] = mixed[t - K + 1 : t].t()
                else:  # reaches back into the slot's window: its columns t.. are the inputs before 0
                    state.conv[snap] = torch.cat([conv0[:, t:], mixed[:t].t()], dim=1)
        prev = slot if has else -1
        conv_out = ops.causal_conv1d_silu(mixed, self.conv_weight, state.conv, one(prev), one(slot))
        outs, t0 = [], 0
        for t, snap in [*snapshots, (L, slot)]:
            if t > t0:
                piece = slice(t0, t)
                outs.append(
                    self._recurrence_piece(ops, conv_out[piece], a[piece], b[piece], state, one(prev), one(snap))
                )
            elif prev < 0:
                state.ssm[snap] = 0.0
            else:
                state.ssm[snap] = state.ssm[prev]
            prev, t0 = snap, t
        return torch.cat(outs).view(L, self.nv, self.dv)

    def _recurrence_piece(self, ops, conv_out, a, b, state: RecurrentState, src, dst) -> torch.Tensor:
        """One sequence's rows from the state in slot src to slot dst -> o [L, nv * dv]: on a GPU
        fla-core's chunked kernels where installed, else the fused kernel token by token."""
        L, dev = conv_out.shape[0], conv_out.device
        if dev.type == "cuda" and triton_chunked_delta_rule.available():
            key_dim = self.nk * self.dk
            q, k, v = conv_out.split([key_dim, key_dim, self.nv * self.dv], dim=-1)
            g, beta = self._gates(a, b)
            cu = torch.tensor([0, L], dtype=torch.int64, device=dev)
            o = triton_chunked_delta_rule.chunked_prefill(
                q.reshape(L, self.nk, self.dk),
                k.reshape(L, self.nk, self.dk),
                v.reshape(L, self.nv, self.dv),
                g,
                beta,
                state.ssm,
                cu,
                src,
                dst,
                cu_seqlens_cpu=torch.tensor([0, L]),
            )
            return o.reshape(L, -1)
        return ops.gated_delta_net(conv_out, a, b, self.A_log, self.dt_bias, state.ssm, src, dst)

    # ---- weights -------------------------------------------------------------------------

    def expected_shards(self, param_name: str) -> set:
        return {None}

    # checkpoint projection -> (our fused layer, the shards it holds in order)
    _PROJECTIONS = {
        "in_proj_qkv": ("in_proj_qkvz", "qkv"),
        "in_proj_z": ("in_proj_qkvz", "z"),
        "in_proj_b": ("in_proj_ba", "b"),
        "in_proj_a": ("in_proj_ba", "a"),
        "in_proj_qkvz": ("in_proj_qkvz", "qkvz"),
        "in_proj_ba": ("in_proj_ba", "ba"),
    }

    def load_weight(self, name: str, tensor: torch.Tensor, shard_id=None):
        """A checkpoint tensor named relative to the layer ("in_proj_qkvz.weight", "A_log", an AWQ
        "in_proj_qkv.qweight", ...) -> (our parameter name relative to the layer, the shards it filled)."""
        key_dim, value_dim = self.nk * self.dk * self.tp_size, self.nv * self.dv * self.tp_size
        proj, _, suffix = name.partition(".")
        if proj in self._PROJECTIONS and suffix:
            ours, sids = self._PROJECTIONS[proj]
            layer = getattr(self, ours)
            param = getattr(layer, suffix, None)
            if param is None or getattr(param, "output_dim", None) is None:
                raise ModelLoadError(
                    f"linear_attn.{name}: {ours} has no {suffix!r} (is the checkpoint quantized the "
                    "way its config says?)"
                )
            for sid, part in zip(sids, self._split_rows(proj, tensor, param.output_dim, key_dim, value_dim)):
                layer.load_weight(suffix, part, sid)
            return f"{ours}.{suffix}", set(sids)
        if name == "conv1d.weight":  # [C, 1, K], channels [q | k | v]: this rank's part of each
            w = tensor.reshape(tensor.shape[0], -1)
            if self.tp_size > 1 and w.shape[0] == 2 * key_dim + value_dim:
                w = torch.cat([self._rank_part(p) for p in w.split([key_dim, key_dim, value_dim])])
            copy_checked(self.conv_weight, w, "linear_attn.conv1d.weight")
            return "conv_weight", None
        if name in ("A_log", "dt_bias"):  # per value head
            copy_checked(self.get_parameter(name), self._rank_part(tensor), f"linear_attn.{name}")
            return name, None
        if name == "norm.weight":  # over dv, shared by every head
            copy_checked(self.norm.weight, tensor, f"linear_attn.{name}")
            return name, None
        if name.startswith("out_proj."):
            self.out_proj.load_weight(suffix, tensor)
            return name, None
        raise ModelLoadError(f"unexpected Gated DeltaNet weight linear_attn.{name}")

    def _split_rows(
        self, proj: str, tensor: torch.Tensor, dim: int, key_dim: int, value_dim: int
    ) -> list[torch.Tensor]:
        """A checkpoint projection's output dim (dim: rows of a weight, packed columns of AWQ's
        qweight) -> its parts in our shard order. Sizes are in output features, scaled to the
        tensor's units (8 int4 values per AWQ word)."""
        nk, r = self.nk * self.tp_size, self.nv // self.nk
        full = {
            "in_proj_qkv": 2 * key_dim + value_dim,
            "in_proj_z": value_dim,
            "in_proj_b": nk * r,
            "in_proj_a": nk * r,
            "in_proj_qkvz": 2 * key_dim + 2 * value_dim,
            "in_proj_ba": 2 * nk * r,
        }[proj]
        if tensor.shape[dim] * 8 == full or tensor.shape[dim] == full:
            unit = tensor.shape[dim] / full
        else:
            raise ModelLoadError(
                f"linear_attn.{proj} has {tensor.shape[dim]} outputs along dim {dim}; the config needs {full}"
            )
        if proj in ("in_proj_z", "in_proj_b", "in_proj_a"):
            return [tensor]
        if proj == "in_proj_qkv":
            sizes, groups = [int(n * unit) for n in (key_dim, key_dim, value_dim)], 1
        else:  # Qwen3-Next: interleaved per key-head group, [q_g | k_g | v_g | z_g] and [b_g | a_g]
            sizes = [self.dk, self.dk, r * self.dv, r * self.dv] if proj == "in_proj_qkvz" else [r, r]
            sizes, groups = [int(n * unit) for n in sizes], nk
        per_group, starts = sum(sizes), np.cumsum([0, *sizes])
        parts = []
        for p in range(len(sizes)):  # part p: its slice of every group, groups in order
            idx = (np.arange(groups)[:, None] * per_group + starts[p] + np.arange(sizes[p])[None, :]).reshape(-1)
            parts.append(_take(tensor, idx, dim))
        return parts

    def _rank_part(self, tensor: torch.Tensor) -> torch.Tensor:
        n = tensor.shape[0] // self.tp_size
        return tensor.narrow(0, self.tp_rank * n, n)


def _take(tensor, idx: np.ndarray, dim: int):
    """These indices along dim: of a torch tensor, or the rows of a packed GGUF matrix (GGUFTensor)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.index_select(dim, torch.from_numpy(idx)).contiguous()
    return tensor.take_rows(idx)
