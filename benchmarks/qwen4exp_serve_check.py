"""`ember serve` (the CLI, its own process) on a tiny qwen4_exp with a Qwen3.5-style always-thinking chat template,
through the official openai SDK: a chat answer whole and streamed (reasoning split from content, the same
both ways), reasoning_effort, and a forced XML tool call returned as tool_calls; the server stopped with
SIGTERM. The model is random: a logit_bias on `</think>` ends its reasoning (it never writes it by itself).

    .venv/bin/python benchmarks/qwen4exp_serve_check.py
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import httpx
import openai

from tests.models.tiny_qwen4 import build_qwen4, save_qwen4_chat
from tests.server.test_qwen4_serve import WEATHER

d = tempfile.mkdtemp(prefix="qwen4-serve-")
save_qwen4_chat(build_qwen4(), d)
log = open(d + "/serve.log", "w")
p = subprocess.Popen(
    [
        os.path.join(os.path.dirname(sys.executable), "ember"),
        "serve",
        d,
        "--port",
        "8765",
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "0.05",
    ],
    stdout=log,
    stderr=subprocess.STDOUT,
    start_new_session=True,
)
try:
    t0 = time.time()
    while True:
        try:
            if httpx.get("http://127.0.0.1:8765/health").status_code == 200:
                break
        except Exception:
            pass
        if p.poll() is not None:
            print(open(d + "/serve.log").read()[-3000:])
            sys.exit(1)
        time.sleep(0.5)
    print("health after", round(time.time() - t0, 1), "s")
    c = openai.OpenAI(base_url="http://127.0.0.1:8765/v1", api_key="x")
    model = c.models.list().data[0].id
    tok = httpx.post(
        "http://127.0.0.1:8765/tokenize", json={"model": model, "prompt": "</think>", "add_special_tokens": False}
    ).json()["tokens"]
    bias = {str(tok[0]): 4}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(
        model=model, messages=ask, max_tokens=40, temperature=1.0, seed=3, logit_bias=bias, reasoning_effort="low"
    )
    m = r.choices[0].message
    print(
        "whole: reasoning",
        len(m.reasoning_content or ""),
        "chars; content",
        repr((m.content or "")[:40]),
        r.usage.prompt_tokens,
        "prompt tokens",
    )
    chunks = list(
        c.chat.completions.create(
            model=model,
            messages=ask,
            max_tokens=40,
            temperature=1.0,
            seed=3,
            logit_bias=bias,
            reasoning_effort="low",
            stream=True,
        )
    )
    text = "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
    reason = "".join((getattr(ch.choices[0].delta, "reasoning_content", None) or "") for ch in chunks if ch.choices)
    print(
        "streamed: chunks",
        len(chunks),
        "same content as whole:",
        text == (m.content or ""),
        "same reasoning:",
        reason == (m.reasoning_content or ""),
    )
    weather = WEATHER  # the serve test's tool: an integer argument (a random model fills free strings with spaces)
    r = c.chat.completions.create(
        model=model,
        messages=ask,
        tools=[weather],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=160,
        temperature=0,
        logit_bias={str(tok[0]): 2},
    )
    ch = r.choices[0]
    print("tool call:", ch.finish_reason, [(t.function.name, t.function.arguments) for t in ch.message.tool_calls])
finally:
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(60)
    print("server exit", p.returncode)
