"""The default model through the command line: `ember generate`, `ember chat` (multi-turn, reusing the
prefix), and a user error reported without a traceback."""

from __future__ import annotations

import pytest

from ember.entrypoints.cli import main as cli_main

pytestmark = pytest.mark.engine  # every test here builds an engine


def test_cli_generate(capsys):
    rc = cli_main(
        [
            "generate",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--kv-cache-memory",
            "0.1",
            "--max-model-len",
            "1024",
        ]
    )
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_reports_errors_without_a_traceback(capsys):
    rc = cli_main(["generate", "hi", "--max-num-seqs", "100", "--max-num-batched-tokens", "10"])
    assert rc == 2
    assert "max-num-seqs" in capsys.readouterr().err


def test_cli_chat_is_multi_turn_and_reuses_the_prefix(monkeypatch, capsys):
    turns = iter(["Name the capital of France.", "And of Italy?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(turns))
    engines = []
    from ember.engine import engine as engine_mod

    real_init = engine_mod.LLMEngine.__init__

    def spy_init(self, config):
        real_init(self, config)
        engines.append(self)

    monkeypatch.setattr(engine_mod.LLMEngine, "__init__", spy_init)
    rc = cli_main(["chat", "--max-tokens", "12", "--kv-cache-memory", "0.1", "--max-model-len", "1024"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "Rome" in out
    # the second turn's prompt starts with the whole first turn: it came from the prefix cache
    assert engines[0].parts.kv.stats.hits >= 32
