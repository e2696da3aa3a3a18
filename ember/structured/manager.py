"""StructuredOutputManager: compiled grammars (cached), one matcher per request, the step's masks.

- `add_request(req, prompt_ids)`: builds the grammar now (a bad one raises GrammarError, a 400)
  and compiles it on a worker thread, once per distinct constraint (an LRU of compiled grammars),
  while the prompt is prefilled.
- `step_masks(out)`: for every request whose step samples (one row, or 1 + d verify rows) an
  xgrammar bitmask per row. Verify rows walk the matcher through the drafts (row j allows what
  may follow drafts 1..j) and roll it back; rows after a draft the grammar refuses stay open:
  that draft gets probability 0 and is rejected, so they are never used.
- `accept(req, token_id)` after each emitted token: advances the matcher; False when the grammar
  refuses it (only possible for a token sampled unmasked, see below).
- Reasoning (`--reasoning-parser`): a request whose output begins inside `<think>` is not
  constrained until `</think>` has been written (vLLM's rule); tokens emitted in the same step
  after it were sampled before the constraint started.

xgrammar (0.7 s to import: it pulls in transformers) and the TokenizerInfo (the vocabulary as
xgrammar reads it, ~0.4 s for 50k tokens) are loaded on the worker thread by `preload()`, which the
engine calls once start-up is done, or by the first structured request.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch

from ember.request import Request
from ember.structured.reasoning import END as REASONING_END
from ember.structured.reasoning import starts_in_reasoning

if TYPE_CHECKING:
    import xgrammar

    from ember.loader.tokenizer import Tokenizer

logger = logging.getLogger("ember")

# Compiled grammars kept for reuse; a JSON schema's is tens of kB to a few MB.
MAX_CACHED_GRAMMARS = 128
# Prompt tokens read back to see whether the chat template opened or closed a reasoning block.
PROMPT_TAIL_TOKENS = 64


class StructuredListener(Protocol):
    """Who hears how long grammars take (the server's metrics)."""

    def observe_compile(self, seconds: float) -> None: ...

    def observe_mask(self, seconds: float) -> None: ...


class GrammarState:
    """One request's constraint: its compiled grammar (a future until compiled) and matcher."""

    __slots__ = ("compiled", "matcher", "active", "scan_from")

    def __init__(self, compiled: Future, active: bool):
        self.compiled = compiled
        self.matcher: xgrammar.GrammarMatcher | None = None  # made at the first masked step
        self.active = active  # False while the output is still inside the reasoning
        self.scan_from = 0  # output text before this has no reasoning end tag

    def get_matcher(self):
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.compiled.result())
        return self.matcher


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int], reasoning_parser: str | None = None
    ):
        """stop_token_ids: what ends a finished grammar (the engine's EOS ids)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.reasoning_parser = reasoning_parser
        self.listener: StructuredListener | None = None  # the server's metrics
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ember-grammar")
        self._compiler: xgrammar.GrammarCompiler | None = None  # made on the worker thread
        self._cache: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, children: list[Request], prompt_ids: list[int]) -> None:
        """Give each of a request's sequences its matcher-to-be (they share the compiled grammar)."""
        params = children[0].sampling_params.structured_outputs
        if params is None:
            return
        compiled = self._compiled(params)
        active = True
        if self.reasoning_parser is not None:
            tail = self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            active = starts_in_reasoning(self.reasoning_parser, tail) is not True
        for req in children:
            req.grammar = GrammarState(compiled, active)

    def preload(self) -> None:
        """Import xgrammar and read the vocabulary on the worker thread, before any request needs them."""
        self._pool.submit(self._get_compiler)

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def holds(self, params) -> bool:
        """Whether this constraint was built before (so it is known to compile)."""
        with self._lock:
            return params.key() in self._cache

    def _compiled(self, params) -> Future:
        from ember.structured.grammar import build_grammar

        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        grammar = build_grammar(params)  # raises GrammarError for the client
        future = self._pool.submit(self._compile, grammar)
        with self._lock:
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return future

    def _compile(self, grammar):
        compiler = self._get_compiler()
        t0 = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        self.num_compiled += 1
        if self.listener is not None:
            self.listener.observe_compile(time.perf_counter() - t0)
        return compiled

    def shutdown(self) -> None:
        """End the compile thread (its queued grammars cancelled) and leave a fresh pool, which starts no thread
        until a grammar is submitted: an engine still used after its LLM wrapper was collected (whose finalizer
        shuts it down) keeps working."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ember-grammar")

    # -- the step -------------------------------------------------------------------------------
    def step_masks(self, out):
        """The bitmask rows of every constrained request that samples in this step (None: none)."""
        t0 = time.perf_counter()
        rows: dict[str, torch.Tensor] = {}
        for req, n in out.scheduled:
            state = req.grammar
            if state is None or not state.active:
                continue
            draft = out.drafts.get(req.request_id)
            d = len(draft) if draft is not None else 0
            if req.num_computed_tokens + n - d != req.num_tokens:
                continue  # a prefill chunk that samples nothing
            rows[req.request_id] = self._rows(state.get_matcher(), draft.token_ids if d else ())
        if not rows:
            return None
        from ember.structured.masks import StepMasks

        return StepMasks(rows, time.perf_counter() - t0)

    def _rows(self, matcher, drafts) -> torch.Tensor:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1 + len(drafts), self.vocab_size)  # all allowed
        matcher.fill_next_token_bitmask(bitmask, 0)
        walked = 0
        for j, tok in enumerate(drafts):
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
            walked += 1
            matcher.fill_next_token_bitmask(bitmask, j + 1)
        if walked:
            matcher.rollback(walked)
        return bitmask

    def step_done(self, masks) -> None:
        if masks is not None and self.listener is not None:
            self.listener.observe_mask(masks.seconds)

    def accept(self, req: Request, token_id: int) -> tuple[bool, bool]:
        """After req emitted token_id (and its text was detokenized): (accepted, grammar finished)."""
        state = req.grammar
        if not state.active:
            text = req.detokenizer.output_text
            at = text.find(REASONING_END, state.scan_from)
            if at == -1:
                state.scan_from = max(0, len(text) - len(REASONING_END) + 1)
            else:
                state.active = True  # the answer starts with the next token
            return True, False
        matcher = state.get_matcher()
        if not matcher.accept_token(token_id):
            return False, False
        return True, matcher.is_terminated()


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """The vocabulary as xgrammar reads it, from ember's tokenizer (a `tokenizers.Tokenizer`
    inside, from a HF folder or a GGUF file): the byte-level / byte-fallback decoding is detected
    from it by xgrammar's own Hugging Face reader."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf_tokenizer)
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
