"""The sampling a request gets for the fields it leaves unset: vLLM's --generation-config and
--override-generation-config.

Model makers publish the sampling their model is meant to run with in its generation_config.json (Qwen3.5:
temperature 0.6 or 1.0, top_p 0.95, top_k 20), and agent clients send none of these fields (Claude Code,
Codex): without the file's values every such answer samples at temperature 1 over the whole vocabulary.

- `auto` (the default, as vLLM's): the model folder's generation_config.json, when it has one (a GGUF file
  has none);
- `vllm`: no model defaults: temperature 1, no top-p, top-k or min-p cut (vLLM's name for its own);
- a folder: that folder's generation_config.json (it must have one).

`--override-generation-config` (a JSON object) goes over either, e.g. '{"temperature": 0}' serves greedily
unless a request asks otherwise. A request's own value always wins. `max_new_tokens` is the default
max_tokens (still capped by what the context has left).
"""

from __future__ import annotations

import json
import os
from typing import Any

from ember.errors import ConfigError, InvalidRequestError
from ember.sampling import SamplingParams

# the generation_config.json fields that are request defaults (as vLLM reads them); others (token ids,
# do_sample, transformers' bookkeeping) are not sampling a server applies
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FIELDS = (*SAMPLING_FIELDS, "max_new_tokens")
AUTO, NONE = "auto", "vllm"
FILE = "generation_config.json"


def load_sampling_defaults(choice: str, model_path: str, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The defaults: `choice`'s (read from model_path's folder for auto), `override` (from parse_override)
    over them. A bad source or a value SamplingParams refuses is a ConfigError at start that says what to
    change, never a 400 on every request later."""
    defaults = _from_source(choice, model_path)
    _check(defaults, f"--generation-config {choice} ({FILE})")
    return {**defaults, **(override or {})}


def parse_override(text: str | None) -> dict[str, Any] | None:
    """--override-generation-config's JSON object, checked (known fields, values in range)."""
    if not text:
        return None
    example = "e.g. '{\"temperature\": 0}'"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--override-generation-config must be a JSON object, {example}: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--override-generation-config must be a JSON object, {example}")
    for name in value:
        if name not in FIELDS:
            raise ConfigError(
                f"--override-generation-config: {name!r} is not a sampling default ember applies; use {', '.join(FIELDS)}"
            )
    _check(value, "--override-generation-config")
    return value


def _from_source(choice: str, model_path: str) -> dict[str, Any]:
    if choice == NONE:
        return {}
    if choice == AUTO:
        folder = model_path if os.path.isdir(model_path) else None
        if folder is None or not os.path.exists(os.path.join(folder, FILE)):
            return {}
    else:
        folder = choice
        if not os.path.isfile(os.path.join(folder, FILE)):
            raise ConfigError(
                f"--generation-config {choice!r}: no {FILE} there; give a folder that has one, "
                f"{AUTO} (the model's own) or {NONE} (no model defaults)"
            )
    path = os.path.join(folder, FILE)
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not readable as JSON ({e}); fix it, or pass --generation-config {NONE}")
    return {name: config[name] for name in FIELDS if config.get(name) is not None}


def _check(defaults: dict[str, Any], where: str) -> None:
    tokens = defaults.get("max_new_tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
        raise ConfigError(f"{where}: max_new_tokens must be a positive integer, not {tokens!r}")
    try:
        SamplingParams(**{k: v for k, v in defaults.items() if k in SAMPLING_FIELDS})
    except (InvalidRequestError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
