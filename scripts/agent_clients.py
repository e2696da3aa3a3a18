"""One turn of each real agent CLI against `ember serve`: Claude Code (`claude -p`, Anthropic's Messages API)
and OpenAI's Codex (`codex exec`, the Responses API). The log of the server shows the requests each made.

    make clients                          # npm install the pinned CLIs into .clients/ (needs node and npm)
    .venv/bin/python scripts/agent_clients.py                     # serve the default model, one turn each
    .venv/bin/python scripts/agent_clients.py --model M.gguf --output benchmarks/agent-clients.md

With the 135M default model the check is the protocol, not whether the agent succeeds: a client passes
when every request it made to its API route was answered 200 and it ended the turn with an answer (exit 0),
or with its own report that the answer reached its token limit (the CLI read the stream to its stop
reason; so small a model does not always stop, and which ending a run gets turns on its numerics).
Each CLI runs with a HOME of its own (no login, no user settings), its traffic to Anthropic's and
OpenAI's own services switched off where it has a switch, and only ember's loopback address as its API.
Each gets a one-line system prompt instead of its own (thousands of tokens, which the 135M model cannot
follow: it repeats itself to max_tokens, which both CLIs report as an error); `--own-prompts` keeps theirs,
for a model that can (`--model`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_INSTALL_DIR = ROOT / ".clients"
API_KEY = "ember-agent-clients"
PROMPT = "Reply with one short sentence: what is the capital of France?"
SHORT_SYSTEM_PROMPT = "You are a helpful assistant. Answer in one short sentence."
# uvicorn's access log: `INFO:     127.0.0.1:51234 - "POST /v1/messages?beta=true HTTP/1.1" 200 OK`
ACCESS_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>/[^ ?"]*)(?:\?[^ "]*)? HTTP/[0-9.]+" (?P<status>\d{3})')


@dataclasses.dataclass(frozen=True)
class AgentClient:
    name: str
    package: str
    version: str  # pinned: the version this check was last run with (docs/clients.md)
    binary: str
    route: str  # the API route its turns go to
    # what the CLI prints when the answer ended at its token limit: it read the stream to its end and its
    # stop reason (max_tokens, incomplete), and calls that turn an error
    length_stop: str


CLIENTS = {
    "claude": AgentClient(
        "Claude Code", "@anthropic-ai/claude-code", "2.1.197", "claude", "/v1/messages", "output token maximum"
    ),
    "codex": AgentClient(
        "Codex",
        "@openai/codex",
        "0.171.0",
        "codex",
        "/v1/responses",
        "Incomplete response returned, reason: max_output",
    ),
}


@dataclasses.dataclass
class Turn:
    client: AgentClient
    exit_code: int
    seconds: float
    answer: str
    requests: list[tuple[str, str, int]]  # (method, path, status) from the server's access log
    stderr_tail: str
    output: str = ""  # all the CLI printed

    @property
    def route_statuses(self) -> list[int]:
        return [status for method, path, status in self.requests if method == "POST" and path == self.client.route]

    @property
    def answered(self) -> bool:
        """The turn ended with an answer: exit 0 and text."""
        return self.exit_code == 0 and bool(self.answer.strip())

    @property
    def ended_at_max_tokens(self) -> bool:
        """The model wrote to its token limit and the CLI said so: the protocol worked (the CLI read the
        stream through to its stop reason), the 135M model did not stop. Greedy text of so small a model
        turns on the last bit of a reduction (thread count, compiled or eager), so which of the two
        endings a turn gets differs between machines; both are a protocol pass."""
        return self.exit_code not in (0, -1) and self.client.length_stop in self.output

    @property
    def passed(self) -> bool:
        statuses = self.route_statuses
        ok = bool(statuses) and all(s == 200 for s in statuses)
        return ok and (self.answered or self.ended_at_max_tokens)

    @property
    def result(self) -> str:
        if not self.passed:
            return "FAIL"
        return "pass" if self.answered else "pass (the model ran to max tokens; the CLI read that stop)"


def install(directory: Path, names: list[str]) -> None:
    """npm install the pinned CLIs into `directory` (their binaries land in node_modules/.bin)."""
    directory.mkdir(parents=True, exist_ok=True)
    packages = [f"{CLIENTS[n].package}@{CLIENTS[n].version}" for n in names]
    command = ["npm", "install", "--prefix", str(directory), "--no-audit", "--no-fund", "--no-save", *packages]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def binary_path(directory: Path, client: AgentClient) -> Path:
    return directory / "node_modules" / ".bin" / client.binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`ember serve` in a process group of its own, its log in a file; stopped (SIGTERM, then the group
    killed) when the block ends, so nothing it started outlives this script."""

    def __init__(self, model: str | None, port: int, log_path: Path, extra: list[str]):
        ember = Path(sys.executable).parent / "ember"
        self.command = [str(ember), "serve", *([model] if model else []), "--port", str(port), "--api-key", API_KEY]
        self.command += ["--uvicorn-log-level", "info"]  # an access line per request: what the clients asked
        # for what the clients leave unset (both send no temperature): greedy, and a repetition penalty,
        # without which this 135M model repeats one phrase under an agent prompt to max tokens more often;
        # answers of at most 256 tokens (Codex asks for no limit)
        self.command += [
            "--override-generation-config",
            json.dumps({"temperature": 0, "max_new_tokens": 256, "repetition_penalty": 1.3}),
        ]
        self.command += extra
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        print("+", " ".join(self.command), flush=True)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"ember serve exited ({self.process.returncode}) before /health:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"ember serve gave no /health 200 within 600 s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()

    def model_id(self) -> str:
        request = urllib.request.Request(self.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.load(r)["data"][0]["id"]

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def requests_since(self, offset: int) -> list[tuple[str, str, int]]:
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            text = f.read()
        return [(m["method"], m["path"], int(m["status"])) for m in ACCESS_LINE.finditer(text)]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def client_env(home: Path) -> dict[str, str]:
    """A clean environment: only PATH and locale from ours, a HOME of its own."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR")}
    env["HOME"] = str(home)
    return env


def claude_command(
    binary: Path, server: Server, model: str, home: Path, own_prompts: bool
) -> tuple[list[str], dict[str, str]]:
    env = client_env(home)
    env.update(
        ANTHROPIC_BASE_URL=server.url,  # the SDK inside appends /v1/messages
        ANTHROPIC_API_KEY=API_KEY,  # sent as x-api-key
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",  # no telemetry, error reports or update checks
        DISABLE_AUTOUPDATER="1",
        # Claude Code asks for 32,000 tokens, and at its limit asks again to continue, 3 times
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="256",
    )
    # Claude Code's own system prompt and its 24 tools make ~20,000 tokens (the tools alone ~16,000; the
    # default model's template shows none of them), more than this 135M model can follow: it rambles to
    # max_tokens, which Claude Code reports as an error. One tool and a one-line system prompt keep the
    # protocol the same (the billing header, reminders, adaptive thinking, streaming) with an answer that ends.
    command = [str(binary), "-p", PROMPT, "--model", model, "--output-format", "json", "--max-turns", "1"]
    if not own_prompts:
        command += ["--tools", "Read", "--system-prompt", SHORT_SYSTEM_PROMPT]
    return command, env


def codex_command(
    binary: Path, server: Server, model: str, home: Path, own_prompts: bool
) -> tuple[list[str], dict[str, str]]:
    env = client_env(home)
    env["CODEX_HOME"] = str(home / ".codex")
    env["EMBER_API_KEY"] = API_KEY
    Path(env["CODEX_HOME"]).mkdir(parents=True, exist_ok=True)
    # As with Claude Code, a one-line base prompt instead of Codex's own (~4,000 tokens with its tools,
    # which this 135M model only repeats from); the skills and environment messages are still sent.
    instructions = home / "instructions.md"
    instructions.write_text(SHORT_SYSTEM_PROMPT + "\n")
    # a model provider of its own pointing at ember; Codex speaks only the Responses API
    (Path(env["CODEX_HOME"]) / "config.toml").write_text(
        f'model = "{model}"\n'
        + ("" if own_prompts else f'model_instructions_file = "{instructions}"\n')
        + 'model_provider = "ember"\n'
        "[model_providers.ember]\n"
        'name = "ember"\n'
        f'base_url = "{server.url}/v1"\n'
        'env_key = "EMBER_API_KEY"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )
    last_message = home / "last-message.txt"
    command = [str(binary), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--ephemeral"]
    command += ["-o", str(last_message), PROMPT]
    return command, env


def claude_answer(stdout: str, home: Path) -> str:
    try:
        return str(json.loads(stdout.strip().splitlines()[-1]).get("result") or "")
    except (ValueError, IndexError, AttributeError):
        return ""


def codex_answer(stdout: str, home: Path) -> str:
    path = home / "last-message.txt"
    return path.read_text(errors="replace") if path.exists() else ""


COMMANDS = {"claude": (claude_command, claude_answer), "codex": (codex_command, codex_answer)}


def run_turn(name: str, binary: Path, server: Server, model: str, timeout: float, own_prompts: bool = False) -> Turn:
    client = CLIENTS[name]
    build, read_answer = COMMANDS[name]
    # a folder of a fixed name: the CLIs show the model their working directory, and a random name would
    # make each run's prompt differ
    home = Path(tempfile.gettempdir()) / f"ember-agent-{name}"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir()
    try:
        command, env = build(binary, server, model, home, own_prompts)
        offset = server.log_size()
        print("+", " ".join(command[:1] + [c if " " not in c else repr(c) for c in command[1:]]), flush=True)
        start = time.monotonic()
        try:
            done = subprocess.run(
                command, env=env, cwd=home, capture_output=True, text=True, timeout=timeout, start_new_session=True
            )
            exit_code, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as e:
            exit_code, stdout, stderr = -1, _text(e.stdout), _text(e.stderr) + f"\n(timed out after {timeout:.0f} s)"
        seconds = time.monotonic() - start
        time.sleep(0.5)  # the access log line of the last answer
        answer = read_answer(stdout, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    tail = "\n".join((stderr or stdout).strip().splitlines()[-15:])
    return Turn(client, exit_code, seconds, answer, server.requests_since(offset), tail, f"{stdout}\n{stderr}")


def _text(value) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def report(turns: list[Turn], model: str, server_command: list[str]) -> str:
    lines = [
        f"model: {model}; server: `{' '.join(server_command)}`",
        "",
        "| client | version | exit | time | requests (method path status) | answer | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in turns:
        counts: dict[tuple[str, str, int], int] = {}
        for request in t.requests:
            counts[request] = counts.get(request, 0) + 1
        requests = ", ".join(f"{m} {p} {s}" + (f" x{n}" if n > 1 else "") for (m, p, s), n in counts.items())
        answer = " ".join(t.answer.split())[:80].replace("|", "/")
        lines.append(
            f"| {t.client.name} | {t.client.version} | {t.exit_code} | {t.seconds:.1f} s | {requests or 'none'} | "
            f"{answer!r} | {t.result} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="claude,codex", help="comma-separated: claude, codex")
    parser.add_argument("--install-dir", type=Path, default=DEFAULT_INSTALL_DIR, help="where the CLIs are installed")
    parser.add_argument("--install", action="store_true", help="npm install the pinned CLIs, then exit")
    parser.add_argument("--model", default=None, help="what `ember serve` serves (default: the default model)")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more `ember serve` flag (repeatable)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each CLI may take for its turn")
    parser.add_argument(
        "--own-prompts",
        action="store_true",
        help="each CLI with its own system prompt and every tool (~20,000 tokens for Claude Code), for a model "
        "that can follow them (not the 135M default model)",
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the table (markdown) here")
    parser.add_argument("--server-log", type=Path, default=None, help="keep the server's log here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.clients.split(",") if n.strip()]
    unknown = [n for n in names if n not in CLIENTS]
    if unknown:
        parser.error(f"unknown client(s) {unknown}: choose from {sorted(CLIENTS)}")
    if args.install:
        install(args.install_dir, names)
        return 0
    missing = [str(binary_path(args.install_dir, CLIENTS[n])) for n in names]
    missing = [m for m in missing if not Path(m).exists()]
    if missing:
        print(f"not installed: {missing}; run `make clients` (or this script with --install)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ember-agent-clients-") as tmp:
        log_path = args.server_log or Path(tmp) / "server.log"
        with Server(args.model, free_port(), log_path, args.serve_arg) as server:
            model = server.model_id()
            turns = [
                run_turn(n, binary_path(args.install_dir, CLIENTS[n]), server, model, args.timeout, args.own_prompts)
                for n in names
            ]
            for t in turns:
                if not t.passed:
                    print(f"--- {t.client.name} failed; its output ends:\n{t.stderr_tail}", file=sys.stderr)
                    print(f"--- the server's log ends:\n{server.log_tail()}", file=sys.stderr)
        table = report(turns, model, server.command)
    print(table)
    if args.output:
        args.output.write_text(table + "\n")
    return 0 if all(t.passed for t in turns) else 1


if __name__ == "__main__":
    sys.exit(main())
