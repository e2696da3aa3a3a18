"""FP8 KV cache (--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2): attention error against a
full-precision cache, scales (checkpoint or first-write calibration, then frozen), clamping,
chunk-independence, the pool's size, and greedy text."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember import LLM, SamplingParams
from ember.errors import ConfigError
from ember.kernels.metadata import AttentionMetadata
from ember.kernels.torch_attention import TorchAttentionBackend
from ember.layers import attention as attention_mod
from ember.layers.attention import Attention, quantize_kv, resolve_kv_cache_dtype
from ember.loader.weights import iter_safetensors
from tests.engine.test_engine import greedy, kv_gib, make_llm
from tests.layers.test_torch_attention import CASES, HKV, HQ, D, make_step
from tests.models.tiny_models import load_ember_model, one_thread, random_prompt

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Relative L2 error of the attention output against the same step over a model-dtype cache.
# e4m3 rounds with <= 6.25% relative error (mean ~2.3%), e5m2 with <= 12.5%; measured here
# 3.1-3.7% (e4m3) and 5.0-6.7% (e5m2) in float32, so the bounds leave ~1.7x headroom.
BOUND = {E4M3: 0.06, E5M2: 0.12}


def new_attention() -> Attention:
    return Attention(HQ, D, HKV, D**-0.5, TorchAttentionBackend())


def one_seq_meta(start: int, end: int, block_size: int = 64) -> AttentionMetadata:
    """One sequence in block 0, new tokens start..end-1 at slots start..end-1."""
    return AttentionMetadata(
        slot_mapping=torch.arange(start, end),
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        block_size=block_size,
        query_lens_cpu=[end - start],
        seq_lens_cpu=[end],
        max_query_len=end - start,
        max_seq_len=end,
        all_slots_valid=True,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_error_within_bound(case, fmt, dtype):
    q_lens, seq_lens = CASES[case]
    q, k, v, cache, meta, _ = make_step(q_lens, seq_lens, dtype)
    ref = new_attention()(q, k, v, cache.clone(), meta)
    attn = new_attention()
    attn.k_scale.fill_(max(cache[0].abs().max(), k.abs().max()).item() / 200)  # vLLM's calibration rule
    attn.v_scale.fill_(max(cache[1].abs().max(), v.abs().max()).item() / 100)
    attn.kv_scales_frozen = True
    cache8 = torch.stack([quantize_kv(cache[0], attn.k_scale, fmt), quantize_kv(cache[1], attn.v_scale, fmt)])
    out = attn(q, k, v, cache8, meta)
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert 1e-3 < err < BOUND[fmt], err  # > 1e-3: every path (fresh prefills too) reads the fp8 values


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_fresh_prefill_equals_chunks_over_the_fp8_cache(fmt):
    """A prompt as one fresh prefill, or as a prefill then a chunk then a decode over the cache:
    the same outputs, because the fresh prefill attends to the fp8 values it wrote."""
    g = torch.Generator().manual_seed(1)
    n = 14
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    attn = new_attention()
    attn.k_scale.fill_(0.02)
    attn.v_scale.fill_(0.03)
    attn.kv_scales_frozen = True
    whole = attn(q[:13], k[:13], v[:13], torch.zeros(2, 1, 64, HKV, D, dtype=fmt), one_seq_meta(0, 13))
    cache = torch.zeros(2, 1, 64, HKV, D, dtype=fmt)
    parts = [attn(q[a:b], k[a:b], v[a:b], cache, one_seq_meta(a, b)) for a, b in ((0, 6), (6, 13), (13, 14))]
    torch.testing.assert_close(torch.cat(parts[:2]), whole, atol=1e-5, rtol=1e-5)
    exact = new_attention()(q[:13], k[:13], v[:13], torch.zeros(2, 1, 64, HKV, D), one_seq_meta(0, 13))
    assert (whole - exact).abs().max() > 1e-3  # and it is not the full-precision result
    # The decode over the cache equals a fresh prefill of all 14 tokens, last row.
    all14 = attn(q, k, v, torch.zeros(2, 1, 64, HKV, D, dtype=fmt), one_seq_meta(0, 14))
    torch.testing.assert_close(parts[2], all14[13:], atol=1e-5, rtol=1e-5)


def test_scales_calibrated_on_first_write_then_frozen():
    g = torch.Generator().manual_seed(2)
    k, v = 3 * torch.randn(6, HKV, D, generator=g), 5 * torch.randn(6, HKV, D, generator=g)
    k[5], v[5] = 1e4, -1e4  # a padding row (slot -1): neither written nor calibrated on
    meta = one_seq_meta(0, 6)
    meta.slot_mapping = torch.tensor([0, 1, 2, 3, 4, -1])
    meta.all_slots_valid = False
    attn = new_attention()
    assert not attn.kv_scales_frozen
    cache = torch.zeros(2, 1, 64, HKV, D, dtype=E4M3)
    attn(torch.randn(6, HQ, D, generator=g), k, v, cache, meta)
    assert attn.kv_scales_frozen
    assert attn.k_scale.item() == pytest.approx(k[:5].abs().max().item() / 200, rel=1e-6)
    assert attn.v_scale.item() == pytest.approx(v[:5].abs().max().item() / 100, rel=1e-6)
    assert cache[0, 0, 5:].float().abs().max() == 0  # the padding row stayed out
    # The cache reads back K within e4m3's 6.25% relative rounding (plus the subnormal floor).
    back = cache[0, 0, :5].float() * attn.k_scale
    assert ((back - k[:5]).abs() <= 0.0625 * k[:5].abs() + attn.k_scale * 2**-9).all()
    # A later, 100x larger step: the scales stay; its values clamp at 448 instead of overflowing.
    before = (attn.k_scale.item(), attn.v_scale.item())
    attn(torch.randn(4, HQ, D, generator=g), 100 * k[:4], 100 * v[:4], cache, one_seq_meta(6, 10))
    assert (attn.k_scale.item(), attn.v_scale.item()) == before
    later = cache[:, 0, 6:10].float()
    assert torch.isfinite(later).all() and later.abs().max() == 448


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_values_beyond_the_range_are_clamped_not_inf(fmt):
    fmax = torch.finfo(fmt).max
    x = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), 3.0])
    assert torch.equal(quantize_kv(x, torch.tensor(1.0), fmt).float(), torch.tensor([fmax, -fmax, fmax, -fmax, 3.0]))
    if fmt is E5M2:  # why the clamp is explicit: a bare e5m2 cast overflows
        assert torch.isinf(torch.tensor([1e6]).to(fmt).float()).all()


def test_kv_cache_dtype_names_and_refusal(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) is torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, cpu) is E4M3  # fp8 means e4m3, as vLLM on CUDA
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32, cpu) is E4M3
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float16, cpu) is E5M2

    def broken(*a, **kw):
        raise RuntimeError("no fp8 kernel")

    monkeypatch.setattr(attention_mod, "quantize_kv", broken)
    with pytest.raises(ConfigError, match="--kv-cache-dtype auto"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, cpu)


# ---- checkpoint scales and the engine --------------------------------------------------------

CKPT_SCALES = {  # llm-compressor names on layer 0, ModelOpt names on layer 1
    "model.layers.0.self_attn.k_scale": 0.045,
    "model.layers.0.self_attn.v_scale": 0.031,
    "model.layers.1.self_attn.k_proj.k_scale": 0.052,
    "model.layers.1.self_attn.v_proj.v_scale": 0.027,
}


@pytest.fixture(scope="module")
def scaled_llama(tiny_model_dir, tmp_path_factory):
    """The tiny llama folder with per-layer KV scales added to its safetensors file."""
    path = tmp_path_factory.mktemp("llama-kv-scales")
    shutil.copytree(tiny_model_dir("llama"), path, dirs_exist_ok=True)
    tensors = load_file(path / "model.safetensors")
    tensors.update({name: torch.tensor(value) for name, value in CKPT_SCALES.items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def attention_scales(llm) -> list[tuple[float, float]]:
    layers = llm.engine.parts.runner.model.model.layers
    return [(round(l.self_attn.attn.k_scale.item(), 6), round(l.self_attn.attn.v_scale.item(), 6)) for l in layers]


@pytest.mark.engine
def test_checkpoint_scales_are_loaded_and_kept(scaled_llama):
    llm = make_llm(scaled_llama, kv_cache_dtype="fp8")
    want = [(0.045, 0.031), (0.052, 0.027)]
    assert attention_scales(llm) == want
    greedy(llm, [random_prompt(20, 0)])
    assert attention_scales(llm) == want  # not recalibrated by the first prefill
    # The deprecated single kv_scale sets both.
    model = load_ember_model(scaled_llama)
    model.load_weights(
        list(iter_safetensors(scaled_llama, progress=False))
        + [("model.layers.1.self_attn.kv_scale", torch.tensor([0.07]))]
    )
    attn = model.model.layers[1].self_attn.attn
    assert attn.k_scale.item() == attn.v_scale.item() == pytest.approx(0.07)


@pytest.mark.engine
def test_chunking_does_not_change_fp8_greedy_tokens(scaled_llama):
    """With fixed (checkpoint) scales, a 7-token step budget gives the tokens of one-shot prefills."""
    prompts = [random_prompt(n, seed) for seed, n in enumerate([5, 17, 40, 26])]
    whole = greedy(make_llm(scaled_llama, kv_cache_dtype="fp8"), prompts)
    chunked = greedy(make_llm(scaled_llama, kv_cache_dtype="fp8", max_num_batched_tokens=7, max_num_seqs=4), prompts)
    assert chunked == whole


@pytest.mark.engine
def test_pool_holds_twice_the_tokens_in_the_same_memory(tiny_model_dir, caplog):
    path = tiny_model_dir("qwen3")
    blocks = {}
    for kvd in ("auto", "fp8", "fp8_e5m2"):
        with caplog.at_level("INFO", logger="ember"):
            llm = make_llm(path, dtype="bfloat16", kv_cache_dtype=kvd, kv_cache_memory=kv_gib(path, 256, 4))
        blocks[kvd] = llm.engine.parts.kv.num_blocks
        kv_dtype = llm.engine.parts.runner.kv_caches[0].dtype
        assert f"KV cache {str(kv_dtype).removeprefix('torch.')}," in caplog.text
    assert llm.engine.parts.runner.kv_caches[0].dtype is E5M2
    # kv_gib(256 blocks of fp32) holds 512 bf16 blocks of 4 tokens, and 1024 fp8 ones.
    assert blocks == {"auto": 512, "fp8": 1024, "fp8_e5m2": 1024}


DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Write a haiku about the sea.",
    "The best way to learn Python is",
    "In 1492, Columbus",
    "Photosynthesis is the process",
    "Here is a recipe for pancakes:",
    "The difference between a list and a tuple",
    "My favourite movie is",
    "To be or not to be",
]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.engine
def test_default_model_greedy_tokens_mostly_equal_bf16_kv():
    """The embedded SmolLM2 (real weights), bf16, 32 greedy tokens for 12 prompts, fp8 KV against bf16 KV.
    Greedy paths of this small model have near-ties (two prompts flip their first token under either
    fp8 format), so this is a statistical bar: the tokens kept in the common prefix, e4m3 measured
    163/384 (42%) with the dense copy for prefill and 209/384 without, e5m2 134/384; asserted >= 30% and
    >= 20%, and e4m3 keeps at least 3 tokens on half the prompts."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def run(kvd):
        llm = LLM(None, dtype="bfloat16", kv_cache_dtype=kvd, max_model_len=256, kv_cache_memory=0.02, num_threads=1)
        return [o.outputs[0].token_ids for o in llm.generate(DEFAULT_PROMPTS, params, use_tqdm=False)]

    base = run("auto")
    e4m3 = [common_prefix(a, b) for a, b in zip(base, run("fp8"))]
    assert sum(e4m3) >= 0.30 * 32 * len(base) and sum(n >= 3 for n in e4m3) >= len(base) / 2, e4m3
    e5m2 = [common_prefix(a, b) for a, b in zip(base, run("fp8_e5m2"))]
    assert sum(e5m2) >= 0.20 * 32 * len(base), e5m2
