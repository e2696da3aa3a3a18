"""scripts/agent_clients.py: the real Claude Code and Codex CLIs, one turn each against `ember serve` on the
default model. The CLIs come from npm (`make clients`, which CI runs before `make test`); the live test
needs them, the rest of this file checks how the script reads the server's log and judges a turn."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("ember_agent_clients", ROOT / "scripts" / "agent_clients.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_access_lines_are_read_as_method_path_status(script, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "2026-12-06 12:14:24 INFO ember.server: ember serve: ready\n"
        'INFO:     127.0.0.1:51234 - "POST /v1/messages?beta=true HTTP/1.1" 200 OK\n'
        'INFO:     127.0.0.1:51236 - "GET /v1/models HTTP/1.1" 401 Unauthorized\n'
    )
    server = script.Server(None, 1, log, [])
    assert server.requests_since(0) == [("POST", "/v1/messages", 200), ("GET", "/v1/models", 401)]
    assert server.requests_since(log.stat().st_size) == []


def test_a_turn_passes_only_with_exit_0_an_answer_and_every_request_to_its_route_answered_200(script):
    claude = script.CLIENTS["claude"]

    def turn(exit_code=0, answer="Paris.", requests=(("POST", "/v1/messages", 200),)):
        return script.Turn(claude, exit_code, 1.0, answer, list(requests), "")

    assert turn().passed
    assert not turn(exit_code=1).passed
    assert not turn(answer=" \n").passed
    assert not turn(requests=[("POST", "/v1/responses", 200)]).passed  # not its route
    assert not turn(requests=[("POST", "/v1/messages", 200), ("POST", "/v1/messages", 400)]).passed
    assert turn(requests=[("POST", "/v1/messages", 200), ("GET", "/v1/models", 404)]).passed  # side requests


def test_a_turn_the_model_ran_to_max_tokens_passes_only_when_the_cli_says_so(script):
    """The CLI read the stream to its stop reason and reported it: the protocol worked. A crash, a timeout
    or another error does not count."""
    codex = script.CLIENTS["codex"]
    ok = [("POST", "/v1/responses", 200)]
    said = "codex\nLe Grand...\nERROR: Incomplete response returned, reason: max_output_tokens\n"
    at_limit = script.Turn(codex, 1, 1.0, "", ok, "", said)
    assert at_limit.passed and at_limit.ended_at_max_tokens and "max tokens" in at_limit.result
    assert not script.Turn(codex, 1, 1.0, "", ok, "", "ERROR: stream disconnected before completion").passed
    assert not script.Turn(codex, -1, 300.0, "", ok, "", said + "(timed out after 300 s)").passed
    assert not script.Turn(codex, 1, 1.0, "", [("POST", "/v1/responses", 500)], "", said).passed
    claude = script.CLIENTS["claude"]
    said = '{"is_error":true,"result":"API Error: Claude\'s response exceeded the 256 output token maximum."}'
    assert script.Turn(claude, 1, 1.0, "", [("POST", "/v1/messages", 200)] * 4, "", said).passed
    assert script.Turn(claude, 0, 1.0, "Paris.", [("POST", "/v1/messages", 200)], "").result == "pass"


def test_a_client_that_is_not_installed_is_named_with_how_to_install_it(script, tmp_path, capsys):
    assert script.main(["--install-dir", str(tmp_path), "--clients", "codex"]) == 2
    err = capsys.readouterr().err
    assert "node_modules/.bin/codex" in err and "make clients" in err
    with pytest.raises(SystemExit):
        script.main(["--clients", "cursor"])


@pytest.mark.engine
def test_claude_code_and_codex_each_complete_a_turn_against_ember(script, tmp_path):
    bin_dir = Path(os.environ.get("EMBER_AGENT_CLIENTS", ROOT / ".clients")) / "node_modules" / ".bin"
    missing = [name for name in ("claude", "codex") if not (bin_dir / name).exists()]
    if missing:
        pytest.skip(f"{missing} not installed in {bin_dir}: `make clients` installs them (npm)")
    code = script.main(["--install-dir", str(bin_dir.parent.parent), "--output", str(tmp_path / "table.md")])
    table = (tmp_path / "table.md").read_text()
    assert code == 0, table
    assert "| Claude Code |" in table and "POST /v1/messages 200" in table
    assert "| Codex |" in table and "POST /v1/responses 200" in table
