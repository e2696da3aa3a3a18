"""lm-eval-harness's `local-completions` model against a live ember server, on a multiple-choice task
written from offline text (ember.eval.pydoc_choice): it runs end to end (remote tokenizer through
/tokenizer_info and /tokenize, scoring through completions echo + logprobs), and every log-likelihood it
scores, and so its accuracy, equals ember's own offline scoring of the same items (default model, fp32)."""

from __future__ import annotations

import pytest

from ember.default_model import default_model_path
from ember.eval.pydoc_choice import TASK_NAME, accuracy, build_items, choice_logprobs, write_lm_eval_task
from tests.server.live import MODEL_NAME, start_server

pytestmark = pytest.mark.engine  # every test here builds an engine

ENGINE = dict(dtype="float32", num_threads=2, kv_cache_memory=0.3, max_model_len=1024)
ITEMS = 12


def test_lm_eval_local_completions_scores_as_ember_does(tmp_path, monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra")
    from lm_eval.tasks import TaskManager

    items = build_items(ITEMS)
    folder = write_lm_eval_task(str(tmp_path / "tasks"), items)
    live = start_server(default_model_path(), tokenizer_info=True, **ENGINE)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"base_url={live.url}/v1/completions,model={MODEL_NAME},tokenizer_backend=remote,"
            "num_concurrent=2,max_retries=1,timeout=120",
            tasks=[TASK_NAME],
            task_manager=TaskManager(include_path=folder),
            log_samples=True,
        )
    finally:
        live.stop()
    from ember import LLM

    want = choice_logprobs(LLM(model=default_model_path(), **ENGINE), items)
    offline = accuracy(items, want)
    samples = sorted(results["samples"][TASK_NAME], key=lambda s: s["doc_id"])
    assert len(samples) == ITEMS
    for sample, lps in zip(samples, want):
        got = [resp[0][0] for resp in sample["resps"]]  # (log-likelihood, is_greedy) per choice
        assert got == pytest.approx(lps, abs=1e-3)
    scores = results["results"][TASK_NAME]
    assert scores["acc,none"] == offline["acc"] and scores["acc_norm,none"] == offline["acc_norm"]
    assert offline["acc"] > 0.25  # better than chance: the scores mean something (0.5 over build_items(40), measured)
