"""Several compiled engines in one process on models of the same shape: each runs its own weights.

torch.compile caches graphs per code object (CompiledExecutor._forward), and the pool's block count
is symbolic, so a second engine reuses the first one's graphs: that must run the second model's
weights (they are graph inputs), and the reused graph must still be called without guards."""

from __future__ import annotations

import pytest

from ember import SamplingParams
from tests.conftest import write_tiny_tokenizer
from tests.engine.test_engine import make_llm
from tests.models.tiny_models import VOCAB, build_hf_model, one_thread, random_prompt, save_hf_model  # noqa: F401

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
COMPILE = {"compile_sizes": [1], "mode": "default", "freezing": True, "cpp_wrapper": False}


def test_second_compiled_engine_runs_its_own_weights(tmp_path):
    paths = []
    for seed in (0, 1):
        path = str(tmp_path / f"m{seed}")
        save_hf_model(build_hf_model("llama", seed=seed), path)
        write_tiny_tokenizer(path, VOCAB)
        paths.append(path)
    prompt = [random_prompt(6, 5)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs, blocks = [], []
    for path in paths:
        eager = make_llm(path).generate([{"prompt_token_ids": p} for p in prompt], params, use_tqdm=False)
        llm = make_llm(path, executor="compiled", compilation_config=COMPILE)
        got = llm.generate([{"prompt_token_ids": p} for p in prompt], params, use_tqdm=False)
        assert got[0].outputs[0].token_ids == eager[0].outputs[0].token_ids
        ex = llm.engine.parts.runner.executor
        assert ex.compiled_steps >= 9 and ex.direct_shapes == [(1, 1)]
        outs.append(got[0].outputs[0].token_ids)
        blocks.append(llm.engine.parts.kv.num_blocks)
    assert outs[0] != outs[1]  # two different models
    # another pool size for the first model: the same graph (block count symbolic), called directly
    llm = make_llm(paths[0], executor="compiled", compilation_config=COMPILE, kv_cache_memory=0.01)
    got = llm.generate([{"prompt_token_ids": p} for p in prompt], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == outs[0]
    assert llm.engine.parts.runner.executor.direct_shapes == [(1, 1)] and llm.engine.parts.kv.num_blocks != blocks[0]
