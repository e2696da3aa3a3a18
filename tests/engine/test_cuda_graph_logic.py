"""CUDAGraphExecutor's buffer, padding and replay logic on CPU, with stand-in graphs.

A stand-in graph is captured by running the step once and replays by running it again on the
same static buffers, into the same output tensor: what a CUDA graph does, minus the GPU. So the
executor's static inputs, padding to the next size, per-row inputs (the MTP fill's hidden
states) and output slicing are checked against the eager engine, token for token. The capture
itself (streams, the memory pool) runs on a GPU only (scripts/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from ember import SamplingParams
from ember.engine.executor.cuda_graph import CUDAGraphExecutor
from tests.engine.test_engine import make_llm
from tests.engine.test_step_executor import outputs
from tests.models.tiny_models import one_thread, random_prompt  # noqa: F401  (fixture)
from tests.spec.test_mtp_spec import mtp_model  # noqa: F401  (fixture)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]


class StandInGraph:
    def __init__(self, forward, out: torch.Tensor):
        self.forward, self.out = forward, out

    def replay(self) -> None:
        self.out.copy_(self.forward())


class CPUGraphExecutor(CUDAGraphExecutor):
    device_type = "cpu"
    captures = 0

    def _synchronize(self) -> None:
        pass

    def _free_bytes(self) -> int:
        return 0

    def _new_pool(self):
        return object()

    def _capture_graph(self, forward):
        forward()  # the warm-up run, as on a GPU
        CPUGraphExecutor.captures += 1
        out = forward()
        return StandInGraph(forward, out), out


def graphs_for(llm, query_lens, max_batch=4) -> CPUGraphExecutor:
    """Swap the engine's executor for stand-in graphs at sizes 1, 2, 4."""
    eng, runner = llm.engine, llm.engine.parts.runner
    ex = CPUGraphExecutor(
        runner.model,
        runner.kv_caches,
        runner.block_size,
        eng.parts.limits.max_model_len,
        max_batch,
        query_lens,
        runner.device,
    )
    runner.executor = ex
    return ex


def test_replayed_decodes_equal_eager_batches_1_to_5(tiny_model_dir):
    """Sizes [1, 2, 4]: 3 sequences pad to 4, 5 run eagerly; greedy tokens equal the eager engine's."""
    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for n in (1, 3, 5):
        prompts = [random_prompt(5 + 2 * i, 40 + i) for i in range(n)]
        kw = dict(max_num_seqs=5, enable_prefix_caching=False)
        ref = [o.token_ids for o in outputs(make_llm(path, **kw), prompts, params)]
        llm = make_llm(path, **kw)
        ex = graphs_for(llm, [1])
        assert sorted(ex.graphs) == [(1, 1), (1, 2), (1, 4)] and ex.rows == {1: ()}
        assert [o.token_ids for o in outputs(llm, prompts, params)] == ref
        assert (ex.replays > 0) == (n <= 4), (n, ex.replays)  # 5 sequences: above the largest size
        assert llm.engine.parts.kv.num_free_blocks == llm.engine.parts.kv.num_blocks


def test_mtp_fill_captured_with_its_hidden_states_as_row_inputs(mtp_model, monkeypatch):  # noqa: F811
    """With the cuda-graph executor, MTPProposer.prepare captures the fill at the main graphs' sizes
    and query lengths (1 and 1 + k), its hidden states copied into static row buffers and zero-padded;
    greedy output and the accepted drafts equal the eager engine's."""
    # a random MTP layer: its drafts depend on the hidden states, so the same drafts as the eager
    # engine's show the row buffers carried them
    path = mtp_model("qwen3", "deepseek")
    prompts = [random_prompt(n, 60 + s) for s, n in enumerate([7, 4, 11])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(max_num_seqs=4, enable_mtp=True, num_speculative_tokens=2, adaptive_spec=False)
    eager = make_llm(path, **kw)
    ref_drafts = record_drafts(eager, monkeypatch)
    ref = [o.token_ids for o in outputs(eager, prompts, params)]
    llm = make_llm(path, **kw)
    drafts = record_drafts(llm, monkeypatch)
    main = graphs_for(llm, [1, 3])
    proposer = llm.engine.parts.spec.proposer
    proposer.prepare(main.sibling)  # the engine hands its executor's factory (ember.engine.startup.start)
    fill = proposer.fill_executor
    assert isinstance(fill, CPUGraphExecutor) and fill.what == "MTP fill cuda graphs" and fill.pool is main.pool
    assert sorted(fill.graphs) == sorted(main.graphs)
    hidden = proposer.mtp.cfg.hidden_size
    assert [tuple(r.shape) for r in fill.rows[3]] == [(4 * 3, hidden)]
    assert [o.token_ids for o in outputs(llm, prompts, params)] == ref
    assert main.replays > 0 and fill.replays > 0
    assert len(drafts) > 10 and drafts == ref_drafts
    assert llm.engine.parts.kv.num_free_blocks == llm.engine.parts.kv.num_blocks


def record_drafts(llm, monkeypatch) -> list[list[int]]:
    """Every draft the engine's proposer makes, in order."""
    proposer, seen = llm.engine.parts.spec.proposer, []
    propose = proposer.propose

    def recording(requests, ks):
        drafts = propose(requests, ks)
        seen.extend(list(d.token_ids) for d in drafts)
        return drafts

    monkeypatch.setattr(proposer, "propose", recording)
    return seen


def test_the_real_executor_still_refuses_a_cpu_device(tiny_model_dir):
    from ember.errors import ConfigError

    llm = make_llm(tiny_model_dir("llama"))
    runner = llm.engine.parts.runner
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        CUDAGraphExecutor(runner.model, runner.kv_caches, runner.block_size, 128, 4, [1], runner.device)
