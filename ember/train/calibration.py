"""Calibration text for `ember quantize`, and the held-out text perplexity is measured on.

`pydoc_split("calib")` / `pydoc_split("eval")`: CPython's offline help topics
(`pydoc_data.topics.topics`, 79 topics, ~465 KB), sorted by topic name, each text kept once
(two names, "else" and "if", share one text; the first name in sorted order keeps it). Of those
78 distinct texts the ones at odd positions (1, 3, 5, ...) calibrate (276 KB, 66K tokens for
SmolLM2: enough for AutoAWQ's default 128 x 512) and the ones at even positions (0, 2, 4, ...)
are held out for evaluation (188 KB). The two parts share no text, so a
perplexity on "eval" never sees what the quantizer looked at.
"""

from __future__ import annotations

import logging
import os

import torch

from ember.errors import ConfigError

log = logging.getLogger(__name__)


def pydoc_split(part: str) -> list[str]:
    """The calibration ("calib") or held-out ("eval") pydoc topics, in sorted topic-name order."""
    import pydoc_data.topics

    if part not in ("calib", "eval"):
        raise ValueError(f"part must be 'calib' or 'eval', not {part!r}")
    topics = pydoc_data.topics.topics
    texts = list(dict.fromkeys(topics[k] for k in sorted(topics)))  # distinct, in sorted-name order
    return texts[1 if part == "calib" else 0 :: 2]


def calibration_texts(source: str) -> list[str]:
    """`pydoc` -> the calibration half of the pydoc topics; otherwise a UTF-8 text file's contents."""
    if source == "pydoc":
        return pydoc_split("calib")
    if not os.path.isfile(source):
        raise ConfigError(f"--calib {source!r} is neither 'pydoc' nor a text file on this machine")
    try:
        with open(source, encoding="utf-8") as f:
            return [f.read()]
    except UnicodeDecodeError as e:
        raise ConfigError(f"--calib {source} is not UTF-8 text ({e})") from None


def calibration_blocks(tokenizer, texts: list[str], num_samples: int, seq_len: int) -> torch.Tensor:
    """Tokenize each text (no special tokens), concatenate, cut into blocks: int64 [n, seq_len].

    n = num_samples, or fewer (with a warning) when the text is too short for that many."""
    if num_samples < 1 or seq_len < 1:
        raise ConfigError(f"--num-samples and --seq-len must be positive (got {num_samples} and {seq_len})")
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= num_samples * seq_len:
            break
    n = min(num_samples, len(ids) // seq_len)
    if n == 0:
        raise ConfigError(f"the calibration text has {len(ids)} tokens, fewer than one block of --seq-len {seq_len}")
    if n < num_samples:
        log.warning(
            "calibration text has %d tokens: using %d blocks of %d tokens instead of %d",
            len(ids),
            n,
            seq_len,
            num_samples,
        )
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)
