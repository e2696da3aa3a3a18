"""Incremental detokenization of one sequence, with stop strings and safe streaming deltas.

Text grows through the tokenizer's decode stream, which only emits whole UTF-8 characters.
After each update only the tail that can hold a newly completed stop string is searched, so
the cost per step is bounded by the stop strings' length, not the output's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ember.sampling import SamplingParams

if TYPE_CHECKING:
    from ember.loader.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self._tokenizer = tokenizer
        self._stream = tokenizer.decode_stream(skip_special_tokens=params.skip_special_tokens)
        self._stops = list(params.stop or ())
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._text = ""
        self._sent = 0  # characters already handed out by get_delta
        self._stopped = False  # a stop string matched: the text is final
        self._token_text: dict[int, str] = {}
        self._skip_special = params.skip_special_tokens
        self._pending: list[int] = []  # ids whose bytes end inside a character: no text yet

    @property
    def output_text(self) -> str:
        return self._text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append the text of new tokens; return the stop string that ended the text, if any.

        On a match the text is cut at the match start (or just after the stop string with
        include_stop_str_in_output) and later updates are ignored.
        """
        if self._stopped:
            return None
        start = len(self._text)
        for t in new_token_ids:
            piece = self._stream.step(t)
            if piece:
                self._text += piece
                self._pending.clear()
            else:
                self._pending.append(t)
        if not self._stops or len(self._text) == start:
            return None
        return self._find_stop(start)

    def _find_stop(self, new_from: int) -> str | None:
        # A new match ends inside the new text, so it starts at most max_stop - 1 chars before.
        region = max(0, new_from - self._max_stop + 1)
        best_at, best = -1, None
        for s in self._stops:
            at = self._text.find(s, region)
            if at != -1 and (best is None or at < best_at):
                best_at, best = at, s
        if best is None:
            return None
        end = best_at + len(best) if self._include_stop else best_at
        self._text = self._text[:end]
        self._stopped = True
        return best

    def finish(self) -> None:
        """The sequence ended: bytes still waiting for the rest of a character become U+FFFD, as a full
        decode shows them, so the text always accounts for every token (text == decode(token_ids))."""
        if self._pending and not self._stopped:
            self._text += self._tokenizer.decode(self._pending, skip_special_tokens=self._skip_special)
        self._pending.clear()

    def get_delta(self, finished: bool) -> str:
        """Text not returned before. While running, a tail that could still grow into a stop
        string is held back, so a client never sees text that a later stop cuts."""
        end = len(self._text)
        if not (finished or self._stopped):
            end -= self._held_back()
        if end <= self._sent:
            return ""
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._text
        longest = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def decoded_token(self, token_id: int) -> str:
        """One token's own text, for Logprob.decoded_token (special tokens shown)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text
