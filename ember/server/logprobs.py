"""Logprobs in OpenAI's two shapes.

Chat (current spec): `choices[].logprobs.content = [{token, logprob, bytes, top_logprobs: [...]}]`,
one entry per generated token, top_logprobs holding the `top_logprobs` most likely tokens
(an empty list when 0 were asked for).
Completions (legacy spec): `choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`.

A token's `bytes` are its real UTF-8 bytes, also for byte-level BPE pieces that are only part
of a character (whose decoded text alone would be U+FFFD).
"""

from __future__ import annotations

import functools
import math
import re

from ember.outputs import PositionLogprobs


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """Token id -> (text shown, UTF-8 bytes), cached. as_ids: the text shown is `token_id:N` (vLLM's
    return_tokens_as_token_ids, for clients that must not lose a token to decoding); the bytes stay real."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self._tok = tokenizer
        self._as_ids = as_ids
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int, decoded: str | None = None) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if self._as_ids:
            hit = (f"token_id:{token_id}", TokenText(self._tok)(token_id, decoded)[1])
            self._cache[token_id] = hit
            return hit
        text = decoded if decoded is not None else self._tok.decode([token_id], skip_special_tokens=False)
        raw = text.encode("utf-8")
        if "\ufffd" in text:
            piece = self._tok.id_to_token(token_id) or ""
            table = _byte_level_table()
            m = _BYTE_FALLBACK.fullmatch(piece)
            if m:
                raw = bytes([int(m.group(1), 16)])
            elif piece and all(c in table for c in piece):
                raw = bytes(table[c] for c in piece)
        hit = (text, list(raw))
        self._cache[token_id] = hit
        return hit


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI uses -9999.0 for "impossible"
    return x if math.isfinite(x) else -9999.0


def _top(position: PositionLogprobs, n: int) -> list[tuple[int, float]]:
    if n <= 0:
        return []
    items = sorted(position.items(), key=lambda kv: (-kv[1].logprob, kv[1].rank))
    return [(tid, lp.logprob) for tid, lp in items[:n]]


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top_n: int, text: TokenText) -> list[dict]:
    out = []
    for tid, pos in zip(token_ids, positions):
        tok, raw = text(tid, pos[tid].decoded_token)
        out.append(
            {
                "token": tok,
                "logprob": _finite(pos[tid].logprob),
                "bytes": raw,
                "top_logprobs": [
                    {"token": t, "logprob": _finite(lp), "bytes": b}
                    for t, b, lp in ((*text(i, pos[i].decoded_token), lp) for i, lp in _top(pos, top_n))
                ],
            }
        )
    return out


class CompletionLogprobs:
    """Accumulates the legacy completions logprobs object (also chunk by chunk, for streaming)."""

    def __init__(self, top_n: int, text: TokenText, offset: int = 0):
        self.top_n = top_n
        self._text = text
        self.offset = offset  # text_offset of the next token

    def build(self, token_ids: list[int], positions: list[PositionLogprobs | None] | None) -> dict:
        """positions[i] None (an echoed prompt's first token): listed with null logprob and top."""
        tokens, token_lps, tops, offsets = [], [], [], []
        positions = positions if positions is not None else [None] * len(token_ids)
        for tid, pos in zip(token_ids, positions):
            if pos is None:
                tok, _ = self._text(tid)
                tokens.append(tok)
                token_lps.append(None)
                tops.append(None)
                offsets.append(self.offset)
                self.offset += len(tok)
                continue
            tok, _ = self._text(tid, pos[tid].decoded_token)
            tokens.append(tok)
            token_lps.append(_finite(pos[tid].logprob))
            # the sampled (or echoed prompt) token first, always listed (OpenAI), then the top n (vLLM's order)
            top = {tok: _finite(pos[tid].logprob)}
            for i, lp in _top(pos, self.top_n):
                top.setdefault(self._text(i, pos[i].decoded_token)[0], _finite(lp))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
