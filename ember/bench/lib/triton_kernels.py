"""Micro-benchmark of decode attention on CUDA: the Triton split-KV kernel against torch SDPA
over the same paged cache gathered into a padded [B, Hkv, L, D] batch (what a backend without
a paged kernel has to do every step), timed with CUDA events.

For scripts/gpu_check.py: bench_decode_attention(...) returns one row (a dict) per context
length; the caller prints the table. Each row also carries the largest difference between the
two outputs, so a fast but wrong kernel cannot hide in a speed table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.errors import ConfigError
from ember.kernels.metadata import AttentionMetadata

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def decode_case(
    batch_size: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    q_len: int,
    device,
    seed: int = 0,
):
    """Random q, a paged cache with shuffled (non-contiguous) block tables, metadata and fp8 scales:
    every sequence has `context` tokens, the last q_len of them this step's."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch_size * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=g).view(batch_size, blocks_per_seq).to(torch.int32)
    fp8 = kv_dtype in FP8
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    k_scale = v_scale = None
    if fp8:  # values as calibrated: max|x| / 200 (K), / 100 (V)
        k_scale, v_scale = cache[0].abs().max() / 200, cache[1].abs().max() / 100
        cache = torch.stack([cache[0] / k_scale, cache[1] / v_scale])
        k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    cache = cache.to(kv_dtype).to(device)
    q = torch.randn(batch_size * q_len, num_heads, head_dim, generator=g).to(dtype).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch_size * q_len,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(0, batch_size * q_len + 1, q_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch_size,), context, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        block_size=block_size,
        query_lens_cpu=[q_len] * batch_size,
        seq_lens_cpu=[context] * batch_size,
        max_query_len=q_len,
        max_seq_len=context,
    )
    return q, cache, meta, k_scale, v_scale


def gathered_sdpa(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The baseline: gather each sequence's blocks, widen fp8, one SDPA in q's dtype (causal within
    the last q_len positions for a verify)."""
    B, q_len = meta.num_seqs, meta.max_query_len
    Hq, D = q.shape[1], q.shape[2]
    Hkv = cache.shape[-2]
    L = meta.block_tables.shape[1] * meta.block_size
    idx = meta.block_tables.flatten()
    k = cache[0].index_select(0, idx).view(B, L, Hkv, D).transpose(1, 2).to(q.dtype)
    v = cache[1].index_select(0, idx).view(B, L, Hkv, D).transpose(1, 2).to(q.dtype)
    if k_scale is not None:
        k, v = k * k_scale.to(q.dtype), v * v_scale.to(q.dtype)
    pos_q = meta.seq_lens[:, None] - q_len + torch.arange(q_len, device=q.device)[None, :]  # [B, q_len]
    mask = torch.arange(L, device=q.device)[None, None, :] <= pos_q[:, :, None]  # [B, q_len, L]
    qb = q.view(B, q_len, Hq, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(B * q_len, Hq, D)


def time_ms(fn, iters: int, warmup: int, device: torch.device | None = None) -> float:
    """Median milliseconds of fn(): CUDA events on a GPU (the default), perf_counter on the CPU."""
    import statistics
    import time

    cuda = device is None or device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def bench_decode_attention(
    contexts=(512, 2048, 8192, 32768),
    batch_size: int = 8,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
    q_len: int = 1,
    iters: int = 50,
    warmup: int = 5,
    device: str = "cuda",
) -> list[dict]:
    """Triton split-KV decode vs gathered-KV SDPA at each context length (every sequence that long).

    kv_dtype: the cache's element type (None = dtype; torch.float8_e4m3fn / e5m2 for an fp8
    cache). q_len > 1 times a speculative verify. Returns rows with triton_ms, torch_ms,
    speedup, triton_gbps (KV bytes read per second), num_splits and max_abs_diff."""
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        raise ConfigError("bench_decode_attention times CUDA kernels; run it on a machine with a CUDA GPU")
    from ember.kernels.triton_decode import BLOCK_N, paged_decode_attention, plan_splits

    kv_dtype = kv_dtype or dtype
    scale = head_dim**-0.5
    rows = []
    for context in contexts:
        q, cache, meta, k_scale, v_scale = decode_case(
            batch_size, context, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_dtype, q_len, device
        )
        out = torch.empty_like(q)

        def triton_step():
            return paged_decode_attention(
                q,
                cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                q_len,
                context,
                q.shape[0],
                scale,
                out,
                k_scale,
                v_scale,
            )

        def torch_step():
            return gathered_sdpa(q, cache, meta, scale, k_scale, v_scale)

        diff = (triton_step().float() - torch_step().float()).abs().max().item()
        triton_ms, torch_ms = time_ms(triton_step, iters, warmup), time_ms(torch_step, iters, warmup)
        kv_bytes = 2 * batch_size * context * num_kv_heads * head_dim * cache.element_size()
        rows.append(
            dict(
                context=context,
                batch_size=batch_size,
                q_len=q_len,
                heads=f"{num_heads}/{num_kv_heads}",
                head_dim=head_dim,
                dtype=str(dtype).removeprefix("torch."),
                kv_dtype=str(kv_dtype).removeprefix("torch."),
                num_splits=plan_splits(batch_size, num_kv_heads, context, BLOCK_N, q.device)[0],
                triton_ms=triton_ms,
                torch_ms=torch_ms,
                speedup=torch_ms / triton_ms,
                triton_gbps=kv_bytes / triton_ms / 1e6,
                max_abs_diff=diff,
            )
        )
    return rows
