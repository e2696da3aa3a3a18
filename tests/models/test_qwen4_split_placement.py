"""qwen4_exp with its experts split between host memory and the device (--n-cpu-moe, a hot-expert cache that
must evict) and its n-gram table read onto the device (--no-ple-offload), with the CPU as the device: the
greedy tokens of the all-resident engine (tests/engine/test_split_placement.py does the same for a Qwen3-MoE
GGUF). The tiny model's experts are bf16 views of its safetensors file."""

from __future__ import annotations

import pytest
import torch

from ember import LLM
from tests.engine.test_split_placement import ENGINE, greedy, slots_for
from tests.models.tiny_models import one_thread  # noqa: F401 (fixture)
from tests.models.tiny_qwen4 import build_qwen4, prompt, save_qwen4

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]


def test_qwen4_exp_split_with_the_table_on_the_device(tmp_path):
    path = save_qwen4(build_qwen4().to(torch.bfloat16), str(tmp_path))
    prompts = [prompt(60, 3, eos_at=(20,))]
    with LLM(path, **ENGINE) as llm:
        want = greedy(llm, prompts)
    with LLM(path, n_cpu_moe=2, moe_hot_cache_memory=0.001, ple_offload=False, **ENGINE) as llm:
        loaded = llm.engine.parts.loaded
        loaded.placement.hot_cache.resize(slots_for(llm, 3) * 2**30)
        assert greedy(llm, prompts) == want
        assert loaded.placement.host_layers == {0, 1} and loaded.placement.hot_cache.evictions > 0
        assert loaded.mapped_weight_bytes == 0  # the table was read onto the device, not left mapped
