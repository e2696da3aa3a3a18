"""AWQ, activation-aware weight quantization (formats.md §2), on ember's own models in float32.

`awq_search(model, input_ids, G)` walks the decoder layers in order. For each layer it runs the
still-unchanged layer over the calibration tokens, recording the inputs of its Linears (and
keeping the output as the next layer's input, as AutoAWQ does), then, group by group:

  1. input_layernorm   -> q, k, v (fused qkv_proj), inspecting the whole self-attention
  2. v rows of qkv     -> o_proj, only when v_proj and o_proj have one shape (no GQA)
  3. post_attn norm    -> gate, up (fused gate_up_proj; every expert's w13 for MoE, with the
                          router's columns scaled too so routing is unchanged), inspecting the MLP
  4. up rows           -> down_proj (for MoE: per expert that received tokens)

searches the per-input-channel scale s over a 20-point alpha grid (AutoAWQ's duo scaling),
folds it in exactly (previous op / s, Linear columns * s), then searches a clipping range for
every quantized weight except q and k (AutoAWQ's symmetric search, or by default an asymmetric
one that also snaps the integer zero point; see clip_weight). With gptq=True every quantized weight
(q and k too) is then moved onto its own int4 grid by GPTQ's error-compensating rounding
(gptq_round), beyond AutoAWQ. The model stays dense float32; round-to-nearest packing of the
result (`pack_linear`) is the AWQ checkpoint. Nothing is quantized in place.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ember.config.model_config import ModelConfig
from ember.errors import ConfigError
from ember.kernels.metadata import AttentionMetadata
from ember.layers.activation import silu_and_mul
from ember.layers.moe import SparseMoeBlock
from ember.quant.awq_packing import pseudo_quantize, quantize_groups

log = logging.getLogger(__name__)

N_GRID = 20  # alpha in {0, 0.05, ..., 0.95}
CLIP_GRID, CLIP_MAX_SHRINK, CLIP_TOKENS = 20, 0.5, 512
SUGGESTED_GROUP_SIZES = (256, 128, 64, 32)


# ---- settings ------------------------------------------------------------------------------


def linear_shapes(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(HF Linear name, out_features, in_features) of every Linear an AWQ export quantizes."""
    H, D = cfg.hidden_size, cfg.head_dim
    shapes = [
        ("q_proj", cfg.num_heads * D, H),
        ("k_proj", cfg.num_kv_heads * D, H),
        ("v_proj", cfg.num_kv_heads * D, H),
        ("o_proj", H, cfg.num_heads * D),
    ]
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        I = cfg.intermediate_size
        shapes += [("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)]
    if cfg.num_experts:
        I = cfg.moe_intermediate_size
        shapes += [("experts.gate_proj", I, H), ("experts.up_proj", I, H), ("experts.down_proj", H, I)]
    return shapes


def check_quant_settings(cfg: ModelConfig, bits: int, group_size: int, zero_point: bool) -> None:
    """Refuse (ConfigError) what an AutoAWQ GEMM checkpoint cannot hold, before any work."""
    if bits != 4:
        raise ConfigError(
            f"--bits {bits} is not supported: AWQ checkpoints (AutoAWQ GEMM, vLLM) are 4-bit; use --bits 4"
        )
    if not zero_point:
        raise ConfigError(
            "symmetric AWQ (no --zero-point) is not supported: vLLM's AWQ kernels need zero points; use --zero-point"
        )
    if group_size <= 0:
        raise ConfigError(f"--group-size must be positive (got {group_size})")
    shapes = linear_shapes(cfg)
    bad_in = [f"{name} (in {i})" for name, _, i in shapes if i % group_size]
    if bad_in:
        g = math.gcd(*(i for _, _, i in shapes))
        works = [s for s in SUGGESTED_GROUP_SIZES if g % s == 0]
        hint = (
            f"group sizes that work for this model: {', '.join(map(str, works))}"
            if works
            else f"every input size is a multiple of {g} only"
        )
        raise ConfigError(
            f"--group-size {group_size} does not divide the input size of {', '.join(bad_in)}; "
            f"AWQ needs in_features % group_size == 0 for every quantized Linear. {hint}"
        )
    bad_out = [f"{name} (out {o})" for name, o, _ in shapes if o % 8]
    if bad_out:
        raise ConfigError(f"AWQ packs 8 output channels per int32, but {', '.join(bad_out)} is not a multiple of 8")


# ---- running pieces of a layer over the calibration tokens ---------------------------------


class Calib:
    """Runs a function of [N, ...] token rows in chunks of whole sequences (seq_len tokens each);
    `attention(attn)` wraps a self-attention module as a one-sequence-per-row-block prefill."""

    def __init__(self, model, seq_len: int, chunk_tokens: int = 8192):
        self.model, self.seq_len = model, seq_len
        self.rows = max(1, chunk_tokens // seq_len) * seq_len
        self._ctx: dict[int, tuple] = {}

    def ctx(self, n_tokens: int) -> tuple:
        """(cos_sin, kv_cache, meta) for a fresh prefill of n_tokens / seq_len sequences."""
        if n_tokens not in self._ctx:
            cfg, L = self.model.cfg, self.seq_len
            B = n_tokens // L
            cos, sin = self.model.model.rotary.get_cos_sin(torch.arange(L).repeat(B))
            kv = torch.zeros(2, B, L, cfg.num_kv_heads, cfg.head_dim)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(n_tokens),
                query_start_loc=torch.arange(0, n_tokens + 1, L, dtype=torch.int32),
                seq_lens=torch.full((B,), L, dtype=torch.int32),
                block_tables=torch.arange(B, dtype=torch.int32)[:, None],
                block_size=L,
                query_lens_cpu=[L] * B,
                seq_lens_cpu=[L] * B,
                max_query_len=L,
                max_seq_len=L,
                all_slots_valid=True,
            )
            self._ctx[n_tokens] = ((cos.float(), sin.float()), kv, meta)
        return self._ctx[n_tokens]

    def attention(self, attn) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: attn(x, *self.ctx(x.shape[0]))

    def layer(self, layer) -> Callable[[torch.Tensor], torch.Tensor]:
        """hidden (residual stream) in -> hidden out of one decoder layer."""

        def run(x):
            out, residual = layer(x, None, *self.ctx(x.shape[0]))
            return out + residual

        return run

    def map(self, fn, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([fn(x[i : i + self.rows]) for i in range(0, x.shape[0], self.rows)])

    def mse(self, fn, x: torch.Tensor, ref: torch.Tensor) -> float:
        total = 0.0
        for i in range(0, x.shape[0], self.rows):
            total += (fn(x[i : i + self.rows]) - ref[i : i + self.rows]).pow(2).sum().item()
        return total / ref.numel()


# ---- scale search ----------------------------------------------------------------------------


@dataclass
class ScaleGroup:
    """Linears that read one input x, and the op that produces x."""

    name: str
    prev: list[torch.Tensor]  # tensors whose output channels make x (norm weight, Linear rows/bias): / s
    weights: list[torch.Tensor]  # quantized [out, in] readers of x: columns * s
    x: torch.Tensor  # their recorded input [N, in]; divided by s once s is applied
    inspect: Callable[[torch.Tensor], torch.Tensor]  # x -> the output whose error the search minimises
    dense: list[torch.Tensor] = field(default_factory=list)  # unquantized readers of x (MoE router): * s


def search_scale(
    g: ScaleGroup, calib: Calib, group_size: int, n_grid: int = N_GRID
) -> tuple[torch.Tensor, list[float]]:
    """AutoAWQ's grid search: (best s [in], loss per alpha). The weights are left as they were."""
    ref = calib.map(g.inspect, g.x)
    x_mean = g.x.abs().mean(0)
    w = torch.cat(g.weights).abs()
    wg = w.view(-1, group_size)
    w_mean = (wg / (wg.amax(dim=1, keepdim=True) + 1e-6)).view(w.shape).mean(0)
    originals = [t.clone() for t in g.weights]
    best, best_s, losses = math.inf, None, []
    try:
        for r in range(n_grid):
            alpha = r / n_grid
            s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            s[~torch.isfinite(s)] = 1
            for t, o in zip(g.weights, originals):
                t.copy_(pseudo_quantize(o * s, group_size) / s)
            loss = calib.mse(g.inspect, g.x, ref)
            losses.append(loss)
            if loss < best:
                best, best_s = loss, s.clone()
    finally:
        for t, o in zip(g.weights, originals):
            t.copy_(o)
    if best_s is None:
        raise RuntimeError(f"AWQ scale search for {g.name}: no alpha gave a finite loss ({losses})")
    return best_s, losses


def apply_scale(g: ScaleGroup, s: torch.Tensor) -> None:
    """Fold s in exactly: prev op's output channels / s, readers' input columns * s, recorded x / s."""
    for t in g.prev:
        t.div_(s.view(-1, *([1] * (t.dim() - 1))))
    for t in [*g.weights, *g.dense]:
        t.mul_(s)
    g.x.div_(s)


# ---- clipping search -------------------------------------------------------------------------

CLIP_MODES = ("asym", "sym")
ASYM_PASSES = 2  # coordinate-descent rounds (hi, then lo) after the symmetric search


def _group_gram(x: torch.Tensor, ng: int, group_size: int) -> torch.Tensor:
    """Per input group the token-averaged Gram matrix X_g^T X_g / t: [ng, G, G]. The clipping
    objective mean_t (x_t,g . (Q(w)_g - w_g))^2 is exactly d^T H_g d with d = Q(w)_g - w_g."""
    xg = x.reshape(-1, ng, group_size).transpose(0, 1)  # [ng, t, G]
    return torch.bmm(xg.transpose(1, 2), xg) / xg.shape[1]


def _clip_err(
    wg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, gram: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Output error [rows, ng] of quantizing each (row, group) of wg [rows, ng, G] clamped to [lo, hi]."""
    rows, ng, _ = wg.shape
    clamped = torch.maximum(torch.minimum(wg, hi), lo).reshape(rows, -1)
    q = pseudo_quantize(clamped, group_size).view(rows, ng, group_size)
    d = (q - wg).transpose(0, 1)  # [ng, rows, G]
    return (torch.bmm(d, gram) * d).sum(-1).t()


def _take(better: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(better[..., None], new, old)


def clip_weight(
    w: torch.Tensor, x: torch.Tensor, group_size: int, mode: str = "asym", rows_per_batch: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipping search; clamps w in place per (row, group) and returns (error before, after)
    of the objective, each [out, in/G].

    sym: AutoAWQ's search: keep the max |w| (shrunk by up to 50%, 10 steps) whose quantized
    partial dot products with x (512 sampled tokens) best match the original ones, clamping both
    ends by the same amount.
    asym (beyond AutoAWQ): start from the sym result, then coordinate descent on the group's upper
    and lower clip separately (each end moved inward by 0..45% of the group's range in 5% steps,
    ASYM_PASSES rounds), then try the two clips nearest to the result whose -min/scale is an
    exact integer, so the integer zero point does not shift the grid. Only strict improvements
    are taken, so per (row, group) asym's error is never above sym's."""
    if mode not in CLIP_MODES:
        raise ValueError(f"clip mode {mode!r} is not one of {CLIP_MODES}")
    x = x[:: max(1, x.shape[0] // CLIP_TOKENS)]
    out_f, in_f = w.shape
    ng = in_f // group_size
    gram = _group_gram(x, ng, group_size)
    n_shrink = int(CLIP_MAX_SHRINK * CLIP_GRID)
    errs0, errs = [], []
    for r0 in range(0, out_f, rows_per_batch):
        wg = w[r0 : r0 + rows_per_batch].view(-1, ng, group_size)  # a view: the clamp below writes w
        wmax, wmin = wg.amax(dim=-1, keepdim=True), wg.amin(dim=-1, keepdim=True)
        org_max = torch.maximum(wmax, -wmin)
        best_lo, best_hi = wmin, wmax
        best_err = _clip_err(wg, wmin, wmax, gram, group_size)
        errs0.append(best_err)
        for i in range(1, n_shrink):
            m = org_max * (1 - i / CLIP_GRID)
            lo, hi = torch.maximum(-m, wmin), torch.minimum(m, wmax)
            err = _clip_err(wg, lo, hi, gram, group_size)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo, best_hi = _take(better, lo, best_lo), _take(better, hi, best_hi)
        if mode == "asym":
            span = wmax - wmin
            for _ in range(ASYM_PASSES):
                for end in ("hi", "lo"):
                    base_lo, base_hi = best_lo, best_hi
                    for j in range(n_shrink):
                        lo, hi = (
                            (base_lo, wmax - span * (j / CLIP_GRID))
                            if end == "hi"
                            else (wmin + span * (j / CLIP_GRID), base_hi)
                        )
                        if (lo >= hi).all():
                            continue
                        hi = torch.maximum(hi, lo)
                        err = _clip_err(wg, lo, hi, gram, group_size)
                        better = err < best_err
                        best_err = torch.where(better, err, best_err)
                        best_lo, best_hi = _take(better, lo, best_lo), _take(better, hi, best_hi)
            # Zero-point snap: the grid is (q - z) * s with z integer; shrink [lo, hi] to the nearest
            # ranges [-z s', (15 - z) s'] inside it, for z = floor and ceil of -lo / s.
            lo0, hi0 = best_lo, best_hi
            s = ((hi0 - lo0) / 15).clamp(min=1e-8)
            f = (-lo0 / s).clamp(0, 15)
            for z in (f.floor(), f.ceil()):
                s_lo = torch.where(z > 0, -lo0 / z.clamp(min=1), torch.full_like(s, math.inf))
                s_hi = torch.where(z < 15, hi0 / (15 - z).clamp(min=1), torch.full_like(s, math.inf))
                s2 = torch.minimum(s_lo, s_hi)
                ok = (lo0 < 0) & (hi0 > 0) & torch.isfinite(s2) & (s2 > 0)
                lo, hi = torch.where(ok, -z * s2, lo0), torch.where(ok, (15 - z) * s2, hi0)
                lo, hi = torch.maximum(lo, lo0), torch.minimum(hi, hi0)  # guard rounding: stay inside
                err = _clip_err(wg, lo, hi, gram, group_size)
                better = (err < best_err) & ok.squeeze(-1)
                best_err = torch.where(better, err, best_err)
                best_lo, best_hi = _take(better, lo, best_lo), _take(better, hi, best_hi)
        wg.copy_(torch.maximum(torch.minimum(wg, best_hi), best_lo))
        errs.append(best_err)
    return torch.cat(errs0), torch.cat(errs)


# ---- error-compensating rounding (GPTQ) ------------------------------------------------------

GPTQ_DAMP, GPTQ_BLOCK = 0.01, 128


def gptq_round(w: torch.Tensor, target: torch.Tensor, x: torch.Tensor, group_size: int) -> None:
    """Replace w [out, in] in place by a point of its own AWQ grid chosen by GPTQ (beyond AutoAWQ).

    The grid of every (row, group) is the one round-to-nearest packing of w uses (scale and integer
    zero from the group's min / max, so from the clipping search). The codes are chosen column by
    column, each column's rounding error spread over the columns not yet rounded through the inverse
    of H = X^T X / t (+1% damping), which minimises ||x (target - Q)^T||^2 better than rounding each
    weight to nearest. The element holding a group's min keeps code 0 and the one holding its max
    code 15, so packing the result (which re-derives scale and zero from min / max) gives the same
    grid and these codes exactly: the checkpoint format is unchanged."""
    out_f, in_f = w.shape
    ng = in_f // group_size
    _, scales, zeros = quantize_groups(w, group_size)  # [out, ng]
    wg = w.view(out_f, ng, group_size)
    has_range = wg.amax(-1) > wg.amin(-1)  # [out, ng]
    arg_lo, arg_hi = wg.argmin(-1), wg.argmax(-1)
    zeros = zeros.float()
    H = x.t().double() @ x.double() / x.shape[0]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    H += GPTQ_DAMP * torch.diag(H).mean() * torch.eye(in_f, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    W = target.clone().float()
    W[:, dead] = 0
    Q = torch.empty_like(W)
    for b0 in range(0, in_f, GPTQ_BLOCK):
        b1 = min(b0 + GPTQ_BLOCK, in_f)
        W1, Err1 = W[:, b0:b1].clone(), torch.zeros(out_f, b1 - b0)
        Hinv1 = Hinv[b0:b1, b0:b1]
        for k in range(b1 - b0):
            i = b0 + k
            g, j = divmod(i, group_size)
            s, z = scales[:, g], zeros[:, g]
            col = W1[:, k]
            q = (torch.round(col / s) + z).clamp(0, 15)
            q = torch.where(has_range[:, g] & (arg_lo[:, g] == j), torch.zeros_like(q), q)
            q = torch.where(has_range[:, g] & (arg_hi[:, g] == j), torch.full_like(q, 15.0), q)
            deq = (q - z) * s
            Q[:, i] = deq
            err = (col - deq) / Hinv1[k, k]
            W1[:, k:] -= err[:, None] * Hinv1[k, k:][None, :]
            Err1[:, k] = err
        W[:, b1:] -= Err1 @ Hinv[b0:b1, b1:]
    w.copy_(Q.to(w.dtype))


# ---- the walk over layers --------------------------------------------------------------------


def _record_inputs(layer, x: torch.Tensor, calib: Calib) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Run the unchanged layer; ({"qkv", "o", "mlp"[, "down"]}: recorded inputs, next layer's input)."""
    feats: dict[str, list] = defaultdict(list)

    def grab(name):
        return lambda module, args: feats[name].append(args[0].detach().clone())

    attn, mlp = layer.self_attn, layer.mlp
    watched = {"qkv": attn.qkv_proj, "o": attn.o_proj, "mlp": mlp}
    if not isinstance(mlp, SparseMoeBlock):
        watched["down"] = mlp.down_proj
    hooks = [m.register_forward_pre_hook(grab(name)) for name, m in watched.items()]
    try:
        x_next = calib.map(calib.layer(layer), x)
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v) for k, v in feats.items()}, x_next


def _rows(linear, shard) -> slice:
    return slice(linear.shard_offsets[shard], linear.shard_offsets[shard] + linear.shard_sizes[shard])


def _scale_groups(layer, feats: dict, calib: Calib) -> Iterator[ScaleGroup]:
    """The layer's groups in order; each is yielded after the previous one's scales are applied."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o = attn.qkv_proj, attn.o_proj
    yield ScaleGroup("qkv", [layer.input_layernorm.weight], [qkv.weight], feats["qkv"], calib.attention(attn))
    v = _rows(qkv, "v")
    if (qkv.shard_sizes["v"], qkv.in_features) == (o.out_features, o.in_features):  # no GQA
        prev = [qkv.weight[v]] + ([qkv.bias[v]] if qkv.bias is not None else [])
        yield ScaleGroup("o", prev, [o.weight], feats["o"], o)
    post_norm = layer.post_attention_layernorm.weight
    if not isinstance(mlp, SparseMoeBlock):
        gate_up = mlp.gate_up_proj
        yield ScaleGroup("gate_up", [post_norm], [gate_up.weight], feats["mlp"], mlp)
        up = _rows(gate_up, "up")
        prev = [gate_up.weight[up]] + ([gate_up.bias[up]] if gate_up.bias is not None else [])
        yield ScaleGroup("down", prev, [mlp.down_proj.weight], feats["down"], mlp.down_proj)
        return
    ex = mlp.experts
    H, I = ex.w13.shape[-1], ex.intermediate_size
    yield ScaleGroup("experts.gate_up", [post_norm], [ex.w13.view(-1, H)], feats["mlp"], mlp, dense=[mlp.gate.weight])
    _, ids = mlp.route(feats["mlp"])
    for e in range(ex.num_experts):
        rows = (ids == e).any(dim=-1).nonzero().squeeze(1)
        if rows.numel() == 0:  # no calibration token reached it: plain round-to-nearest
            continue
        feats[f"experts.{e}.rows"] = rows
        feats[f"experts.{e}.down"] = silu_and_mul(F.linear(feats["mlp"][rows], ex.w13[e]))
        w2 = ex.w2[e]
        yield ScaleGroup(
            f"experts.{e}.down", [ex.w13[e, I:]], [w2], feats[f"experts.{e}.down"], lambda t, w2=w2: F.linear(t, w2)
        )


def _clip_targets(layer, feats: dict, qk: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight view, its recorded input) for every quantized weight except (unless qk) q and k."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = attn.qkv_proj
    targets = [(qkv.weight[_rows(qkv, "v")], feats["qkv"]), (attn.o_proj.weight, feats["o"])]
    if qk:
        targets += [(qkv.weight[_rows(qkv, "q")], feats["qkv"]), (qkv.weight[_rows(qkv, "k")], feats["qkv"])]
    if not isinstance(mlp, SparseMoeBlock):
        return targets + [(mlp.gate_up_proj.weight, feats["mlp"]), (mlp.down_proj.weight, feats["down"])]
    for e in range(mlp.experts.num_experts):
        if f"experts.{e}.rows" in feats:
            targets += [
                (mlp.experts.w13[e], feats["mlp"][feats[f"experts.{e}.rows"]]),
                (mlp.experts.w2[e], feats[f"experts.{e}.down"]),
            ]
    return targets


@torch.no_grad()
def awq_search(
    model,
    input_ids: torch.Tensor,
    group_size: int,
    progress: bool | None = None,
    clip: str = "asym",
    clip_qk: bool = False,
    gptq: bool = False,
) -> None:
    """Fold AWQ scales into `model` (float32, dense) and clip its weights, in place.

    input_ids: int64 [num_samples, seq_len] calibration blocks, each run as its own sequence.
    clip: the clipping search, "asym" (separate lower / upper clip, zero-point snap) or "sym"
    (AutoAWQ's); see clip_weight. clip_qk: clip q and k too (AutoAWQ does not). gptq: after
    clipping, round every quantized weight with gptq_round against its unclipped values."""
    if clip not in CLIP_MODES:
        raise ConfigError(f"--clip {clip!r} is not one of {', '.join(CLIP_MODES)}")
    from tqdm import tqdm

    calib = Calib(model, input_ids.shape[1])
    x = model.model.embed_tokens(input_ids.flatten()).float()
    layers = model.model.layers
    for i, layer in enumerate(
        tqdm(layers, desc="AWQ", unit="layer", disable=None if progress is None else not progress)
    ):
        feats, x_next = _record_inputs(layer, x, calib)
        for group in _scale_groups(layer, feats, calib):
            s, losses = search_scale(group, calib, group_size)
            apply_scale(group, s)
            best = min(range(len(losses)), key=losses.__getitem__)
            log.debug(
                "layer %d %s: alpha %.2f, loss %.3g (alpha 0: %.3g)",
                i,
                group.name,
                best / N_GRID,
                losses[best],
                losses[0],
            )
        originals = [w.clone() for w, _ in _clip_targets(layer, feats, qk=True)] if gptq else []
        for w, inp in _clip_targets(layer, feats, clip_qk):
            errs = clip_weight(w, inp, group_size, clip)
            if errs is not None:
                log.debug(
                    "layer %d clip %s: error %.4g -> %.4g",
                    i,
                    tuple(w.shape),
                    errs[0].sum().item(),
                    errs[1].sum().item(),
                )
        if gptq:
            for (w, inp), target in zip(_clip_targets(layer, feats, qk=True), originals):
                gptq_round(w, target, inp, group_size)
        x = x_next
