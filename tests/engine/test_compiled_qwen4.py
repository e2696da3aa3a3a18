"""qwen4_exp's decode steps in graphs (ember.layers.qsa_graph, PLELayer's fixed-shape path, the PLE gather
ops of ember.layers.ple_gather): the fixed-shape forward run eagerly gives the varlen forward's rows and
states, dense and past QSA's dense threshold, padded batches included; and the compiled executor's
decode (an AOTInductor package per shape, handed the PLE state and the indexer key pools) gives eager's
greedy tokens and logprobs."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.executor.compiled import graph_pools, step_forward
from ember.engine.executor.decode_batch import graph_shape, pad_decode, table_width
from tests.engine.test_step_executor import assert_same_outputs
from tests.models.tiny_models import one_thread  # noqa: F401  (fixture)
from tests.models.tiny_qwen4 import build_qwen4, prompt, save_qwen4

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=0.02, max_num_seqs=4, block_size=16, num_threads=1)
# one past QSA's dense threshold (67 tokens) while it decodes, one within it, one crossing it
PROMPTS = [prompt(80, 60, eos_at=(3,)), prompt(20, 61), prompt(60, 62, eos_at=(58,))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_qwen4(build_qwen4(), str(tmp_path_factory.mktemp("qwen4-graph")))


class FixedShapeCheck:
    """An executor that runs every decode step both ways, the fixed-shape form first (padded to `size`
    sequences), and checks its rows and the state it leaves against the varlen form's."""

    name = "eager"

    def __init__(self, runner, size: int):
        self.runner, self.size, self.steps = runner, size, 0
        self.pools = graph_pools(runner.model, runner.kv_caches)

    def run(self, input_ids, positions, meta, select=None):
        model, caches = self.runner.model, self.runner.kv_caches
        if select is not None or graph_shape(meta, [self.size], [1]) is None:
            return model(input_ids, positions, caches, meta, select)
        states = self.runner.recurrent_states
        before = [[t.clone() for t in s.tensors()] for s in states]
        x = pad_decode(input_ids, positions, meta, self.size, table_width(meta.max_seq_len, 16))
        with torch.inference_mode():
            fixed = step_forward(model, 16, *vars(x).values(), [*caches, *self.pools])[: input_ids.shape[0]]
        after = [[t.clone() for t in s.tensors()] for s in states]
        for s, saved in zip(states, before):
            for t, old in zip(s.tensors(), saved):
                t.copy_(old)
        out = model(input_ids, positions, caches, meta, select)
        torch.testing.assert_close(fixed, out, atol=2e-6, rtol=1e-5)
        for s, saved in zip(states, after):  # the PLE pools' scratch row is the padding rows' (not compared)
            for t, fixed_t, dim in zip(s.tensors(), saved, s.POOL_DIMS):
                rows = t.shape[0] - (dim == "slots+1")
                torch.testing.assert_close(fixed_t[:rows], t[:rows], atol=2e-6, rtol=1e-5)
        self.steps += 1
        return out

    def sibling(self, *args, **kwargs):
        return None


def test_the_fixed_shape_forward_equals_the_varlen_one(path):
    llm = LLM(path, executor="eager", **KW)
    runner = llm.engine.parts.runner
    runner.executor = check = FixedShapeCheck(runner, size=4)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert check.steps == 9  # every decode after the first token, three sequences padded to four


def test_compiled_decode_equals_eager(path):
    """One graph of two sequences, an AOTInductor package (unfrozen): batch 1 padded, batch 2, batch 3
    eager; then a second turn whose prefix hit restores a snapshot taken after a compiled step."""
    eager = LLM(path, executor="eager", **KW)
    cc = {"compile_sizes": [2], "mode": "default", "freezing": False, "cpp_wrapper": False}
    compiled = LLM(path, executor="compiled", compilation_config=cc, **KW)
    ex = compiled.engine.parts.runner.executor
    assert ex.name == "compiled" and ex.package_shapes == [(2, 1)] and len(ex.pools) == 2

    def same(prompts):
        a = [o.outputs[0] for o in eager.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
        b = [
            o.outputs[0] for o in compiled.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        ]
        assert_same_outputs(a, b, len(prompts))
        return a

    for n in [1, 2, 3]:
        answers = same(PROMPTS[:n])
    assert ex.compiled_steps >= 2 * 9  # batches 1 and 2: every decode after the first token (3: eager)
    same([PROMPTS[0] + list(answers[0].token_ids) + [5, 6, 7]])
