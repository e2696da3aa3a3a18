"""Spec-decode counters reach engine.stats() and the Prometheus /metrics text under vLLM's names."""

import pytest

from ember.server.metrics import ServerMetrics
from tests.spec.spec_helpers import REPEATED, make_llm, ngram, run

pytestmark = pytest.mark.engine  # every test here builds an engine


def sample_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_spec_stats_and_prometheus(tiny_model_dir):
    llm = make_llm(tiny_model_dir("qwen3"), speculative_config=ngram(3))
    metrics = ServerMetrics("tiny")
    metrics.on_step(llm.engine.stats(), 0, 0.0)  # the baseline
    run(llm, REPEATED)
    stats = llm.engine.stats()
    metrics.on_step(stats, 0, 0.0)

    assert stats["spec_num_accepted_tokens"] == sum(stats["spec_num_accepted_tokens_per_pos"]) > 0
    assert stats["spec_num_draft_tokens"] == sum(stats["spec_num_draft_tokens_per_pos"])
    assert stats["spec_mean_accepted_length"] == 1 + stats["spec_num_accepted_tokens"] / stats["spec_num_drafts"]
    assert stats["spec_draft_seconds"] > 0 and stats["spec_verify_seconds"] > 0
    assert all(0 <= a <= 1 for a in stats["spec_acceptance_per_pos"])

    text = metrics.render().decode()
    assert sample_value(text, "ember:spec_decode_num_drafts_total") == stats["spec_num_drafts"]
    assert sample_value(text, "ember:spec_decode_num_draft_tokens_total") == stats["spec_num_draft_tokens"]
    assert sample_value(text, "ember:spec_decode_num_accepted_tokens_total") == stats["spec_num_accepted_tokens"]
    for pos, n in enumerate(stats["spec_num_accepted_tokens_per_pos"]):
        line = f'ember:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{pos}"}} {float(n)}'
        assert line in text
    assert sample_value(text, "ember:spec_decode_mean_accepted_length") == stats["spec_mean_accepted_length"]
    assert sample_value(text, "ember:spec_decode_verify_seconds_total") > 0


def test_no_spec_metrics_without_speculation(tiny_model_dir):
    llm = make_llm(tiny_model_dir("qwen3"))
    assert not any(k.startswith("spec_") for k in llm.engine.stats())
    metrics = ServerMetrics("tiny")
    metrics.on_step(llm.engine.stats(), 0, 0.0)
    assert "spec_decode" not in metrics.render().decode()
