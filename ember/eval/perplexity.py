"""Perplexity of a token stream under a loaded engine, through the engine's own forward path.

The text is cut into non-overlapping windows of `window` tokens; each window is run as one
sequence in prefill chunks of `chunk` tokens through the engine's paged KV pool and attention
backend, so quantized weights, packed kernels and an FP8 KV cache (later chunks read the
earlier ones from the cache) all count. Every token of a window after its first is scored
against the logits of the token before it; perplexity = exp(mean negative log-likelihood).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.engine.scheduler import SchedulerOutput
from ember.errors import ConfigError
from ember.request import Request


@dataclass
class Perplexity:
    perplexity: float
    mean_nll: float
    scored_tokens: int
    windows: int


@torch.inference_mode()
def window_nll(engine, token_ids: list[int], chunk: int) -> tuple[float, int]:
    """(sum of NLL, number of scored tokens) for one sequence, prefilled chunk by chunk."""
    req = Request("perplexity", token_ids, sampling_params=None)
    runner, kv = engine.parts.runner, engine.parts.kv
    if not kv.allocate_slots(req, len(token_ids)):
        raise ConfigError(
            f"the KV cache cannot hold a {len(token_ids)}-token window; lower the window or raise --kv-cache-memory"
        )
    total, scored = 0.0, 0
    try:
        while req.num_computed_tokens < len(token_ids):
            n = min(chunk, len(token_ids) - req.num_computed_tokens)
            start = req.num_computed_tokens
            batch = runner.prepare(SchedulerOutput(scheduled=[(req, n)]))
            hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)
            # Row i predicts token start + i + 1; the window's last row has nothing to predict.
            targets = torch.tensor(token_ids[start + 1 : start + n + 1], dtype=torch.long, device=hidden.device)
            if len(targets):
                logits = runner.model.compute_logits(hidden[: len(targets)])
                total += F.cross_entropy(logits.float(), targets, reduction="sum").item()
                scored += len(targets)
            req.num_computed_tokens += n
    finally:
        kv.free(req)
    return total, scored


def perplexity(engine, token_ids: list[int], window: int = 512, chunk: int = 256) -> Perplexity:
    """Perplexity over consecutive windows of `token_ids` (a trailing window shorter than 2 is dropped)."""
    if engine.has_unfinished_requests():
        raise ConfigError("perplexity needs an idle engine (it borrows the KV pool)")
    total, scored, windows = 0.0, 0, 0
    for s in range(0, len(token_ids), window):
        part = token_ids[s : s + window]
        if len(part) < 2:
            break
        nll, n = window_nll(engine, part, chunk)
        total, scored, windows = total + nll, scored + n, windows + 1
    if not scored:
        raise ConfigError("no tokens to score: the evaluation text is empty")
    mean = total / scored
    return Perplexity(math.exp(mean), mean, scored, windows)
