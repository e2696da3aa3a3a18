"""The compiled executor (torch.compile, and AOTInductor packages) on a dense tiny Llama against the eager
one: the same greedy tokens and logprobs, padded batches included, and the C++ wrapper. Split from
tests/engine/test_step_executor.py (its helpers and the plain functions stay there) so that pytest-xdist's
--dist loadfile can hand the compiled tests to different workers."""

from __future__ import annotations

import pytest

from ember import SamplingParams
from ember.config import EngineConfig
from ember.errors import ConfigError
from tests.engine.test_engine import make_llm
from tests.engine.test_step_executor import COMPILE, outputs
from tests.models.tiny_models import one_thread, random_prompt  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.engine
@pytest.mark.parametrize("freezing", [True, False], ids=["torch.compile", "package"])
def test_compiled_equals_eager_batches_1_to_5(tiny_model_dir, freezing):
    """Size 4 alone: batches 1-3 padded to 4, 4 exact, 5 eager. Same greedy tokens, logprobs within fp32
    noise, and no graph compiled after startup (the table width is dynamic). Frozen graphs go through
    torch.compile, unfrozen ones are AOTInductor packages (ember.engine.executor.aot_package).
    One size: each graph is a compile (most of this test's time). The dense model's exact batch-1 graph
    is covered by test_compiled_with_cpp_wrapper_equals_eager below, test_compiled_two_engines.py and
    test_compile_cache.py (both forms); several sizes side by side, each run straight, by
    test_step_executor_hybrid.py (packages) and test_compiled_moe.py (torch.compile)."""
    import torch._dynamo.utils

    path = tiny_model_dir("llama")
    kw = dict(max_num_seqs=5, enable_prefix_caching=False)
    eager = make_llm(path, **kw)
    cc = COMPILE | {"compile_sizes": [4], "freezing": freezing}
    compiled = make_llm(path, executor="compiled", compilation_config=cc, **kw)
    ex = compiled.engine.parts.runner.executor
    assert ex.name == "compiled" and ex.sizes == [4] and ex.compiles == 1
    assert ex.direct_shapes == [(4, 1)]  # runs straight, without dynamo's guards
    assert ex.package_shapes == ([] if freezing else [(4, 1)])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    prompts = [random_prompt(n, 40 + s) for s, n in enumerate([5, 17, 3, 9, 12])]
    for n in range(1, 6):
        a, b = outputs(eager, prompts[:n], params), outputs(compiled, prompts[:n], params)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids, n
            for lx, ly in zip(x.logprobs, y.logprobs):
                assert lx.keys() == ly.keys()
                for t in lx:
                    assert abs(lx[t].logprob - ly[t].logprob) < 1e-4, (n, t)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompiles
    assert ex.compiled_steps >= 4 * 19  # batches 1-4: every decode step after the first token
    assert compiled.engine.parts.kv.num_free_blocks == compiled.engine.parts.kv.num_blocks


@pytest.mark.engine
def test_compiled_with_cpp_wrapper_equals_eager(tiny_model_dir):
    """compilation_config cpp_wrapper: inductor's generated C++ calls the kernels; same greedy tokens."""
    path = tiny_model_dir("llama")
    cc = {"compile_sizes": [1], "mode": "default"}  # cpp_wrapper: on by default
    compiled = make_llm(path, executor="compiled", compilation_config=cc, max_num_seqs=2)
    ex = compiled.engine.parts.runner.executor
    assert ex.compiles == 1 and ex.direct_shapes == [(1, 1)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [random_prompt(7, 3)]
    assert outputs(compiled, prompt, params)[0].token_ids == outputs(make_llm(path), prompt, params)[0].token_ids
    assert ex.compiled_steps >= 11
    with pytest.raises(ConfigError, match="cpp_wrapper must be true or false"):
        EngineConfig(executor="compiled", compilation_config={"cpp_wrapper": "yes"})
