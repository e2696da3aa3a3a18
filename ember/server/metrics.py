"""Prometheus metrics of one server (its own CollectorRegistry, so a process can hold several apps).

Every metric vLLM defines that ember measures is exported twice, from the same measurement: under
ember's name (`ember:...`) and under vLLM's (`vllm:...`), so the dashboards, autoscalers and routers
people already point at vLLM read ember unchanged. ember's own (HTTP counts, structured outputs,
speculation, compile state, time per output token) are `ember:` only. The engine thread feeds the
gauges and token counters after every step (prometheus-client is thread-safe); the HTTP layer
counts requests by endpoint and status code.
"""

from __future__ import annotations

import json

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401 -- re-exported for the route
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ember.engine.async_engine import RequestTiming

# `*_created` timestamp series double the output and no dashboard reads them (vLLM drops them too).
prometheus_client.disable_created_metrics()

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_SECONDS_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def _token_buckets(max_model_len: int) -> tuple:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's request token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _Both:
    """One measurement under two names (ember's and vLLM's): what is done to it is done to each."""

    def __init__(self, *metrics):
        self.metrics = metrics

    def labels(self, **kw) -> "_Both":
        return _Both(*(m.labels(**kw) for m in self.metrics))

    def inc(self, amount: float = 1.0) -> None:
        for m in self.metrics:
            m.inc(amount)

    def set(self, value: float) -> None:
        for m in self.metrics:
            m.set(value)

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 8192, cache_info: dict | None = None):
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name}
        # Prometheus renders metrics in the order they were registered: the families below keep it.
        self._define_counters()
        self._define_load_gauges()
        self._define_latency_histograms()
        self._define_request_size_histograms(_token_buckets(max_model_len))
        if cache_info:
            self._define_cache_info(cache_info)
        self._define_structured_output_histograms()
        self._define_compile_gauges()
        self._last: dict | None = None
        self.load = {"kv_cache_usage_perc": 0.0, "num_requests_waiting": 0.0, "num_requests_running": 0.0}  # ORCA
        self._queries = self._hits = 0
        self._spec: dict | None = None  # created at the first stats that carry spec counters

    # -- metric makers: the model_name label on every one ----------------------------------------
    def _counter(self, name: str, doc: str, extra: tuple = ()) -> Counter:
        return Counter(name, doc, [*self._labels, *extra], registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: dict | None = None):
        """A gauge with its one label set (the model's, unless labels says otherwise)."""
        labels = self._labels if labels is None else labels
        return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

    def _histogram(self, name: str, doc: str, buckets: tuple):
        return Histogram(name, doc, list(self._labels), buckets=buckets, registry=self.registry).labels(**self._labels)

    @staticmethod
    def _both(make, name: str, *args) -> _Both:
        """vLLM's metric: made as ember:name and as vllm:name, fed together."""
        return _Both(make("ember:" + name, *args), make("vllm:" + name, *args))

    # -- the families --------------------------------------------------------------------------
    def _define_counters(self) -> None:
        """HTTP requests, finished requests and the token, prefix-cache and preemption counts."""
        counter, both, labels = self._counter, self._both, self._labels
        self.http_requests = counter(
            "ember:http_requests", "HTTP requests by endpoint and status code", ("endpoint", "status")
        )
        self.request_success = both(
            counter, "request_success", "finished requests by finish reason", ("finished_reason",)
        )
        self.prompt_tokens = both(counter, "prompt_tokens", "prompt tokens of finished (and aborted) requests").labels(
            **labels
        )
        self.generation_tokens = both(counter, "generation_tokens", "generated tokens").labels(**labels)
        self.prefix_cache_queries = both(
            counter, "prefix_cache_queries", "prompt tokens looked up in the prefix cache"
        ).labels(**labels)
        self.prefix_cache_hits = both(counter, "prefix_cache_hits", "prompt tokens found in the prefix cache").labels(
            **labels
        )
        self.preemptions = both(counter, "num_preemptions", "requests preempted for lack of KV blocks").labels(**labels)

    def _define_load_gauges(self) -> None:
        """What the engine holds now: running and waiting sequences, KV cache use, prefix-cache hit rate."""
        gauge, both = self._gauge, self._both
        self.running = both(gauge, "num_requests_running", "sequences in the running batch")
        self.waiting = both(gauge, "num_requests_waiting", "sequences waiting for a slot")
        # vLLM splits the waiting by reason; ember's only reason to wait is capacity (KV blocks / batch slots)
        self.waiting_by_reason = both(
            gauge,
            "num_requests_waiting_by_reason",
            "waiting requests by why they wait",
            {**self._labels, "reason": "capacity"},
        )
        self.kv_usage = both(gauge, "kv_cache_usage_perc", "fraction of KV cache blocks in use (0-1)")
        self.prefix_hit_rate = gauge("ember:prefix_cache_hit_rate", "prefix cache hits / queries since start (0-1)")

    def _define_latency_histograms(self) -> None:
        """Per request (and per output token): how long its phases took."""
        histogram, both = self._histogram, self._both
        self.ttft = both(
            histogram, "time_to_first_token_seconds", "time from arrival to the first generated token", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "ember:time_per_output_token_seconds", "mean time between output tokens, per request", TPOT_BUCKETS
        )
        self.itl = both(
            histogram,
            "inter_token_latency_seconds",
            "time between consecutive output tokens of a "
            "sequence (tokens that arrive together, as accepted drafts, share the interval)",
            ITL_BUCKETS,
        )
        self.e2e = both(histogram, "e2e_request_latency_seconds", "time from arrival to the last token", E2E_BUCKETS)
        self.queue_time = both(
            histogram,
            "request_queue_time_seconds",
            "time from arrival to the first step that runs the request",
            REQUEST_SECONDS_BUCKETS,
        )
        self.inference_time = both(
            histogram,
            "request_inference_time_seconds",
            "time from the first step that runs the request to its last token",
            REQUEST_SECONDS_BUCKETS,
        )
        self.prefill_time = both(
            histogram,
            "request_prefill_time_seconds",
            "time from the first step that runs the request to its first token",
            REQUEST_SECONDS_BUCKETS,
        )
        self.decode_time = both(
            histogram, "request_decode_time_seconds", "time from the first token to the last", REQUEST_SECONDS_BUCKETS
        )

    def _define_request_size_histograms(self, token_buckets: tuple) -> None:
        """Per finished request: its token counts and sampling parameters; per engine step: its tokens."""
        histogram, both = self._histogram, self._both
        self.request_prompt_tokens = both(
            histogram, "request_prompt_tokens", "prompt tokens per finished request", token_buckets
        )
        self.request_generation_tokens = both(
            histogram,
            "request_generation_tokens",
            "generated tokens per finished request (all its sequences)",
            token_buckets,
        )
        self.params_n = both(histogram, "request_params_n", "the n of finished requests", PARAMS_N_BUCKETS)
        self.params_max_tokens = both(
            histogram, "request_params_max_tokens", "the max_tokens of finished requests", token_buckets
        )
        self.iteration_tokens = both(
            histogram,
            "iteration_tokens_total",
            "tokens per engine step: the prompts that got their first token in it plus the tokens generated",
            ITERATION_TOKENS_BUCKETS,
        )

    def _define_cache_info(self, cache_info: dict) -> None:
        """vLLM's cache_config_info: the KV cache's configuration as the labels of a constant 1."""
        info = {k: str(v) for k, v in cache_info.items()}
        self._both(self._gauge, "cache_config_info", "the KV cache's configuration (labels); the value is 1", info).set(
            1
        )

    def _define_structured_output_histograms(self) -> None:
        """The structured-output manager's timings: grammar compiles and the per-step mask work."""
        self.grammar_compile = self._histogram(
            "ember:structured_output_compile_seconds",
            "time to compile one distinct structured-output grammar (cache misses)",
            GRAMMAR_COMPILE_BUCKETS,
        )
        self.grammar_mask = self._histogram(
            "ember:structured_output_mask_seconds",
            "per step with constrained requests: filling and applying their grammar masks",
            MASK_BUCKETS,
        )

    def _define_compile_gauges(self) -> None:
        """The compiled decode path's state, read at scrape time (an idle server steps no more, yet its
        compile finishes); 0 until watch_compile points them at an engine."""
        self.compiling = self._gauge(
            "ember:executor_compiling",
            "1 while decode graphs compile in the background "
            "(--executor auto on CPU: steps run eagerly meanwhile), else 0",
        )
        self.compiling.set_function(lambda: 0.0)
        self.compiled_shapes = self._gauge(
            "ember:executor_compiled_shapes",
            "decode step shapes (batch size x "
            "query length, the MTP fill's included) that run compiled now: 0 = every "
            "step eager",
        )
        self.compiled_shapes.set_function(lambda: 0.0)
        self._define_expert_cache_gauges()

    def _define_expert_cache_gauges(self) -> None:
        """The hot-expert cache of experts kept in host memory (--cpu-moe / --n-cpu-moe, ember.layers.hot_experts),
        read at scrape time; 0 until watch_experts points them at an engine that has one."""
        gauge = self._gauge
        self.expert_cache = {
            "hit_rate": gauge(
                "ember:moe_hot_cache_hit_rate",
                "hot-expert cache hits / lookups since start (a lookup: one expert of a host MoE layer a step chose)",
            ),
            "hits": gauge("ember:moe_hot_cache_hits", "hot-expert cache lookups that found the expert on the device"),
            "misses": gauge("ember:moe_hot_cache_misses", "hot-expert cache lookups that ran the expert on the host"),
            "slots": gauge("ember:moe_hot_cache_slots", "experts the hot-expert cache holds on the device"),
        }
        for g in self.expert_cache.values():
            g.set_function(lambda: 0.0)

    @classmethod
    def for_engine(cls, model_name: str, engine) -> "ServerMetrics":
        """The metrics of a server over this LLMEngine (its length limit and KV pool in the labels)."""
        cache = engine.config.cache_config
        info = {
            "block_size": cache.block_size,
            "num_gpu_blocks": engine.parts.kv.num_blocks,
            "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": cache.enable_prefix_caching,
        }
        return cls(model_name, engine.parts.limits.max_model_len, info)

    def _spec_metrics(self) -> dict:
        if self._spec is None:

            def counter(name, doc, extra=()):
                c = self._counter(name, doc, extra)
                return c if extra else c.labels(**self._labels)

            self._spec = {
                "spec_num_drafts": counter(
                    "ember:spec_decode_num_drafts", "verify steps that carried draft tokens (per request)"
                ),
                "spec_num_draft_tokens": counter("ember:spec_decode_num_draft_tokens", "draft tokens verified"),
                "spec_num_accepted_tokens": counter("ember:spec_decode_num_accepted_tokens", "draft tokens accepted"),
                "spec_num_accepted_tokens_per_pos": counter(
                    "ember:spec_decode_num_accepted_tokens_per_pos",
                    "draft tokens accepted, by draft position (0 = first)",
                    ("position",),
                ),
                "spec_num_draft_tokens_per_pos": counter(
                    "ember:spec_decode_num_draft_tokens_per_pos",
                    "draft tokens verified, by draft position (0 = first)",
                    ("position",),
                ),
                "spec_draft_seconds": counter("ember:spec_decode_draft_seconds", "time spent proposing drafts"),
                "spec_verify_seconds": counter(
                    "ember:spec_decode_verify_seconds", "time of steps that verified drafts"
                ),
                "mean": self._gauge(
                    "ember:spec_decode_mean_accepted_length", "tokens emitted per verify step since start"
                ),
            }
        return self._spec

    def _on_spec(self, stats: dict, last: dict) -> None:
        m = self._spec_metrics()
        for key in (
            "spec_num_drafts",
            "spec_num_draft_tokens",
            "spec_num_accepted_tokens",
            "spec_draft_seconds",
            "spec_verify_seconds",
        ):
            m[key].inc(max(0, stats[key] - last.get(key, 0)))
        for key in ("spec_num_accepted_tokens_per_pos", "spec_num_draft_tokens_per_pos"):
            before = last.get(key) or [0] * len(stats[key])
            for pos, (now, was) in enumerate(zip(stats[key], before)):
                m[key].labels(**self._labels, position=str(pos)).inc(max(0, now - was))  # every position shows, 0 too
        m["mean"].set(stats["spec_mean_accepted_length"])

    def watch_compile(self, engine) -> None:
        """Report the engine's compiled path: whether its background compile runs, and how many decode
        shapes run compiled (read at scrape time)."""
        compiler = engine.parts.compiler
        if compiler is not None:
            self.compiling.set_function(lambda: 0.0 if compiler.done else 1.0)
        self.compiled_shapes.set_function(lambda: float(engine.compiled_shapes))

    def watch_experts(self, engine) -> None:
        """Report the engine's hot-expert cache, if it has one (read at scrape time)."""
        cache = getattr(engine.parts.loaded.placement, "hot_cache", None)
        if cache is None:
            return
        for key, g in self.expert_cache.items():
            g.set_function(lambda key=key: float(cache.stats()[key]))

    # -- the structured-output manager's listener (engine and grammar threads) ---------------------
    def observe_compile(self, seconds: float) -> None:
        self.grammar_compile.observe(seconds)

    def observe_mask(self, seconds: float) -> None:
        self.grammar_mask.observe(seconds)

    # -- StatsListener (called on the engine thread) --------------------------------------------
    def on_output_tokens(self, count: int, seconds: float) -> None:
        for _ in range(count):
            self.itl.observe(seconds / count)

    def on_step(self, stats: dict, num_new_tokens: int, step_seconds: float, num_prompt_tokens: int = 0) -> None:
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
        self.waiting_by_reason.set(stats["waiting"])
        if num_new_tokens or num_prompt_tokens:
            self.iteration_tokens.observe(num_new_tokens + num_prompt_tokens)
        total = stats["kv_blocks_total"]
        kv_usage = 1.0 - stats["kv_blocks_free"] / total if total else 0.0
        self.kv_usage.set(kv_usage)
        self.load = {
            "kv_cache_usage_perc": kv_usage,
            "num_requests_waiting": float(stats["waiting"]),
            "num_requests_running": float(stats["running"]),
        }
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
            self.request_prompt_tokens.observe(t.num_prompt_tokens)
            self.request_generation_tokens.observe(t.num_output_tokens)
            self.params_n.observe(t.n)
            if t.max_tokens is not None:
                self.params_max_tokens.observe(t.max_tokens)
            if t.scheduled is not None:
                self.queue_time.observe(t.scheduled - t.arrival)
                self.inference_time.observe(t.finished - t.scheduled)
                if t.first_token is not None:
                    self.prefill_time.observe(t.first_token - t.scheduled)
                    self.decode_time.observe(t.finished - t.first_token)

    # -- HTTP --------------------------------------------------------------------------------------
    def count_http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(**self._labels, endpoint=endpoint, status=str(status)).inc()

    def orca_header(self, fmt: str) -> bytes | None:
        """The `endpoint-load-metrics` value a load balancer asked for with `endpoint-load-metrics-format`
        (ORCA's TEXT or JSON form, vLLM's named metrics), or None for another format."""
        fmt = fmt.strip().upper()
        load = self.load
        if fmt == "TEXT":
            return ("TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in load.items())).encode()
        if fmt == "JSON":
            return ("JSON " + json.dumps({"named_metrics": load})).encode()
        return None

    def render(self) -> bytes:
        return generate_latest(self.registry)
