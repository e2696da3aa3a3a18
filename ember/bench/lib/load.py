"""An asyncio load generator for any OpenAI-compatible server: streaming requests over httpx, timed per chunk.

No torch and no ember engine here: this is the client side of `ember bench serve`, the same for
ember, vLLM or llama.cpp's server. Per request it records

- TTFT: request sent -> first SSE chunk that carries generated text (chat servers first send an
  empty `role` chunk; it does not count),
- ITL: the gaps between consecutive chunks that carry text (a chunk can hold more than one token,
  e.g. when the detokenizer holds back half a UTF-8 character; vLLM's benchmark counts the same way),
- TPOT: (e2e - TTFT) / (output tokens - 1),
- e2e: request sent -> the stream's end (`data: [DONE]`),

and counts tokens from the final `usage` chunk (requested with stream_options.include_usage), not
from chunks. Aggregates are p50/p90/p99 (linear interpolation, as numpy's default).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # httpx is the bench extra's (imported where a load runs): `ember serve` parses without it
    import httpx


# -- the workload -----------------------------------------------------------------------------


@dataclass
class RequestSpec:
    """One request: a prompt (token ids or text) and how many tokens to generate."""

    prompt: list[int] | str
    output_len: int
    input_len: int | None = None  # intended prompt tokens (None: text whose count only the server knows)


def lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """n lengths drawn uniformly from [mean*(1-r), mean*(1+r)] (vLLM's random dataset); r=0 is fixed."""
    if range_ratio <= 0:
        return [mean] * n
    lo, hi = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def token_id_specs(pool: list[int], input_lens: list[int], output_lens: list[int], seed: int) -> list[RequestSpec]:
    """Random prompts of token ids drawn from `pool` (the tokenizer's ordinary tokens): fresh per seed,
    so a server's prefix cache never serves one."""
    rng = random.Random(seed)
    return [RequestSpec(rng.choices(pool, k=i), o, i) for i, o in zip(input_lens, output_lens)]


_WORDS: list[str] | None = None


def words() -> list[str]:
    """Ordinary English words from CPython's own documentation (offline, in every CPython)."""
    global _WORDS
    if _WORDS is None:
        import pydoc_data.topics

        seen: dict[str, None] = {}
        for text in pydoc_data.topics.topics.values():
            for w in text.split():
                w = w.strip(".,;:()[]{}\"'`*")
                if w.isalpha() and 2 <= len(w) <= 12:
                    seen.setdefault(w.lower(), None)
        _WORDS = list(seen)
    return _WORDS


def text_prompt(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choices(words(), k=max(1, n_words)))


def text_specs(
    words_for: Callable[[int], int], input_lens: list[int], output_lens: list[int], seed: int
) -> list[RequestSpec]:
    """Text prompts of random words; words_for(tokens) says how many words give that many prompt
    tokens on the server (see calibrate_text)."""
    rng = random.Random(seed)
    return [RequestSpec(text_prompt(words_for(i), rng), o, None) for i, o in zip(input_lens, output_lens)]


# -- talking to the server --------------------------------------------------------------------


@dataclass
class Target:
    """Where and how to send requests."""

    base_url: str  # http://host:port (a trailing /v1 is accepted)
    model: str | None = None
    endpoint: str = "completions"  # completions | chat
    api_key: str | None = None
    ignore_eos: bool = True  # send ignore_eos + min_tokens (vLLM / ember / llama.cpp extensions)
    extra_body: dict = field(default_factory=dict)

    @property
    def root(self) -> str:
        u = self.base_url.rstrip("/")
        return u[:-3] if u.endswith("/v1") else u

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, spec: RequestSpec, stream: bool = True) -> dict:
        b: dict[str, Any] = {"max_tokens": spec.output_len, "temperature": 0.0}
        if self.model:
            b["model"] = self.model
        if self.endpoint == "chat":
            b["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            b["prompt"] = spec.prompt
        if stream:
            b["stream"] = True
            b["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            b["ignore_eos"] = True
            b["min_tokens"] = spec.output_len
        b.update(self.extra_body)
        return b


def client(target: Target, connections: int) -> httpx.AsyncClient:
    import httpx

    return httpx.AsyncClient(
        base_url=target.root,
        headers=target.headers,
        timeout=httpx.Timeout(None, connect=30.0),
        limits=httpx.Limits(max_connections=max(1, connections), max_keepalive_connections=max(1, connections)),
    )


async def served_model(target: Target) -> dict:
    """The first entry of GET /v1/models (its id names the model in requests)."""
    async with client(target, 1) as c:
        r = await c.get("/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{target.root}/v1/models lists no model")
    return data[0]


async def prompt_tokens_of(target: Target, prompts: list[str]) -> list[int]:
    """usage.prompt_tokens the server counts for each text prompt (non-streaming, max_tokens=1)."""
    out = []
    async with client(target, 1) as c:
        for p in prompts:
            body = target.body(RequestSpec(p, 1), stream=False)
            body.pop("min_tokens", None)
            r = await c.post(target.path, json=body)
            if r.status_code != 200:
                raise RuntimeError(f"calibration request failed: HTTP {r.status_code}: {r.text[:300]}")
            out.append(int(r.json()["usage"]["prompt_tokens"]))
    return out


@dataclass
class TextCalibration:
    """prompt tokens = base + per_word * words, fitted on this server (chat template included for chat)."""

    base: float
    per_word: float

    def words_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.base) / self.per_word))


async def calibrate_text(target: Target, input_len: int, seed: int) -> TextCalibration:
    """Fit prompt tokens against words of random text from two probe sizes (two probes each).

    Probes use random words of their own: sending the measured prompts would put them in the
    server's prefix cache."""
    rng = random.Random(seed)
    n1, n2 = max(1, input_len // 4), max(2, input_len)
    t = await prompt_tokens_of(target, [text_prompt(n, rng) for n in (n1, n1, n2, n2)])
    per_word = max(0.05, ((t[2] + t[3]) - (t[0] + t[1])) / (2 * (n2 - n1)))
    base = (t[0] + t[1]) / 2 - per_word * n1
    return TextCalibration(base, per_word)


# -- one request ----------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None  # seconds
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # from usage; chunk count when the server sent none
    usage_reported: bool = False
    chunks: int = 0
    start: float = 0.0  # perf_counter at send
    end: float = 0.0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _chunk_text(obj: dict, endpoint: str) -> bool:
    """Whether an SSE chunk carries generated output."""
    for ch in obj.get("choices") or []:
        if endpoint == "chat":
            d = ch.get("delta") or {}
            if d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls"):
                return True
        elif ch.get("text"):
            return True
    return False


async def send(c: httpx.AsyncClient, target: Target, spec: RequestSpec) -> RequestResult:
    """One streaming request, timed chunk by chunk."""
    import httpx

    res = RequestResult(ok=False)
    body = target.body(spec)
    res.start = t0 = time.perf_counter()
    last = None
    try:
        async with c.stream("POST", target.path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text[:300]}"
                return res
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj and "choices" not in obj:
                    res.error = f"in-stream error: {json.dumps(obj['error'])[:300]}"
                    return res
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"].get("prompt_tokens")
                    res.output_tokens = obj["usage"].get("completion_tokens")
                    res.usage_reported = res.output_tokens is not None
                if _chunk_text(obj, target.endpoint):
                    res.chunks += 1
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
            res.end = time.perf_counter()
            res.e2e = res.end - t0
            if not done:
                res.error = "the stream ended without data: [DONE]"
                return res
            if not res.usage_reported:
                res.output_tokens = res.chunks
            res.ok = res.ttft is not None
            if not res.ok:
                res.error = "no generated text in the stream"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# -- a whole level ------------------------------------------------------------------------------


async def run_async(
    target: Target,
    specs: list[RequestSpec],
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    progress: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every spec (at most max_concurrency in flight; arrivals a Poisson process at request_rate
    per second, or all at once when inf); returns the results in spec order and the wall time from
    the first send to the last answer."""
    limit = max_concurrency or len(specs)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(seed)

    async with client(target, min(limit, len(specs))) as c:

        async def one(spec: RequestSpec) -> RequestResult:
            async with sem:
                r = await send(c, target, spec)
            if progress:
                progress(r)
            return r

        t0 = time.perf_counter()
        tasks = []
        for i, spec in enumerate(specs):
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - t0
    return list(results), seconds


def run(target: Target, specs: list[RequestSpec], **kw) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_async(target, specs, **kw))


# -- aggregates -----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """q in [0, 100], linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


PERCENTILES = (50, 90, 99)


def _dist(values: list[float], scale: float = 1.0) -> dict:
    d = {f"p{q}": (None if (v := percentile(values, q)) is None else v * scale) for q in PERCENTILES}
    d["mean"] = sum(values) * scale / len(values) if values else None
    return d


@dataclass
class LevelStats:
    """One load level (a concurrency or a request rate): counts, rates and latency distributions."""

    max_concurrency: int | None
    request_rate: float | None
    completed: int
    failed: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    expected_output_tokens: int
    usage_reported: bool
    request_throughput: float
    output_throughput: float
    total_throughput: float
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2e_s: dict
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(
    specs: list[RequestSpec],
    results: list[RequestResult],
    seconds: float,
    *,
    max_concurrency: int | None,
    request_rate: float,
) -> LevelStats:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    out = sum(r.output_tokens or 0 for r in ok)
    errors = sorted({r.error for r in results if not r.ok and r.error})
    return LevelStats(
        max_concurrency=max_concurrency,
        request_rate=None if math.isinf(request_rate) else request_rate,
        completed=len(ok),
        failed=len(results) - len(ok),
        seconds=seconds,
        prompt_tokens=prompt,
        output_tokens=out,
        expected_output_tokens=sum(s.output_len for s in specs),
        usage_reported=all(r.usage_reported for r in ok),
        request_throughput=len(ok) / seconds,
        output_throughput=out / seconds,
        total_throughput=(prompt + out) / seconds,
        ttft_ms=_dist([r.ttft for r in ok], 1e3),
        tpot_ms=_dist([t for r in ok if (t := r.tpot) is not None], 1e3),
        itl_ms=_dist([g for r in ok for g in r.itl], 1e3),
        e2e_s=_dist([r.e2e for r in ok]),
        errors=errors[:5],
    )
