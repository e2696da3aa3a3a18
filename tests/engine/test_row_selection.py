"""The last layer restricted to the logit rows gives exactly those rows of the full forward."""

import pytest
import torch

from ember import LLM, SamplingParams

pytestmark = pytest.mark.engine  # every test here builds an engine


def _forward_both(engine):
    out = engine.parts.scheduler.schedule()
    runner = engine.parts.runner
    batch = runner.prepare(out)
    ids, pos, meta, logit_rows, select = batch.input_ids, batch.positions, batch.meta, batch.logit_rows, batch.select
    caches = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        full = runner.model(ids, pos, caches, meta)
        part = runner.model(ids, pos, runner.kv_caches, meta, select)
    # the K/V written are the same whether or not the last layer was restricted
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches))
    return out, logit_rows, select, full, part


def test_selected_rows_equal_the_full_forward(tiny_model_dir):
    llm = LLM(
        model=tiny_model_dir("qwen3"),
        dtype="float32",
        kv_cache_memory=0.01,
        max_model_len=256,
        max_num_batched_tokens=40,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(5, 30))}, params)
    engine.add_request("b", {"prompt_token_ids": list(range(40, 50))}, params)
    engine.step()  # a: 25 tokens done; b: 10 tokens of its prompt fit, both sample
    engine.add_request("c", {"prompt_token_ids": list(range(60, 120))}, params)
    # next step: decodes of a and b plus a 38-token chunk of c that samples nothing
    out, logit_rows, select, full, part = _forward_both(engine)
    assert [n for _, n in out.scheduled] == [1, 1, 38]
    assert select is not None and select.rows.tolist() == logit_rows == [0, 1]
    torch.testing.assert_close(part, full[logit_rows], rtol=1e-5, atol=1e-5)


def test_a_chunk_that_samples_nothing_only_writes_kv(tiny_model_dir):
    llm = LLM(
        model=tiny_model_dir("llama"),
        dtype="float32",
        kv_cache_memory=0.01,
        max_model_len=256,
        max_num_batched_tokens=16,
    )
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": list(range(5, 45))}, SamplingParams(max_tokens=2))
    out, logit_rows, select, full, part = _forward_both(engine)
    assert logit_rows == [] and select.meta is None and part.shape[0] == 0
