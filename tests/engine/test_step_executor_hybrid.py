"""The compiled executor on a Qwen3.5 hybrid (Gated DeltaNet layers) against the eager one. Split from
tests/engine/test_step_executor.py (see tests/engine/test_step_executor_dense.py)."""

from __future__ import annotations

import pytest

from ember import SamplingParams
from tests.engine.test_engine import make_llm
from tests.engine.test_step_executor import COMPILE, assert_same_outputs, outputs
from tests.models.tiny_models import one_thread, random_prompt  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.engine
@pytest.mark.parametrize("freezing", [True, False], ids=["torch.compile", "package"])
def test_compiled_hybrid_decode_equals_eager(tiny_hybrid_dir, freezing):
    """A Qwen3.5 hybrid under the compiled executor: its decode steps run as graphs that call the fused
    Gated DeltaNet kernels with the step's slot tensors (padding rows touch no slot), the prefix cache's
    snapshots taken after each step. Same greedy tokens and logprobs as eager for batches 1 to 5 (5:
    eager), and a second pass over the same prompts (prefix-cache hits restore those snapshots) agrees
    too. Prompts are longer than a block, so decodes cross block boundaries and snapshot. Unfrozen, the
    graphs are AOTInductor packages handed each layer's state tensors (package_tensors), which they
    write in place. Packages at sizes 1 and 4 (two graphs side by side, each called straight); frozen
    graphs at batch 4 alone (each size is a compile, most of this test's time): the frozen Gated DeltaNet
    batch-1 graph is test_compiled_moe.py's (Qwen3.5-MoE, sizes 1 and 4)."""
    path = tiny_hybrid_dir("qwen3_5")
    kw = dict(max_num_seqs=5, block_size=16, dtype="float32")
    eager = make_llm(path, **kw)
    sizes = [4] if freezing else [1, 4]
    cc = COMPILE | {"freezing": freezing, "compile_sizes": sizes}
    compiled = make_llm(path, executor="compiled", compilation_config=cc, **kw)
    ex = compiled.engine.parts.runner.executor
    shapes = [(s, 1) for s in sizes]
    assert ex.name == "compiled" and ex.query_lens == [1] and ex.direct_shapes == shapes
    assert ex.package_shapes == ([] if freezing else shapes)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = [[t % 320 for t in random_prompt(n, 70 + s)] for s, n in enumerate([21, 9, 30, 14, 17])]  # its vocab

    def same(prompts):
        a, b = outputs(eager, prompts, params), outputs(compiled, prompts, params)
        assert_same_outputs(a, b, len(prompts))
        return a

    for n in [1, 3, 4, 5]:
        answers = same(prompts[:n])
    # second turns: each continues its first turn's answer, whose decodes snapshotted at block ends
    same([p + list(a.token_ids) + [5, 6, 7] for p, a in zip(prompts, answers)])
    assert ex.compiled_steps >= 3 * 23
