"""AsyncLLMEngine: the LLMEngine on one background thread, each request streaming through its own queue.

Threads: the engine thread owns the LLMEngine and is the only one that calls it (add, abort,
step), so the engine needs no locks. The asyncio side talks to it through a command queue
(`queue.SimpleQueue`, thread-safe) and gets results back with `loop.call_soon_threadsafe`,
once per step for all requests together. torch releases the GIL inside its kernels, so the
event loop stays responsive while a step runs.

What a stream yields per step is a `RequestDelta`: for each of the request's sequences that
moved, the new text (from IncrementalDetokenizer.get_delta, which holds back text that could
still become a stop string), the new token ids and their logprobs. Deltas are computed on the
engine thread, where the detokenizers live.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ember.errors import ConfigError, EmberError, EngineDeadError, ServerOverloadedError
from ember.outputs import PositionLogprobs
from ember.request import Request
from ember.sampling import SamplingParams

if TYPE_CHECKING:  # the engine pulls in torch; `ember --help` should not
    from ember.engine.engine import LLMEngine, PromptType
    from ember.structured.manager import StructuredOutputManager

logger = logging.getLogger("ember.async_engine")

DEFAULT_MAX_WAITING_REQUESTS = 256


@dataclass
class SeqDelta:
    """What one sequence (one choice) produced since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # set once, on the sequence's last delta
    stop_reason: int | str | None = None


@dataclass
class RequestDelta:
    request_id: str
    seqs: list[SeqDelta]
    finished: bool  # every sequence of the request has finished
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: on the first delta after the prompt was computed, else None
    prompt_logprobs: list | None = None


@dataclass
class RequestTiming:
    """Monotonic times of one request, for metrics and logs."""

    arrival: float
    scheduled: float | None = None  # when the scheduler first took it (queue time ends); set at the finish
    first_token: float | None = None
    last_token: float | None = None  # for the time between output tokens
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # over all sequences
    max_seq_tokens: int = 0  # longest sequence, for time per output token
    finish_reason: str | None = None
    n: int = 1  # the request's parameters, for vLLM's request_params_* metrics
    max_tokens: int | None = None


class StatsListener(Protocol):
    """What the engine thread reports (the server's metrics implement it)."""

    def on_step(self, stats: dict, num_new_tokens: int, step_seconds: float, num_prompt_tokens: int = 0) -> None:
        """After a step: num_prompt_tokens = the prompts whose first token came in it (vLLM's iteration tokens)."""

    def on_output_tokens(self, count: int, seconds: float) -> None:
        """`count` tokens of one sequence arrived `seconds` after its previous ones (not its first token)."""

    def on_request_finished(self, timing: RequestTiming) -> None: ...


@dataclass
class _Tracked:
    """Engine-thread state of one request: its sequences and how much of each was handed out."""

    children: list[Request]
    timing: RequestTiming
    sent_tokens: list[int] = field(default_factory=list)
    reported: list[bool] = field(default_factory=list)
    prompt_logprobs_sent: bool = False


class RequestStream:
    """The async iterator of one request's RequestDeltas. Closing it early aborts the request."""

    def __init__(self, owner: AsyncLLMEngine, request_id: str):
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop generating (client gone, handler error): frees the request's KV blocks. Idempotent."""
        if not self.finished:
            self.finished = True
            self._owner._abort(self.request_id)

    def _put(self, item: RequestDelta | BaseException) -> None:
        self._queue.put_nowait(item)


# Commands from any thread to the engine thread, dispatched by type (AsyncLLMEngine._handle).
@dataclass
class AddCommand:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    timing: RequestTiming
    ack: asyncio.Future  # resolved in the loop: None when accepted, else the engine's error


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class AbortAllCommand:
    """End every request in flight with its text so far (a shutdown's timeout ran out)."""


@dataclass
class StopCommand:
    """End the engine thread (shutdown)."""


CPU_WARMUP_TOKENS = 512  # the long warmup step's prompt on CPU (see AsyncLLMEngine.warmup)


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
        warmup: bool = True,
        stats: StatsListener | None = None,
        executor=None,
    ):
        if max_waiting_requests < 1:
            raise ConfigError(f"--max-waiting-requests must be >= 1 (got {max_waiting_requests})")
        self.engine = engine
        self.tokenizer = engine.parts.loaded.tokenizer
        self.max_model_len = engine.parts.limits.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.do_warmup = warmup
        self.stats_listener = stats
        self.warmup_seconds: float | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._step_prompt_tokens = 0
        # A one-worker executor whose thread built the engine: steps must run on that thread
        # (torch's CPU thread pool belongs to it; a second pool from another thread fights it
        # for the cores: measured ~25% slower steps on 2 cores). None = start a thread here.
        self._executor = executor
        self._thread: threading.Thread | None = None
        self._future = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._pending_adds = 0  # loop thread only: submitted, not yet acknowledged by the engine thread
        self._ready = threading.Event()
        self._stopped = False
        # Published by the engine thread after each step (plain int reads are atomic).
        self.num_waiting = 0
        self.num_running = 0

    # -- what the server reads of the engine it drives ----------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.engine.parts.loaded.model_config.vocab_size

    @property
    def max_logprobs(self) -> int:
        """--max-logprobs: the most logprobs a request may ask for per token (-1: no cap)."""
        return self.engine.config.max_logprobs

    @property
    def reasoning_parser(self) -> str | None:
        return self.engine.config.reasoning_parser

    @property
    def structured(self) -> StructuredOutputManager:
        """The engine's grammars: which are built (holds), and who hears of each compile (listener)."""
        return self.engine.structured

    @property
    def executor_state(self) -> str:
        """What decode steps run: eager, compiled, or compiling (eager meanwhile)."""
        return self.engine.executor_state

    # -- life cycle ---------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread (warmup first, unless disabled); call from the serving loop."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        if self._executor is not None:
            self._future = self._executor.submit(self._run)
            self._thread = threading.current_thread()  # marks "started"; joined through the future
            return
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (its requests are aborted); open streams end with EngineDeadError.
        Call from the serving loop's thread."""
        self._stopped = True
        if self._thread is not None:
            self._commands.put(StopCommand())
            if self._future is not None:
                try:
                    self._future.result(timeout)
                except Exception:  # noqa: BLE001 -- shutting down; the engine thread logged it
                    pass
                self._future = None
            else:
                self._thread.join(timeout)
            self._thread = None
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(EngineDeadError("the server is shutting down"))

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and not self._stopped

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    # -- the asyncio side ---------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival: float | None = None
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine thread accepted it.

        Raises ServerOverloadedError when max_waiting_requests are already waiting, and the
        engine's own errors (InvalidRequestError, PromptTooLongError) for a bad request."""
        if self._stopped or self._thread is None:
            raise EngineDeadError("the engine is shut down")
        if request_id in self._streams:
            raise EmberError(f"request id {request_id!r} is already in use")
        waiting = self.num_waiting + self._pending_adds
        if waiting >= self.max_waiting_requests:
            raise ServerOverloadedError(
                f"the server is overloaded: {waiting} requests are already waiting for a slot "
                f"(--max-waiting-requests {self.max_waiting_requests}); retry later"
            )
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        ack: asyncio.Future = self._loop.create_future()
        timing = RequestTiming(arrival=time.monotonic() if arrival is None else arrival)
        self._pending_adds += 1
        self._commands.put(AddCommand(request_id, prompt, params, timing, ack))
        try:
            await ack
        except asyncio.CancelledError:
            stream.abort()  # the add is queued before the abort, so the engine sees both in order
            self._streams.pop(request_id, None)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._pending_adds -= 1
        return stream

    def abort_all(self) -> None:
        """Abort every request in flight (a server's shutdown timeout ran out): each stream ends with its
        text so far and finish_reason "abort". Any thread."""
        self._commands.put(AbortAllCommand())

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(AbortCommand(request_id))

    def _deliver(self, batch: list[tuple[str, RequestDelta | BaseException]]) -> None:
        """Loop thread: hand one step's deltas to their streams."""
        for rid, item in batch:
            stream = self._streams.get(rid)
            if stream is None:
                continue  # aborted meanwhile
            if isinstance(item, BaseException) or item.finished:
                del self._streams[rid]
            stream._put(item)

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is going away
            pass

    @staticmethod
    def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        if self.do_warmup:
            try:
                self.warmup_seconds = self.warmup()
            except Exception:
                logger.exception("warmup failed; serving anyway")
        self.engine.start_compile()  # a background compile deferred until the warmup is done
        self._ready.set()
        self._baseline = self.engine.stats()
        if self.stats_listener is not None:
            self.stats_listener.on_step(self._baseline, 0, 0.0)
        engine = self.engine
        while True:
            # Block for work only when there is nothing to step.
            if not engine.has_unfinished_requests():
                cmd = self._commands.get()
                if not self._handle(cmd):
                    break
            alive = True
            while alive:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                alive = self._handle(cmd)
            if not alive:
                break
            if engine.has_unfinished_requests():
                self._step()
        for rid in list(self._tracked):
            self.engine.abort_request(rid)
        self._tracked.clear()

    def _handle(self, cmd: AddCommand | AbortCommand | AbortAllCommand | StopCommand) -> bool:
        """Run one command on the engine thread; False ends the thread."""
        if isinstance(cmd, StopCommand):
            return False
        if isinstance(cmd, AddCommand):
            self._add(cmd)
        elif isinstance(cmd, AbortCommand):
            self._abort_one(cmd.request_id)
        elif isinstance(cmd, AbortAllCommand):
            self._abort_every()
        return True

    def _add(self, cmd: AddCommand) -> None:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except Exception as e:  # noqa: BLE001 -- handed to the caller, who answers the client
            self._call_in_loop(self._resolve, cmd.ack, e)
            return
        children = list(self.engine.parents[cmd.request_id].children)
        timing = cmd.timing
        timing.num_prompt_tokens = children[0].num_prompt_tokens
        timing.n, timing.max_tokens = cmd.params.n, cmd.params.max_tokens
        self._tracked[cmd.request_id] = _Tracked(children, timing, [0] * len(children), [False] * len(children))
        self.num_waiting = len(self.engine.parts.scheduler.waiting)
        self._call_in_loop(self._resolve, cmd.ack, None)

    def _abort_every(self) -> None:
        now, batch = time.monotonic(), []
        for rid, tracked in list(self._tracked.items()):
            self.engine.abort_request(rid)
            delta, _ = self._delta(rid, tracked, True, 0, now)
            batch.append((rid, delta))
        if batch:
            self._publish(0, 0.0)
            self._call_in_loop(self._deliver, batch)

    def _abort_one(self, rid: str) -> None:
        tracked = self._tracked.pop(rid, None)
        if tracked is None:
            return
        self.engine.abort_request(rid)
        logger.info(
            "request %s aborted before it finished (%d tokens generated); its KV blocks are freed",
            rid,
            tracked.timing.num_output_tokens,
        )
        tracked.timing.finished = time.monotonic()
        tracked.timing.finish_reason = "abort"
        if self.stats_listener is not None:
            self.stats_listener.on_request_finished(tracked.timing)
        self._publish(0, 0.0)

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 -- a bug in a step must not take the server down
            logger.exception("engine step failed; failing the %d requests in flight", len(self._tracked))
            batch = []
            for rid in list(self._tracked):
                self.engine.abort_request(rid)
                batch.append((rid, RuntimeError(f"engine step failed: {type(e).__name__}")))
            self._tracked.clear()
            self._call_in_loop(self._deliver, batch)
            return
        now = time.monotonic()
        batch: list[tuple[str, RequestDelta]] = []
        new_tokens = 0
        self._step_prompt_tokens = 0
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            delta, n = self._delta(out.request_id, tracked, out.finished, out.num_cached_tokens, now)
            new_tokens += n
            if delta is not None:
                batch.append((out.request_id, delta))
        # stats first: a client that has its last token may read /metrics at once, and must find this step in it
        self._publish(new_tokens, now - t0, self._step_prompt_tokens)
        if batch:
            self._call_in_loop(self._deliver, batch)

    def _delta(self, rid: str, tracked: _Tracked, finished: bool, cached: int, now: float):
        seqs: list[SeqDelta] = []
        new_tokens = seqs_with_tokens = 0
        timing = tracked.timing
        for i, req in enumerate(tracked.children):
            if tracked.reported[i]:
                continue
            done = req.is_finished
            ids = req.token_ids
            start = req.num_prompt_tokens + tracked.sent_tokens[i]
            new_ids = ids[start:]
            text = req.detokenizer.get_delta(done)
            if not new_ids and not text and not done:
                continue
            lps = None
            if req.logprobs is not None:
                lps = req.logprobs[tracked.sent_tokens[i] :]
            tracked.sent_tokens[i] += len(new_ids)
            new_tokens += len(new_ids)
            seqs_with_tokens += bool(new_ids)
            if done:
                tracked.reported[i] = True
            seqs.append(
                SeqDelta(
                    req.index,
                    text,
                    new_ids,
                    lps,
                    req.finish_reason if done else None,
                    req.stop_reason if done else None,
                )
            )
        if new_tokens:
            if timing.first_token is None:
                timing.first_token = now
                self._step_prompt_tokens += timing.num_prompt_tokens
                after_first = new_tokens - seqs_with_tokens  # each sequence's first token has no interval before it
            else:
                after_first = new_tokens
            if after_first > 0 and self.stats_listener is not None:
                self.stats_listener.on_output_tokens(after_first, now - (timing.last_token or now))
            timing.last_token = now
        timing.num_output_tokens += new_tokens
        if finished:
            self._tracked.pop(rid, None)
            timing.finished = now
            timing.scheduled = tracked.children[0].first_scheduled_time
            timing.max_seq_tokens = max(tracked.sent_tokens)
            reasons = [r.finish_reason for r in tracked.children]
            timing.finish_reason = reasons[0] if len(set(reasons)) == 1 else ",".join(reasons)
            if self.stats_listener is not None:
                self.stats_listener.on_request_finished(timing)
        prompt_lps = None
        first = tracked.children[0]
        if (
            first.prompt_logprobs is not None
            and not tracked.prompt_logprobs_sent
            and (len(first.prompt_logprobs) == first.num_prompt_tokens or finished)
        ):
            prompt_lps, tracked.prompt_logprobs_sent = first.decoded_prompt_logprobs(), True
        if not seqs and not finished and prompt_lps is None:
            return None, new_tokens
        return RequestDelta(rid, seqs, finished, timing.num_prompt_tokens, cached, prompt_lps), new_tokens

    def _publish(self, new_tokens: int, step_seconds: float, prompt_tokens: int = 0) -> None:
        sched = self.engine.parts.scheduler
        self.num_waiting = len(sched.waiting)
        self.num_running = len(sched.running)
        if self.stats_listener is not None:
            self.stats_listener.on_step(self.engine.stats(), new_tokens, step_seconds, prompt_tokens)

    # -- warmup -------------------------------------------------------------------------------
    def warmup(self) -> float:
        """A short request, then one step at the full token budget, so the first user is not slow
        (lazy allocations, kernel selection, compiled shapes). Runs on the engine thread."""
        engine = self.engine
        t0 = time.monotonic()
        ids = _warmup_token_ids(engine, 64)
        self._run_to_end(
            "ember-warmup-short",
            ids[:16],
            SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, ignore_eos=True, logprobs=1),
        )
        limits = engine.parts.limits
        n = max(1, min(limits.max_num_batched_tokens, limits.max_model_len - 1))
        if engine.parts.setup.device.type == "cpu":
            # A CPU has no memory pool to reserve up front, and every kernel path a long prompt takes runs
            # from 16 rows on: 512 tokens warm them. The full 2048-token step cost ~6 s of a ~14 s start
            # on Zen3 (float32), before /health could answer.
            n = min(n, CPU_WARMUP_TOKENS)
        self._run_to_end(
            "ember-warmup-full",
            _warmup_token_ids(engine, n, offset=7),
            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        )
        seconds = time.monotonic() - t0
        logger.info("warmup: a 16-token request and a %d-token step in %.2fs; ready", n, seconds)
        return seconds

    def _run_to_end(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        engine = self.engine
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        try:
            while rid in engine.parents:
                engine.step()
        finally:
            engine.abort_request(rid)


def _warmup_token_ids(engine: LLMEngine, n: int, offset: int = 0) -> list[int]:
    """n ordinary (non-special) token ids, deterministic."""
    special = set(engine.parts.loaded.tokenizer.all_special_ids)
    vocab = min(engine.parts.loaded.model_config.vocab_size, engine.parts.loaded.tokenizer.vocab_size)
    ids: list[int] = []
    t = 1000 + offset
    while len(ids) < n:
        t = (t * 1103515245 + 12345) % (2**31)
        tok = t % vocab
        if tok not in special:
            ids.append(tok)
    return ids
