"""Triton attention (split-KV decode, varlen prefill, KV store, the backend) against the torch
reference backend, on fresh random inputs.

Without a GPU these run in Triton's interpreter on CPU tensors (tests/kernels/conftest.py sets
TRITON_INTERPRET=1 before triton is imported). The interpreter's bf16 dot and its bf16 / fp8
casts are wrong (see ember/kernels/triton_utils.py): under it the kernels take their fp32-dot
and pre-rounded-cast paths, so bf16 and fp8 cases run here too, but they check those paths,
not the GPU's bf16 tl.dot (which scripts/gpu_check.py measures through triton_bench).
Sizes are tiny: the interpreter costs about 0.5 ms per program and op.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from ember.errors import ConfigError  # noqa: E402
from ember.kernels import get_attention_backend, resolve_attention_backend  # noqa: E402
from ember.kernels.metadata import AttentionMetadata  # noqa: E402
from ember.kernels.torch_attention import TorchAttentionBackend  # noqa: E402
from ember.kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from ember.kernels.triton_decode import paged_decode_attention  # noqa: E402
from ember.kernels.triton_kv_store import store_kv  # noqa: E402
from ember.kernels.triton_prefill import paged_prefill_attention  # noqa: E402
from ember.layers.attention import Attention, quantize_kv, write_kv_cache  # noqa: E402
from tests.models.tiny_models import one_thread  # noqa: E402

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
D, HKV = 16, 2
NUM_BLOCKS = 24


class Step:
    """One varlen step: q, this step's k/v (as the cache holds them), a cache of garbage around
    shuffled block tables with this step's K/V written, and its metadata."""

    def __init__(self, q_lens, seq_lens, block_size, group, dtype, kv_dtype=None, num_kv_heads=HKV, seed=0, pad_rows=0):
        g = torch.Generator().manual_seed(seed)
        kv_dtype = kv_dtype or dtype
        self.hq, self.hkv = num_kv_heads * group, num_kv_heads
        fp8 = kv_dtype in (E4M3, E5M2)
        # Scales as calibration would set them (max|x| / 200, / 100 for x ~ 3 * randn), else none.
        self.k_scale = torch.tensor(12.0 / 200) if fp8 else None
        self.v_scale = torch.tensor(12.0 / 100) if fp8 else None
        garbage = torch.randn(2, NUM_BLOCKS, block_size, num_kv_heads, D, generator=g) * 3
        self.cache = (
            torch.stack(
                [quantize_kv(garbage[0], self.k_scale, kv_dtype), quantize_kv(garbage[1], self.v_scale, kv_dtype)]
            )
            if fp8
            else garbage.to(kv_dtype)
        )
        free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(free)
        tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
        T = sum(q_lens) + pad_rows
        self.q = torch.randn(T, self.hq, D, generator=g).to(dtype)
        k = (torch.randn(T, num_kv_heads, D, generator=g) * 3).to(dtype)
        v = (torch.randn(T, num_kv_heads, D, generator=g) * 3).to(dtype)
        slots = []
        for n, s, bt in zip(q_lens, seq_lens, tables):
            slots += [bt[p // block_size] * block_size + p % block_size for p in range(s - n, s)]
        slots += [-1] * pad_rows
        width = max(len(t) for t in tables) + 1  # wider than needed, padded with block 0
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            block_size=block_size,
            query_lens_cpu=list(q_lens),
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
        self.k_raw, self.v_raw = k, v  # as the layer gets them (before fp8 quantization)
        if fp8:
            k, v = quantize_kv(k, self.k_scale, kv_dtype), quantize_kv(v, self.v_scale, kv_dtype)
        self.unwritten_cache = self.cache.clone()
        write_kv_cache(k, v, self.cache, self.meta.slot_mapping)
        self.k, self.v = k, v  # as the reference backend gets them: what the cache holds
        self.scale = D**-0.5

    def reference(self) -> torch.Tensor:
        scales = (self.k_scale, self.v_scale) if self.k_scale is not None else ()
        return TorchAttentionBackend().forward(self.q, self.k, self.v, self.cache, self.meta, self.scale, *scales)

    def to(self, device):
        for name in ("q", "k", "v", "k_raw", "v_raw", "cache", "unwritten_cache", "k_scale", "v_scale"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))
        m = self.meta
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(m, name, getattr(m, name).to(device))
        return self


def assert_close_to_reference(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    # Relative to max|ref|. fp32: summation order only (measured <= 8e-7). bf16: the reference's
    # own roundings -- its fresh-prefill path runs SDPA in bf16, and for an fp8 cache it rounds
    # q * k_scale and out * v_scale to bf16 (measured <= 6.7e-3; bf16 decodes agree exactly).
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * ref.float().abs().max().item(), err


def decode(step, **kw):
    m = step.meta
    return paged_decode_attention(
        step.q,
        step.cache,
        m.block_tables,
        m.seq_lens,
        m.query_start_loc,
        m.max_query_len,
        m.max_seq_len,
        sum(m.query_lens_cpu),
        step.scale,
        torch.zeros_like(step.q),
        step.k_scale,
        step.v_scale,
        **kw,
    )


def prefill(step, **kw):
    m = step.meta
    return paged_prefill_attention(
        step.q,
        step.cache,
        m.block_tables,
        m.seq_lens,
        m.query_start_loc,
        m.max_query_len,
        step.scale,
        torch.zeros_like(step.q),
        step.k_scale,
        step.v_scale,
        **kw,
    )


# Contexts end mid-block for both block sizes; the shortest sequences leave later splits empty.
DECODE_SEQ_LENS = [37, 5, 70]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("q_len", [1, 4])
def test_split_kv_decode_matches_reference(block_size, group, q_len):
    step = Step(
        [q_len] * 3,
        DECODE_SEQ_LENS,
        block_size,
        group,
        torch.float32,
        num_kv_heads=1 if group == 8 else HKV,
        seed=block_size + group + q_len,
    ).to(DEVICE)
    ref = step.reference()
    # 16-key tiles over 70 keys: 5 tiles, 3 splits of 2 tiles (the last one short).
    assert_close_to_reference(decode(step, num_splits=3, block_n=16), ref, torch.float32)
    assert_close_to_reference(decode(step, num_splits=1, block_n=32), ref, torch.float32)  # one split: no merge


@pytest.mark.parametrize(
    "dtype, kv_dtype", [(torch.bfloat16, None), (torch.float32, E4M3), (torch.bfloat16, E4M3), (torch.float32, E5M2)]
)
@pytest.mark.parametrize("q_len", [1, 4])
def test_split_kv_decode_dtypes(dtype, kv_dtype, q_len):
    step = Step([q_len] * 3, DECODE_SEQ_LENS, 16, 3, dtype, kv_dtype, seed=q_len).to(DEVICE)
    assert_close_to_reference(decode(step, num_splits=3, block_n=16), step.reference(), dtype)


def test_split_kv_decode_uneven_query_lens():
    """A verify batch where sequences draft different numbers of tokens (q_len 1..5), one
    sequence shorter than its query count's block."""
    step = Step([1, 5, 3, 2], [50, 9, 33, 2], 16, 3, torch.float32, seed=7).to(DEVICE)
    assert_close_to_reference(decode(step, num_splits=2, block_n=16), step.reference(), torch.float32)


# A fresh prompt, a decode, a chunk over a cached prefix, and a longer chunk: one mixed step.
PREFILL_CASE = ([20, 1, 13, 33], [20, 40, 50, 50])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_varlen_prefill_matches_reference(block_size, group):
    q_lens, seq_lens = PREFILL_CASE
    step = Step(
        q_lens,
        seq_lens,
        block_size,
        group,
        torch.float32,
        num_kv_heads=1 if group == 8 else HKV,
        seed=block_size * group,
    ).to(DEVICE)
    assert_close_to_reference(prefill(step), step.reference(), torch.float32)


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.bfloat16, None), (torch.float32, E4M3), (torch.bfloat16, E4M3)])
def test_varlen_prefill_dtypes(dtype, kv_dtype):
    q_lens, seq_lens = PREFILL_CASE
    step = Step(q_lens, seq_lens, 16, 3, dtype, kv_dtype, seed=3).to(DEVICE)
    # 8-key tiles: a tile ends mid-block, and the query tiles cut the 33-token chunk mid-way.
    assert_close_to_reference(prefill(step, block_q=16, block_n=16), step.reference(), dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, E4M3, E5M2])
def test_kv_store_matches_the_torch_write(kv_dtype):
    """Bit-exact with the layer's torch path (quantize_kv + write_kv_cache), -1 slots untouched;
    the values span fp8's subnormals, ties and the clamp."""
    g = torch.Generator().manual_seed(0)
    T, block_size = 21, 16
    dtype = torch.float32 if kv_dtype in (E4M3, E5M2) else kv_dtype
    k = (torch.randn(T, HKV, D, generator=g) * torch.logspace(-4, 1, D)).to(dtype)  # 1e-4 .. 10
    v = (torch.randn(T, HKV, D, generator=g) * 40).to(dtype)  # beyond 448 * v_scale: clamped
    k_scale, v_scale = torch.tensor(0.01), torch.tensor(0.05)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=g)[:T]
    slots[[3, 8, 20]] = -1
    cache = torch.randn(2, NUM_BLOCKS, block_size, HKV, D, generator=g).to(kv_dtype)
    expected = cache.clone()
    fp8 = kv_dtype in (E4M3, E5M2)
    if fp8:
        write_kv_cache(quantize_kv(k, k_scale, kv_dtype), quantize_kv(v, v_scale, kv_dtype), expected, slots)
    else:
        write_kv_cache(k, v, expected, slots)
    cache, k, v, slots = cache.to(DEVICE), k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE)
    store_kv(k, v, cache, slots, *((k_scale.to(DEVICE), v_scale.to(DEVICE)) if fp8 else ()))
    assert torch.equal(cache.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", [None, E4M3])
@pytest.mark.parametrize("shape", ["verify", "mixed"])
def test_attention_layer_with_triton_backend(shape, kv_dtype):
    """Through the attention layer: the backend's store kernel writes (and quantizes) the step's
    K/V, the dispatcher picks the kernel, padding rows (slot -1, past the last sequence) stay zero."""
    q_lens, seq_lens = ([4, 1, 9], [40, 17, 9]) if shape == "verify" else PREFILL_CASE
    step = Step(q_lens, seq_lens, 16, 3, torch.float32, kv_dtype, seed=11, pad_rows=2).to(DEVICE)

    def layer(backend):
        attn = Attention(step.hq, D, step.hkv, step.scale, backend).to(DEVICE)
        if kv_dtype is not None:
            attn.k_scale.copy_(step.k_scale)
            attn.v_scale.copy_(step.v_scale)
            attn.kv_scales_frozen = True
        return attn

    cache_ref, cache_tri = step.unwritten_cache.clone(), step.unwritten_cache.clone()
    ref = layer(TorchAttentionBackend())(step.q, step.k_raw, step.v_raw, cache_ref, step.meta)
    out = layer(TritonAttentionBackend())(step.q, step.k_raw, step.v_raw, cache_tri, step.meta)
    assert torch.equal(cache_tri.view(torch.uint8), cache_ref.view(torch.uint8))
    assert_close_to_reference(out, ref, torch.float32)
    assert (out[-2:] == 0).all()


def test_backend_selection(monkeypatch):
    assert resolve_attention_backend("auto", "cpu") == "cpu"
    assert isinstance(get_attention_backend("triton", DEVICE), TritonAttentionBackend)
    with pytest.raises(ConfigError, match="auto, torch, cpu, triton"):
        get_attention_backend("flash")
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ConfigError, match="--attention-backend torch"):
            get_attention_backend("triton", "cpu")
        from ember.config import EngineConfig

        with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
            EngineConfig(attention_backend="triton", device="cpu")


@pytest.mark.engine
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_greedy_tokens_match_torch_backend(tiny_model_dir, kv_cache_dtype):
    """A tiny random Llama (GQA 3:1) through the whole engine: chunked prefill (a 32-token
    budget), mixed steps and batched decodes give the same greedy tokens with either backend."""
    from ember import SamplingParams
    from tests.engine.test_engine import greedy, make_llm
    from tests.models.tiny_models import random_prompt

    path = tiny_model_dir("llama")
    prompts = [random_prompt(n, seed) for seed, n in enumerate([5, 40, 17])]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = make_llm(
            path,
            attention_backend=backend,
            block_size=16,
            max_num_batched_tokens=32,
            kv_cache_dtype=kv_cache_dtype,
            device=DEVICE,
        )
        assert llm.engine.parts.loaded.model.model.layers[0].self_attn.attn.backend.name == backend
        tokens[backend] = greedy(llm, prompts, params)
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 8 for t in tokens["torch"])


@pytest.mark.parametrize("kv_dtype, q_len", [(torch.float32, 1), (E4M3, 4)])
def test_bench_baseline_agrees_with_the_kernel(kv_dtype, q_len):
    """triton_bench's gathered-SDPA baseline and its case builder (the timing itself needs CUDA)."""
    from ember.bench.lib import triton_kernels as triton_bench

    q, cache, meta, k_scale, v_scale = triton_bench.decode_case(
        3, 45, 8, 2, D, 16, torch.float32, kv_dtype, q_len, DEVICE
    )
    out = paged_decode_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        q_len,
        45,
        q.shape[0],
        0.25,
        torch.empty_like(q),
        k_scale,
        v_scale,
    )
    torch.testing.assert_close(
        out, triton_bench.gathered_sdpa(q, cache, meta, 0.25, k_scale, v_scale), rtol=1e-5, atol=1e-5
    )
    if DEVICE == "cpu":
        with pytest.raises(ConfigError, match="CUDA"):
            triton_bench.bench_decode_attention()


def test_verify_steps_run_from_fixed_shape_metadata():
    """CUDA-graph capture of verify steps (q_len 1 + k): the backend must compute from device tensors
    and shape-only bounds, as decode_batch.fixed_meta gives them (host lists hold bounds, not the
    real lengths). Same output as with the exact metadata; graph_query_lens then captures 1 + k."""
    import dataclasses

    from ember.engine.executor.base import graph_query_lens

    q_len, bs = 3, 16
    step = Step([q_len] * 3, DECODE_SEQ_LENS, bs, 3, torch.float32, seed=5).to(DEVICE)
    bound = step.meta.block_tables.shape[1] * bs
    fixed = dataclasses.replace(
        step.meta, seq_lens_cpu=[bound] * 3, max_seq_len=bound, all_slots_valid=False, fixed_shape=True
    )
    backend = TritonAttentionBackend()
    out = backend.forward(step.q, step.k, step.v, step.cache, fixed, step.scale)
    assert_close_to_reference(out, step.reference(), torch.float32)
    assert backend.fixed_shape_max_query_len >= 1 + 8
    assert graph_query_lens(2, backend) == [1, 3] and graph_query_lens(2, TorchAttentionBackend()) == [1]
