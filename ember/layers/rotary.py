"""Rotary position embedding (rotate_half / NEOX layout) with HF's inv_freq for default,
linear, llama3 and yarn scaling.

inv_freq follows transformers' rope init functions op for op (same fp32 ops in the same
order), so cos/sin match HF bit for bit. cos/sin are cached in float32 for every position up
to max_position_embeddings (built on first use, grown if a position goes past it) and looked
up once per step; the rotation runs in float32 and casts back to the activation dtype.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ember.config.model_config import RopeConfig
from ember.errors import UnsupportedModelError
from ember.kernels import cpu_fused_elementwise as fused
from ember.kernels.tracing import tracing


def rotary_dim(head_dim: int, rope: RopeConfig) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def compute_inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention_factor that multiplies cos and sin)."""
    dim = rotary_dim(head_dim, rope)
    base = rope.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if rope.type == "default":
        return inv_freq, 1.0
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.type == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    raise UnsupportedModelError(f"rope type {rope.type!r} is not supported; use default, linear, llama3 or yarn")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    factor, lo, hi = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / lo, old_len / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    orig = rope.original_max_position_embeddings or max_position_embeddings

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = mscale(factor)

    def correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 = keep the original frequency (high-frequency dims)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, rot/2]. Rotates the first `rot` dims, passes the rest.

    Computes in cos/sin's dtype: the model passes them in its own dtype, as HF does (so bf16
    matches HF's bf16 and costs no float32 round trip). use_kernel: the caller's
    CpuKernels.fused_elementwise (the C++ pass where x fits it).
    """
    if use_kernel and fused.applies_rotary(x, cos):
        return fused.rotary(x, cos, sin)
    rot = cos.shape[-1] * 2
    xr = x[..., :rot].to(cos.dtype)
    x1, x2 = xr.chunk(2, dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    # Same products as HF's q*cos + rotate_half(q)*sin with cos = cat(c, c).
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    if rot == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rot:]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, rope: RopeConfig, max_position_embeddings: int, device: torch.device | str = "cpu"
    ):
        super().__init__()
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_factor = compute_inv_freq(rope, head_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.cos_cache: torch.Tensor | None = None  # [P, rot/2] float32
        self.sin_cache: torch.Tensor | None = None

    def ensure_capacity(self, num_positions: int) -> None:
        """Build (or grow) the cos/sin cache to cover positions < num_positions. Call before
        CUDA-graph capture or torch.compile if positions may pass max_position_embeddings."""
        if self.cos_cache is not None and self.cos_cache.shape[0] >= num_positions:
            return
        n = max(num_positions, self.max_position_embeddings)
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = t[:, None] * self.inv_freq[None, :]
        self.cos_cache = freqs.cos() * self.attention_factor
        self.sin_cache = freqs.sin() * self.attention_factor

    def get_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) each [T, rot/2] float32; computed once per step, shared by all layers."""
        if self.cos_cache is None:
            self.ensure_capacity(self.max_position_embeddings)
        if not tracing(positions) and positions.numel() and positions.device.type == "cpu":
            # CPU: the check is free. GPU runners call ensure_capacity(max_model_len) up front.
            self.ensure_capacity(int(positions.max()) + 1)
        return self.cos_cache[positions], self.sin_cache[positions]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.get_cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
