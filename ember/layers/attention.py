"""Attention layer: store this step's K/V in the layer's paged cache, then ask the backend.

kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
block_id * block_size + offset. Slots < 0 (padding rows) are not written.
The cache must be created zeroed (torch.zeros): backends read whole blocks and mask the
unused tail, and uninitialised memory could hold NaN, which masking does not remove.

FP8 KV cache (the cache's dtype says so; the model does not know): each Attention holds fp32
scalar buffers k_scale / v_scale. Write: fp8(clamp(K / k_scale, +-max)) -- clamped because
e5m2 overflows to inf. Read: K ~= float(cache) * k_scale, folded by the backend into q and the
output. The scales come from the checkpoint (load_weight) or, failing that, from the first
step that writes the layer (vLLM's calculate_kv_scales: max|K| / 200, max|V| / 100), then
stay frozen. This step's k/v reach the backend as the fp8 values written, so a fresh prefill
sees the same quantization error as a chunk or a decode reading the cache.
A backend that stores K/V itself (stores_kv: triton) writes, and quantizes, this step's K/V and
reads them back from the cache; for the others this layer writes them first (write_kv_cache).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ember.errors import ConfigError, ModelLoadError
from ember.kernels.metadata import AttentionMetadata, RowSelection

log = logging.getLogger(__name__)

# --kv-cache-dtype -> cache element type (None = the model's dtype). "fp8" is e4m3, as vLLM on CUDA.
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0  # vLLM's headroom: 448 / 200 = 2.24x above the calibration max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """--kv-cache-dtype -> torch dtype; on a device given, checks that fp8 caches work there."""
    if name == "auto":
        return model_dtype
    if name == "bfloat16":
        return torch.bfloat16  # written with a cast, read widened: every backend takes a cache dtype apart from q's
    if name not in FP8_KV_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {name!r} is not one of auto, bfloat16, {', '.join(FP8_KV_DTYPES)}")
    dtype = FP8_KV_DTYPES[name]
    if device is not None:
        try:  # the three operations an fp8 cache needs: store bytes, gather blocks, widen
            cache = torch.zeros(2, 2, dtype=dtype, device=device)
            cache.view(torch.uint8)[torch.tensor([1], device=device)] = quantize_kv(
                torch.ones(1, 2, dtype=model_dtype, device=device), torch.ones((), device=device), dtype
            ).view(torch.uint8)
            cache.index_select(0, torch.tensor([1], device=device)).to(model_dtype)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(
                f"--kv-cache-dtype {name} does not work with --dtype {str(model_dtype).removeprefix('torch.')} "
                f"on {device} in this torch build ({e}); use --kv-cache-dtype auto"
            ) from None
    return dtype


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(x / scale)) in float32 arithmetic; never inf, whatever the format."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-fmax, fmax).to(dtype)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    all_valid: bool = False,
    fixed_shape: bool = False,
) -> None:
    """k, v [T, Hkv, D] -> kv_cache at slot_mapping (casts to the cache dtype).

    fixed_shape: a step built for torch.compile or CUDA-graph capture: see write_kv_cache_fixed."""
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if is_fp8(kv_cache.dtype):  # index_copy_ has no fp8 kernel on CPU: move the bytes
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    if fixed_shape:
        write_kv_cache_fixed(k, v, kv_cache, slot_mapping)
        return
    key_cache = kv_cache[0].view(-1, *kv_cache.shape[-2:])
    value_cache = kv_cache[1].view(-1, *kv_cache.shape[-2:])
    if all_valid:
        key_cache.index_copy_(0, slot_mapping, k)
        value_cache.index_copy_(0, slot_mapping, v)
        return
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache[slots] = k[valid]
    value_cache[slots] = v[valid]


def write_kv_cache_fixed(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The KV write of a fixed-shape step, with no data-dependent shapes (capturable): a padding
    row (slot -1) rewrites row 0's value at row 0's slot instead of being dropped; duplicate
    writes of one value, so their order does not matter. Row 0 is always real.

    One index_put_ on the 5-D cache itself, not on a view of it: traced by torch.compile, a write
    into kv_cache[0].view(...) is functionalized into a copy of the whole cache (measured: 83 ms
    per layer for the default model's 2 GB pool); on the tensor itself inductor writes in place."""
    valid = slot_mapping >= 0
    slots = torch.where(valid, slot_mapping, slot_mapping[:1])
    k = torch.where(valid[:, None, None], k, k[:1])
    v = torch.where(valid[:, None, None], v, v[:1])
    T, bs = slots.shape[0], kv_cache.shape[2]
    which = torch.cat(
        [torch.zeros(T, dtype=torch.int64, device=slots.device), torch.ones(T, dtype=torch.int64, device=slots.device)]
    )
    both = torch.cat([slots, slots])
    kv_cache.index_put_((which, both // bs, both % bs), torch.cat([k, v]))


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, backend, layer_idx: int = 0):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.backend, self.layer_idx = scale, backend, layer_idx
        # FP8 KV scales (fp32, per layer); used only when the cache is fp8. Not parameters:
        # a checkpoint need not hold them.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.kv_scales_frozen = False  # set by a checkpoint scale or by the first fp8 write

    def load_weight(self, name: str, tensor: torch.Tensor, shard=None):
        """Checkpoint KV scales ("k_scale", "v_scale", or the deprecated "kv_scale" for both)."""
        if name not in ("k_scale", "v_scale", "kv_scale"):
            raise ModelLoadError(
                f"attention layer {self.layer_idx} has no tensor {name!r} (it loads k_scale, v_scale, kv_scale)"
            )
        value = tensor.detach().float().abs().max()  # per-head scales: the largest, so nothing clips
        if tensor.numel() > 1:
            log.info(
                "layer %d: %s has %d values; using their max as the per-tensor scale",
                self.layer_idx,
                name,
                tensor.numel(),
            )
        for target in ("k_scale", "v_scale") if name == "kv_scale" else (name,):
            getattr(self, target).fill_(value.item())
        self.kv_scales_frozen = True
        return name, None

    @torch.no_grad()
    def calibrate_kv_scales(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """k_scale = max|K| / 200, v_scale = max|V| / 100 over this step's real tokens; then frozen."""
        if not meta.all_slots_valid:
            valid = meta.slot_mapping >= 0
            k, v = k[valid], v[valid]
        if k.numel() == 0:  # only padding: wait for real tokens
            return
        tiny = torch.finfo(torch.float32).tiny  # an all-zero first step must not give a zero scale
        self.k_scale.copy_((k.float().abs().amax() / K_SCALE_CONSTANT).clamp_min(tiny))
        self.v_scale.copy_((v.float().abs().amax() / V_SCALE_CONSTANT).clamp_min(tiny))
        self.kv_scales_frozen = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        select: RowSelection | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (after norm and RoPE) -> [T, Hq, D], or [R, Hq, D] for
        the selected rows only (every row's K/V is still written)."""
        fp8 = is_fp8(kv_cache.dtype)
        if fp8 and not self.kv_scales_frozen and not meta.fixed_shape:  # a capture's dummy step must not calibrate
            self.calibrate_kv_scales(k, v, meta)
        if self.backend.stores_kv:  # its own store kernel (triton) quantizes while writing; -1 skips
            self.backend.store_kv(k, v, kv_cache, meta.slot_mapping, *((self.k_scale, self.v_scale) if fp8 else ()))
        else:
            if fp8:
                k = quantize_kv(k, self.k_scale, kv_cache.dtype)
                v = quantize_kv(v, self.v_scale, kv_cache.dtype)
            write_kv_cache(k, v, kv_cache, meta.slot_mapping, meta.all_slots_valid, meta.fixed_shape)
        if select is not None:
            if select.meta is None:
                return q[:0]
            q, k, v, meta = q[select.rows], k[select.rows], v[select.rows], select.meta
        if fp8:
            return self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.k_scale, self.v_scale)
        return self.backend.forward(q, k, v, kv_cache, meta, self.scale)
