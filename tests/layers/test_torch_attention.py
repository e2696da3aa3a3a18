"""TorchAttentionBackend vs a naive float64 reference, over every varlen path."""

from __future__ import annotations

import random

import pytest
import torch

from ember.errors import ConfigError
from ember.kernels import get_attention_backend
from ember.kernels.cpp_build import has_cpu_flags
from ember.kernels.metadata import AttentionMetadata
from ember.kernels.torch_attention import TorchAttentionBackend
from ember.layers.attention import Attention
from tests.models.tiny_models import one_thread

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

HQ, HKV, D, BS, NUM_BLOCKS = 6, 2, 16, 4, 400


def make_step(q_lens, seq_lens, dtype, seed=0):
    """Random cache (garbage everywhere), block tables, q/k/v for one step; writes through Attention."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NUM_BLOCKS, BS, HKV, D, generator=g).to(dtype)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range((s + BS - 1) // BS)] for s in seq_lens]
    T = sum(q_lens)
    q = torch.randn(T, HQ, D, generator=g).to(dtype)
    k = torch.randn(T, HKV, D, generator=g).to(dtype)
    v = torch.randn(T, HKV, D, generator=g).to(dtype)
    slots = []
    for n, s, bt in zip(q_lens, seq_lens, tables):
        slots += [bt[p // BS] * BS + p % BS for p in range(s - n, s)]
    width = max(len(t) for t in tables) + 2  # wider than needed, padded with block 0
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=BS,
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return q, k, v, cache, meta, tables


def reference(q, cache, meta, tables, scale):
    out, start = [], 0
    for n, s, bt in zip(meta.query_lens_cpu, meta.seq_lens_cpu, tables):
        keys = cache[0][bt].flatten(0, 1)[:s].double().repeat_interleave(HQ // HKV, dim=1)  # [s, HQ, D]
        vals = cache[1][bt].flatten(0, 1)[:s].double().repeat_interleave(HQ // HKV, dim=1)
        qs = q[start : start + n].double()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        pos_q = torch.arange(s - n, s)[:, None]
        scores = scores.masked_fill(torch.arange(s)[None, :] > pos_q, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals))
        start += n
    return torch.cat(out)


CASES = {
    "pure-decode": ([1, 1, 1, 1], [1, 9, 17, 30]),
    "fresh-prefills": ([5, 12, 1], [5, 12, 1]),
    "chunks": ([3, 4], [10, 4 + 4]),
    "mixed": ([1, 6, 3, 1, 7], [20, 6, 11, 2, 7]),
    "verify-alone": ([4], [23]),  # one sequence, a few queries over a cached prefix: folded GQA path
    "long-chunk-alone": ([18], [25]),  # more than VERIFY_MAX_QUERIES: the plain chunk path
    "verifies-and-long-chunk": ([3, 18, 2], [9, 30, 17]),
    # >= 128 queries: bf16 takes the C++ flash kernel, or without it the blocked-GEMM path
    # (cpu_causal_attention), blocks and tiles ending mid-way
    "long-prefill-alone": ([300], [300]),
    "long-chunk-over-prefix": ([200], [333]),
    "long-mixed": ([1, 150, 140, 2], [40, 150, 401, 30]),
}


@pytest.fixture(params=["cpp-kernel", "cpu-kernels-off", "torch-reference"])
def backend(request):
    """Each case through the cpu backend with the C++ kernels (decode and prefill; they must build
    here: g++ and ninja are in CI; the prefill kernel's bf16 form needs AVX512-BF16, which this
    project's Zen4 machines have and its Zen3 ones do not, its float32 form AVX2 + FMA), through it with them off (--no-cpu-paged-attention
    --no-cpu-flash-attention: the GEMM path for long bf16 prefills, else the reference's), and
    through the torch reference itself."""
    import ember.kernels.cpu_causal_attention as causal
    from ember.kernels.cpu_attention import CpuAttentionBackend
    from ember.kernels.cpu_paged_attention import paged_attention_op

    if request.param == "cpp-kernel":
        assert paged_attention_op() is not None, "the C++ CPU attention kernel did not build"
        if has_cpu_flags("avx512f", "avx512_bf16"):
            assert causal.flash_available(), "the C++ CPU prefill attention kernel did not build"
        if has_cpu_flags("avx512f") or has_cpu_flags("avx2", "fma"):
            assert causal.flash_available(torch.float32), "the C++ CPU prefill attention kernel did not build"
        return CpuAttentionBackend()
    if request.param == "cpu-kernels-off":
        return CpuAttentionBackend(fused_decode=False, flash=False)
    return TorchAttentionBackend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_reference(case, dtype, backend):
    q_lens, seq_lens = CASES[case]
    q, k, v, cache, meta, tables = make_step(q_lens, seq_lens, dtype)
    attn = Attention(HQ, D, HKV, D**-0.5, backend)
    out = attn(q, k, v, cache, meta)
    assert out.shape == q.shape and out.dtype == dtype
    # The new k/v landed in their slots.
    key_cache = cache[0].view(-1, HKV, D)
    assert torch.equal(key_cache[meta.slot_mapping], k)
    ref = reference(q, cache, meta, tables, D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max() < tol


def test_negative_slots_are_not_written():
    q, k, v, cache, meta, tables = make_step([1, 1], [3, 5], torch.float32)
    meta.slot_mapping[1] = -1
    before = cache.clone()
    Attention(HQ, D, HKV, D**-0.5, TorchAttentionBackend())(q, k, v, cache, meta)
    changed = (cache != before).any(dim=(0, 3, 4)).nonzero().tolist()  # [block, offset] pairs
    assert changed == [[tables[0][0], 2]]


def test_get_attention_backend():
    from ember.kernels.cpu_attention import CpuAttentionBackend
    from ember.kernels.cpu_kernels import CpuKernels

    assert type(get_attention_backend("torch")) is TorchAttentionBackend
    cpu = get_attention_backend("auto", "cpu", CpuKernels(paged_attention=False))
    assert isinstance(cpu, CpuAttentionBackend) and not cpu.fused_decode and cpu.flash
    assert cpu.fixed_shape_max_query_len == 1 and CpuAttentionBackend().fixed_shape_max_query_len == 16
    with pytest.raises(ConfigError, match="torch"):
        get_attention_backend("no-such-backend")
    assert isinstance(get_attention_backend("flashinfer"), CpuAttentionBackend)  # another engine's name: cpu here


@pytest.mark.parametrize("flash", [True, False])
def test_prefills_take_the_flash_or_gemm_path(monkeypatch, flash):
    """The C++ flash kernel (or, turned off or not built for this CPU, the GEMM path) really runs and
    matches for a bf16 fresh prefill and a chunk over a prefix; float32 queries (over a float32 or a
    bf16 cache) take the kernel's float32 form where it is built (AVX2 + FMA or AVX-512), SDPA with it
    off (float32 GEMMs are the slowest of the three: benchmarks/micro_causal_attention.py float32)."""
    import ember.kernels.cpu_causal_attention as causal
    from ember.kernels.cpu_attention import CpuAttentionBackend

    calls = []
    for name in ("flash_attention", "causal_attention_gemm"):
        real = getattr(causal, name)
        monkeypatch.setattr(causal, name, lambda *a, _n=name, _f=real: calls.append((_n, a[0].shape[0])) or _f(*a))
    bf16 = "flash_attention" if flash and causal.flash_available() else "causal_attention_gemm"
    f32 = (
        [("flash_attention", 150), ("flash_attention", 140)] if flash and causal.flash_available(torch.float32) else []
    )
    for backend, dtype, cache_dtype, expected in (
        (CpuAttentionBackend(flash=flash), torch.bfloat16, torch.bfloat16, [(bf16, 150), (bf16, 140)]),
        (CpuAttentionBackend(flash=flash), torch.float32, torch.float32, f32),
        (CpuAttentionBackend(flash=flash), torch.float32, torch.bfloat16, f32),
        (TorchAttentionBackend(), torch.bfloat16, torch.bfloat16, []),  # the reference: SDPA only
    ):
        calls.clear()
        q, k, v, cache, meta, tables = make_step([1, 150, 140, 2], [40, 150, 401, 30], dtype)
        # a fresh prefill reads the step's k / v, the rest the cache: values both hold exactly
        cache, k, v = cache.to(cache_dtype), k.to(cache_dtype).to(dtype), v.to(cache_dtype).to(dtype)
        out = Attention(HQ, D, HKV, D**-0.5, backend)(q, k, v, cache, meta)
        assert calls == expected
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out.double() - reference(q, cache, meta, tables, D**-0.5)).abs().max() < tol


@pytest.mark.parametrize(
    "hq,hkv,d", [(8, 1, 64), (4, 4, 128), (16, 2, 32), (12, 4, 80), (12, 2, 64), (9, 3, 64), (64, 8, 128)]
)
@pytest.mark.parametrize(
    "cache_dtype,q_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float8_e4m3fn, torch.float32),
    ],
)
@pytest.mark.parametrize("peaky", [False, True])
def test_cpp_kernel_matches_reference_across_shapes(hq, hkv, d, cache_dtype, q_dtype, peaky):
    """The fused kernel alone: GQA 8/1/8/3/6 (6 has no fixed-group path) and head sizes 32..128,
    every kv head of a query in one task (1..8 of them),
    contexts ending mid-block, a query that sees one key, queries of one sequence seeing different
    prefixes (a verify); bf16/fp16/fp32 take the AVX-512 path (AVX2 on CPUs without AVX-512), fp8
    the scalar one; bf16 queries over
    a bf16 cache score with bf16 dot products (head sizes 32/64/128 and fixed groups; the others
    convert them). peaky: scores spread over hundreds, so most of exp(score - max) underflow (the
    vector exp's clamp)."""
    from ember.kernels.cpu_paged_attention import paged_attention, paged_attention_op

    assert paged_attention_op() is not None
    g = torch.Generator().manual_seed(hq * d)
    bs, nblocks = 16, 40
    cache = torch.randn(2, nblocks, bs, hkv, d, generator=g).to(cache_dtype)
    tables = torch.randperm(nblocks, generator=g)[:30].view(3, 10).to(torch.int32)
    seq_idx = torch.tensor([0, 1, 1, 1, 2], dtype=torch.int32)
    kv_lens = torch.tensor([1, 77, 78, 79, 160], dtype=torch.int32)
    q = (torch.randn(5, hq, d, generator=g) * (40.0 if peaky else 1.0)).to(q_dtype)
    # the op itself: float32 out whatever q's dtype (the wrapper casts back to q's)
    out = torch.ops.ember_cpu.paged_attention(q, cache, tables, seq_idx, kv_lens, d**-0.5)
    assert out.dtype == torch.float32
    assert torch.equal(paged_attention(q, cache, tables, seq_idx, kv_lens, d**-0.5), out.to(q_dtype))
    for i in range(5):
        keys = cache[0][tables[seq_idx[i]].long()].flatten(0, 1)[: kv_lens[i]].double().repeat_interleave(hq // hkv, 1)
        vals = cache[1][tables[seq_idx[i]].long()].flatten(0, 1)[: kv_lens[i]].double().repeat_interleave(hq // hkv, 1)
        p = (torch.einsum("hd,khd->hk", q[i].double(), keys) * d**-0.5).softmax(-1)
        ref = torch.einsum("hk,khd->hd", p, vals)
        assert (out[i].double() - ref).abs().max() < 1e-4, i


@pytest.mark.parametrize("kv_len", [100, 300, 1000])
@pytest.mark.parametrize("hkv", [1, 3])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_cpp_kernel_splits_a_long_context_over_threads(kv_len, hkv, q_dtype):
    """One sequence, one or three kv heads, 2 threads: contexts of >= 128 keys run as parts on both
    threads and their softmax states are merged (300 keys: 4 parts, the last one short); 100 keys
    stay whole. float32 and bf16 queries (the bf16 dot-product path)."""
    from ember.kernels.cpu_paged_attention import paged_attention_op

    assert paged_attention_op() is not None
    g = torch.Generator().manual_seed(kv_len)
    hq, d, bs = 3 * hkv, 64, 16
    nblocks = kv_len // bs + 2
    cache = torch.randn(2, nblocks, bs, hkv, d, generator=g).to(torch.bfloat16)
    tables = torch.randperm(nblocks, generator=g).view(1, nblocks).to(torch.int32)
    q = (torch.randn(1, hq, d, generator=g) * 4).to(q_dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = torch.ops.ember_cpu.paged_attention(
            q, cache, tables, torch.zeros(1, dtype=torch.int32), torch.tensor([kv_len], dtype=torch.int32), d**-0.5
        )
    finally:
        torch.set_num_threads(before)
    keys = cache[0][tables[0].long()].flatten(0, 1)[:kv_len].double().repeat_interleave(hq // hkv, 1)
    vals = cache[1][tables[0].long()].flatten(0, 1)[:kv_len].double().repeat_interleave(hq // hkv, 1)
    p = (torch.einsum("hd,khd->hk", q[0].double(), keys) * d**-0.5).softmax(-1)
    assert (out[0].double() - torch.einsum("hk,khd->hd", p, vals)).abs().max() < 1e-4
