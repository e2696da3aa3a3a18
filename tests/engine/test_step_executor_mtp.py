"""The compiled executor under MTP speculation: verify steps and the MTP fill in graphs, fixed and adaptive
k, against the eager engine. Split from tests/engine/test_step_executor.py (see
tests/engine/test_step_executor_dense.py)."""

from __future__ import annotations

import pytest

from ember import SamplingParams
from tests.engine.test_engine import make_llm
from tests.engine.test_step_executor import COMPILE, outputs
from tests.models.tiny_models import one_thread, random_prompt  # noqa: F401  (fixture)
from tests.spec.test_mtp_spec import mtp_model  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.engine
@pytest.mark.parametrize("freezing", [True, False], ids=["torch.compile", "package"])
def test_compiled_with_mtp_speculation_keeps_greedy_output(mtp_model, freezing):  # noqa: F811
    """Verify steps (3 queries each) and plain decodes both compiled: with the bigram model every
    draft is accepted, so 8 tokens = prefill 1, two verifies of 3, one decode (no room for a draft).
    As packages too: the fill's hidden-state rows are a package input, and the MTP's shared embedding
    is found on the main model."""
    path = mtp_model("qwen3", "deepseek", bigram=True)
    prompts = [random_prompt(n, 60 + s) for s, n in enumerate([7, 4, 11])]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(max_num_seqs=4, enable_mtp=True, num_speculative_tokens=2, adaptive_spec=False)
    eager = make_llm(path, **kw)
    ref = [o.token_ids for o in outputs(eager, prompts, params)]
    cc = {**COMPILE, "compile_sizes": [4], "freezing": freezing}
    llm = make_llm(path, executor="compiled", compilation_config=cc, **kw)
    assert [o.token_ids for o in outputs(llm, prompts, params)] == ref
    accepted = llm.engine.stats()["spec_num_accepted_tokens"]
    assert accepted > 0 and accepted == eager.engine.stats()["spec_num_accepted_tokens"]
    ex = llm.engine.parts.runner.executor
    assert ex.query_lens == [1, 3] and ex.direct_shapes == [(4, 1), (4, 3)]
    assert ex.compiled_steps == 3  # both verifies and the last decode
    # the MTP fill compiled at the same shapes: 3 sequences padded to 4, rows of 1 or 3 queries each
    fill = llm.engine.parts.spec.proposer.fill_executor
    assert fill.what == "MTP fill" and fill.direct_shapes == [(4, 1), (4, 3)]
    assert fill.package_shapes == ex.package_shapes == ([] if freezing else [(4, 1), (4, 3)])
    # the fill after the first verify, and the chain's second draft (layer 0 again, one row per sequence)
    # after the prefill and after the first verify; the prefill's fill is eager, and the rows of the second
    # verify and the last decode, after which nothing drafts, are put off and filled in one eager batch
    assert fill.compiled_steps == 3
    spec = llm.engine.parts.spec  # a verified token is priced from the graphs' timings
    assert ex.extra_query_cost() is not None
    assert spec.adaptive.cost == pytest.approx(ex.extra_query_cost() + spec.draft_token_cost)


@pytest.mark.engine
def test_compiled_adaptive_mtp_has_a_graph_for_every_draft_length(mtp_model):  # noqa: F811
    """Adaptive k moves between 1 and k_max: every verify length is compiled (main model and fill), and
    the greedy output is the eager engine's."""
    path = mtp_model("qwen3", "deepseek")
    prompt = [random_prompt(9, 71)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(max_num_seqs=1, enable_mtp=True, num_speculative_tokens=2, adaptive_spec=True)
    ref = outputs(make_llm(path, **kw), prompt, params)[0].token_ids
    llm = make_llm(path, executor="compiled", compilation_config={**COMPILE, "compile_sizes": [1]}, **kw)
    assert outputs(llm, prompt, params)[0].token_ids == ref
    ex, fill = llm.engine.parts.runner.executor, llm.engine.parts.spec.proposer.fill_executor
    assert ex.query_lens == [1, 2, 3] and ex.direct_shapes == [(1, 1), (1, 2), (1, 3)]
    # the fill's graphs are built for every length; which of them run depends on when it drafts (a random
    # MTP head's drafts are rejected, the back-off stops drafting, and rows it does not draft after are
    # put off and filled in one eager batch)
    assert fill.direct_shapes == [(1, 1), (1, 2), (1, 3)]
    assert sorted(ex.call_seconds) == [(1, 1), (1, 2), (1, 3)]
    # adaptive k prices each draft length from these timings
    adaptive = llm.engine.parts.spec.adaptive
    assert sorted(adaptive.verify_costs) == [1, 2] and adaptive.verify_costs == ex.verify_costs()
    assert adaptive.step_cost(2) == ex.verify_costs()[2] + 2 * adaptive.draft_cost
