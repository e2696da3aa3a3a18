"""A Hugging Face folder saved in bf16, run in float32 on CPU, keeps its matrices 16-bit (quant.half_weights:
HalfParts over ember/kernels/cpu_half_gemv): every Linear, the experts, the embedding and the LM head hold
the checkpoint's bits, half the bytes of the float32 widening, `ember plan` counts them at 2 bytes, and the
run gives the greedy tokens and logprobs of the same folder widened at load (--no-cpu-half-weights)."""

from __future__ import annotations

import pytest
import torch

from ember import LLM
from ember.kernels import cpu_half_gemv
from tests.models.tiny_hybrids import build_hybrid, save_hybrid
from tests.models.tiny_models import build_hf_model, one_thread, save_hf_model  # noqa: F401
from tests.quant.test_gguf_half_weights import assert_same_answers, parts

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.engine,
    pytest.mark.skipif(not cpu_half_gemv.available(), reason="needs AVX2 + FMA + F16C and a C++ compiler"),
]


def bf16_folder(tmp_path, arch: str) -> str:
    path = str(tmp_path / arch)
    if arch in ("qwen3_5", "qwen3_5_moe"):
        return save_hybrid(build_hybrid(arch).to(torch.bfloat16), path)
    from tests.conftest import write_tiny_tokenizer
    from tests.models.tiny_models import VOCAB

    save_hf_model(build_hf_model(arch).to(torch.bfloat16), path)
    write_tiny_tokenizer(path, VOCAB)
    return path


def llm(path, **kw):
    args = dict(dtype="float32", kv_cache_memory=0.02, max_model_len=128, num_threads=1)
    return LLM(path, **(args | {"max_num_batched_tokens": 7, "max_num_seqs": 4} | kw))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_5"])
def test_a_bf16_folder_stays_16_bit_and_agrees_with_its_float32_widening(tmp_path, arch):
    from ember.quant.gguf_quant import HalfPart

    path = bf16_folder(tmp_path, arch)
    half, wide = llm(path), llm(path, cpu_half_weights=False)
    assert half.engine.parts.loaded.quantization == "half" and wide.engine.parts.loaded.quantization == "none"
    held = parts(half.engine.parts.runner.model)
    assert held and all(isinstance(p, HalfPart) and p.w.dtype == torch.bfloat16 for p in held)
    assert 1.9 < wide.engine.parts.loaded.weight_bytes / half.engine.parts.loaded.weight_bytes <= 2.0
    assert_same_answers(half, wide, [[(t * 37) % 200 + 3 for t in range(1, n)] for n in (5, 20, 33)])


def test_plan_counts_the_folders_matrices_at_two_bytes(tmp_path):
    from ember.config import EngineConfig
    from ember.engine.planner import plan

    path = bf16_folder(tmp_path, "qwen3")
    flags = dict(model=path, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=0.02)
    kept, widened = plan(EngineConfig(**flags)), plan(EngineConfig(**flags, cpu_half_weights=False))
    assert (kept.quantization, widened.quantization) == ("half", "none")
    assert widened.weight_bytes == 2 * kept.weight_bytes
    loaded = llm(path).engine.parts.loaded.weight_bytes
    assert abs(kept.weight_bytes - loaded) < 0.05 * loaded  # the norms, held in float32, are the difference
