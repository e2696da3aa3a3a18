"""Prometheus metrics of one server (its own CollectorRegistry, so a process can hold several apps).

Names follow vLLM's with an `ember:` prefix, so dashboards port by renaming. The engine thread
feeds the gauges and token counters after every step (prometheus-client is thread-safe); the
HTTP layer counts requests by endpoint and status code.
"""
from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 -- re-exported for the route

# `*_created` timestamp series double the output and no dashboard reads them (vLLM drops them too).
prometheus_client.disable_created_metrics()

from ember.engine.async_engine import RequestTiming

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name}
        self._labels = labels

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*labels, *extra], registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        self.http_requests = counter("ember:http_requests", "HTTP requests by endpoint and status code",
                                     ("endpoint", "status"))
        self.request_success = counter("ember:request_success", "finished requests by finish reason",
                                       ("finished_reason",))
        self.prompt_tokens = counter("ember:prompt_tokens", "prompt tokens of finished (and aborted) requests").labels(**labels)
        self.generation_tokens = counter("ember:generation_tokens", "generated tokens").labels(**labels)
        self.prefix_cache_queries = counter("ember:prefix_cache_queries", "prompt tokens looked up in the prefix cache").labels(**labels)
        self.prefix_cache_hits = counter("ember:prefix_cache_hits", "prompt tokens found in the prefix cache").labels(**labels)
        self.preemptions = counter("ember:num_preemptions", "requests preempted for lack of KV blocks").labels(**labels)
        self.running = gauge("ember:num_requests_running", "sequences in the running batch")
        self.waiting = gauge("ember:num_requests_waiting", "sequences waiting for a slot")
        self.kv_usage = gauge("ember:kv_cache_usage_perc", "fraction of KV cache blocks in use (0-1)")
        self.prefix_hit_rate = gauge("ember:prefix_cache_hit_rate", "prefix cache hits / queries since start (0-1)")
        self.ttft = histogram("ember:time_to_first_token_seconds", "time from arrival to the first generated token",
                              TTFT_BUCKETS)
        self.tpot = histogram("ember:time_per_output_token_seconds", "mean time between output tokens, per request",
                              TPOT_BUCKETS)
        self.e2e = histogram("ember:e2e_request_latency_seconds", "time from arrival to the last token", E2E_BUCKETS)
        self.grammar_compile = histogram("ember:structured_output_compile_seconds",
                                         "time to compile one distinct structured-output grammar (cache misses)",
                                         GRAMMAR_COMPILE_BUCKETS)
        self.grammar_mask = histogram("ember:structured_output_mask_seconds",
                                      "per step with constrained requests: filling and applying their grammar masks",
                                      MASK_BUCKETS)
        # read at scrape time (an idle server steps no more, yet its compile finishes)
        self.compiling = gauge("ember:executor_compiling", "1 while decode graphs compile in the background "
                               "(--executor auto on CPU: steps run eagerly meanwhile), else 0")
        self.compiling.set_function(lambda: 0.0)
        self._last: dict | None = None
        self._queries = self._hits = 0
        self._spec: dict | None = None  # created at the first stats that carry spec counters

    def _spec_metrics(self) -> dict:
        if self._spec is None:
            r, labels = self.registry, self._labels

            def counter(name, doc, extra=()):
                c = Counter(name, doc, [*labels, *extra], registry=r)
                return c if extra else c.labels(**labels)

            self._spec = {
                "spec_num_drafts": counter("ember:spec_decode_num_drafts", "verify steps that carried draft tokens (per request)"),
                "spec_num_draft_tokens": counter("ember:spec_decode_num_draft_tokens", "draft tokens verified"),
                "spec_num_accepted_tokens": counter("ember:spec_decode_num_accepted_tokens", "draft tokens accepted"),
                "spec_num_accepted_tokens_per_pos": counter("ember:spec_decode_num_accepted_tokens_per_pos",
                                                            "draft tokens accepted, by draft position (0 = first)", ("position",)),
                "spec_num_draft_tokens_per_pos": counter("ember:spec_decode_num_draft_tokens_per_pos",
                                                         "draft tokens verified, by draft position (0 = first)", ("position",)),
                "spec_draft_seconds": counter("ember:spec_decode_draft_seconds", "time spent proposing drafts"),
                "spec_verify_seconds": counter("ember:spec_decode_verify_seconds", "time of steps that verified drafts"),
                "mean": Gauge("ember:spec_decode_mean_accepted_length", "tokens emitted per verify step since start",
                              list(labels), registry=r).labels(**labels),
            }
        return self._spec

    def _on_spec(self, stats: dict, last: dict) -> None:
        m = self._spec_metrics()
        for key in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_draft_seconds",
                    "spec_verify_seconds"):
            m[key].inc(max(0, stats[key] - last.get(key, 0)))
        for key in ("spec_num_accepted_tokens_per_pos", "spec_num_draft_tokens_per_pos"):
            before = last.get(key) or [0] * len(stats[key])
            for pos, (now, was) in enumerate(zip(stats[key], before)):
                m[key].labels(**self._labels, position=str(pos)).inc(max(0, now - was))  # every position shows, 0 too
        m["mean"].set(stats["spec_mean_accepted_length"])

    def watch_compile(self, compiler) -> None:
        """Report a BackgroundCompiler's state (None: nothing compiles in the background)."""
        if compiler is not None:
            self.compiling.set_function(lambda: 0.0 if compiler.done else 1.0)

    # -- the structured-output manager's listener (engine and grammar threads) ---------------------
    def observe_compile(self, seconds: float) -> None:
        self.grammar_compile.observe(seconds)

    def observe_mask(self, seconds: float) -> None:
        self.grammar_mask.observe(seconds)

    # -- StatsListener (called on the engine thread) --------------------------------------------
    def on_step(self, stats: dict, num_new_tokens: int, step_seconds: float) -> None:
        last = self._last
        self._last = stats
        if last is None:  # the first report (after warmup) is the baseline
            last = stats
        dq = max(0, stats["prefix_cache_queries"] - last["prefix_cache_queries"])
        dh = max(0, stats["prefix_cache_hits"] - last["prefix_cache_hits"])
        self._queries += dq
        self._hits += dh
        self.prefix_cache_queries.inc(dq)
        self.prefix_cache_hits.inc(dh)
        self.preemptions.inc(max(0, stats["num_preemptions"] - last["num_preemptions"]))
        self.generation_tokens.inc(num_new_tokens)
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        total = stats["kv_blocks_total"]
        self.kv_usage.set(1.0 - stats["kv_blocks_free"] / total if total else 0.0)
        self.prefix_hit_rate.set(self._hits / self._queries if self._queries else 0.0)
        if "spec_num_drafts" in stats:
            self._on_spec(stats, last)

    def on_request_finished(self, t: RequestTiming) -> None:
        self.request_success.labels(**self._labels, finished_reason=t.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(t.num_prompt_tokens)
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
            if t.max_seq_tokens > 1 and t.finished is not None and t.finish_reason != "abort":
                self.tpot.observe((t.finished - t.first_token) / (t.max_seq_tokens - 1))
        if t.finished is not None and t.finish_reason != "abort":
            self.e2e.observe(t.finished - t.arrival)

    # -- HTTP --------------------------------------------------------------------------------------
    def count_http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(**self._labels, endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
