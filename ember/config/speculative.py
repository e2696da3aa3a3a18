"""SpeculativeConfig: every spelling of "speculate" (vLLM's JSON, its flags, --enable-mtp) as one value.

Spellings accepted, as vLLM and older launch guides write them:
  --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
  --speculative-model ngram --num-speculative-tokens 3
  --speculative-model DIR --num-speculative-tokens 3      (a draft model, or MTP layers: see below)
  --enable-mtp [--num-speculative-tokens k]                (the model's own MTP layers)
The default model (no model given) has no MTP layers of its own but a trained MTP head,
ember/assets/smollm2-mtp: when that is installed, the default model speculates with it
(k = DEFAULT_MTP_TOKENS, adaptive) unless --no-enable-mtp or another drafter is given.
A flag given next to the JSON must agree with it; a contradiction is refused, never resolved
silently. A model given without a method is a draft model (vLLM's rule) unless it is MTP
weights: a folder whose config.json `architectures` names an MTP class (`<Stem>MTP`, as
`ember train-mtp` writes, or another family's `...MTP...`), or the target model itself (a model
drafting for itself can only mean its own MTP layers); those get method "mtp". Whether a method
can run (a proposer is registered for it) is checked here too, so a bad command line fails
before the model loads.

The engine's proposers are registered by method in ember.spec.proposer.PROPOSERS, whose keys are
METHODS (tests/spec/test_spec_config.py holds them equal).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ember.config.aliases import speculative_method
from ember.errors import ConfigError

METHODS = ("ngram", "mtp", "draft")
MAX_SPEC_TOKENS = 8
# vLLM's defaults when neither bound is given (its own comment: "arbitrarily chosen").
DEFAULT_LOOKUP = 5
JSON_KEYS = (
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_tensor_parallel_size",
    "disable_by_batch_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # one of METHODS
    num_speculative_tokens: int | None  # k_max; None only for mtp (= its number of layers, resolved at load)
    model: str | None = None  # draft model / MTP folder; None = the target's own checkpoint (mtp)
    prompt_lookup_min: int | None = None  # ngram only
    prompt_lookup_max: int | None = None
    draft_tensor_parallel_size: int = 1
    adaptive: bool = True  # per-request k from recent acceptance (ember.spec.adaptive)
    # vLLM's knob: no drafts in a step with at least this many running requests (a big batch is
    # compute-bound, so verifying drafts costs more than it saves). None: always draft.
    disable_by_batch_size: int | None = None


def _method_alias(name: object) -> str:
    if not isinstance(name, str):
        raise ConfigError(f"speculative method {name!r} must be a string: one of {', '.join(METHODS)}")
    m = speculative_method(name)
    if m not in METHODS:
        raise ConfigError(f"speculative method {name!r} is not one of {', '.join(METHODS)}")
    return m


# The default model speculates with its head unless told not to (--no-enable-mtp): benchmarks/spec.md
# measured batch-1 decode 1.22x (temperature 0) and 1.20x (0.8) with k = 1 on held-out prompts.
DEFAULT_MODEL_MTP_BY_DEFAULT = True


def _default_mtp(cfg) -> str | None:
    """The default model's MTP head folder when it applies: no model given (the default model),
    the head installed, MTP asked for (or on by default) and no other drafter asked for."""
    if cfg.model is not None or cfg.enable_mtp is False:
        return None
    if cfg.enable_mtp is None and not DEFAULT_MODEL_MTP_BY_DEFAULT:
        return None
    other = (
        cfg.speculative_model is not None
        or (cfg.speculative_config or {}).get("method") not in (None, "mtp")
        or (cfg.speculative_config or {}).get("model") is not None
    )
    if other and not cfg.enable_mtp:
        return None
    from ember.default_model import default_mtp_path

    return default_mtp_path()


def is_mtp_folder(path: str, target: str | None = None) -> bool:
    """True when `path` holds MTP weights rather than a draft model: its config.json says an MTP
    architecture (`Qwen3MTP`, `LlamaMTP`, `DeepSeekMTPModel`, ...), or it is the target model's own
    folder. Only a local config.json is read (nothing is loaded)."""
    if not isinstance(path, str):
        return False
    folder = os.path.expanduser(path)
    if (
        target is not None
        and os.path.exists(folder)
        and os.path.realpath(folder) == os.path.realpath(os.path.expanduser(target))
    ):
        return True
    try:
        with open(os.path.join(folder, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(isinstance(a, str) and "MTP" in a for a in archs)


def _merge(merged: dict[str, Any], key: str, value: Any, flag: str) -> None:
    """Take a flag's value into the JSON's, refusing a disagreement."""
    if value is None:
        return
    have = merged.get(key)
    if have is not None and have != value:
        raise ConfigError(
            f"--speculative-config says {key}={have!r} but {flag} says {value!r}; give one of them, or make them agree"
        )
    merged[key] = value


def resolve_speculative_config(cfg) -> SpeculativeConfig | None:
    """The EngineConfig's speculative knobs as one SpeculativeConfig, or None when speculation is off."""
    raw = cfg.speculative_config
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, not {type(raw).__name__}")
    mtp_default = _default_mtp(cfg)
    merged = dict(raw or {})
    unknown = sorted(set(merged) - set(JSON_KEYS))
    if unknown:
        raise ConfigError(f"--speculative-config keys {unknown} are not known; ember reads {', '.join(JSON_KEYS)}")
    if merged.get("method") is not None:
        merged["method"] = _method_alias(merged["method"])

    model = cfg.speculative_model
    if model is not None and model.strip().lower() in ("ngram", "[ngram]"):
        if cfg.enable_mtp:
            raise ConfigError("--enable-mtp and --speculative-model ngram ask for two drafters; drop one of them")
        _merge(merged, "method", "ngram", "--speculative-model ngram")
    else:
        _merge(merged, "model", model, "--speculative-model")
    if cfg.enable_mtp:
        _merge(merged, "method", "mtp", "--enable-mtp")
    if mtp_default is not None and merged.get("model") is None and merged.get("method") in (None, "mtp"):
        # The default model has no MTP layers of its own; its trained head is a separate folder.
        merged["method"], merged["model"] = "mtp", mtp_default
        from ember.default_model import DEFAULT_MTP_DISABLE_BY_BATCH_SIZE, DEFAULT_MTP_TOKENS

        if merged.get("num_speculative_tokens") is None and cfg.num_speculative_tokens is None:
            merged["num_speculative_tokens"] = DEFAULT_MTP_TOKENS
        merged.setdefault("disable_by_batch_size", DEFAULT_MTP_DISABLE_BY_BATCH_SIZE)
    _merge(merged, "num_speculative_tokens", cfg.num_speculative_tokens, "--num-speculative-tokens")
    _merge(
        merged,
        "draft_tensor_parallel_size",
        cfg.speculative_draft_tensor_parallel_size,
        "--speculative-draft-tensor-parallel-size",
    )

    if merged.get("model") in ("ngram", "[ngram]"):  # vLLM's JSON spelling {"model": "[ngram]"}
        if merged.get("method") not in (None, "ngram"):
            raise ConfigError(f"speculative model 'ngram' contradicts method {merged['method']!r}; drop one")
        merged["method"], merged["model"] = "ngram", None
    method = merged.get("method")
    if method is None:
        if merged.get("model") is not None:
            # vLLM's rule: a model without a method is a draft model; MTP weights are not one.
            method = "mtp" if is_mtp_folder(merged["model"], cfg.model) else "draft"
        elif merged:
            given = ", ".join(f"{k}={v!r}" for k, v in merged.items())
            raise ConfigError(
                f"speculative decoding settings ({given}) were given without a drafter; add "
                '--speculative-model ngram|DIR, --enable-mtp, or a "method" in --speculative-config'
            )
        else:
            return None
    return _validate(method, merged, cfg)


def _validate(method: str, m: dict[str, Any], cfg) -> SpeculativeConfig:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    k = m.get("num_speculative_tokens")
    if k is None:
        need(
            method == "mtp",
            f"speculative method {method!r} needs the number of draft tokens; add "
            f"--num-speculative-tokens k (1..{MAX_SPEC_TOKENS})",
        )
    else:
        need(
            is_int(k) and 1 <= k <= MAX_SPEC_TOKENS,
            f"--num-speculative-tokens must be an integer in 1..{MAX_SPEC_TOKENS} (got {k!r})",
        )

    lo, hi = m.get("prompt_lookup_min"), m.get("prompt_lookup_max")
    if method == "ngram":
        need(
            m.get("model") is None,
            f"the ngram method has no model; drop --speculative-model {m.get('model')!r} or choose method 'draft'",
        )
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            need(v is None or (is_int(v) and v >= 1), f"{name} must be an integer >= 1 (got {v!r})")
        if lo is None and hi is None:
            lo = hi = DEFAULT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)  # one bound given: both are it
        need(lo <= hi, f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    else:
        need(lo is None and hi is None, f"prompt_lookup_min/max are for the ngram method, not {method!r}; drop them")
    if method == "draft":
        need(
            m.get("model") is not None,
            "the draft method needs a draft model; add --speculative-model DIR (a small model with the same tokenizer)",
        )
        need(
            os.path.exists(os.path.expanduser(str(m["model"]))),
            f"draft model {m['model']!r} not found; give --speculative-model a local Hugging Face folder or "
            ".gguf file of a small model with the target's tokenizer (ember never downloads weights)",
        )

    tp = cfg.tensor_parallel_size
    dtp = m.get("draft_tensor_parallel_size")
    dtp = 1 if dtp is None else dtp
    need(
        is_int(dtp) and dtp in (1, tp),
        f"--speculative-draft-tensor-parallel-size must be 1 or the --tensor-parallel-size ({tp}) (got {dtp!r})",
    )

    off_at = m.get("disable_by_batch_size")
    need(
        off_at is None or (is_int(off_at) and off_at >= 2),
        f"disable_by_batch_size must be an integer >= 2 (got {off_at!r}); leave it out to always draft",
    )

    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        model=m.get("model"),
        prompt_lookup_min=lo,
        prompt_lookup_max=hi,
        draft_tensor_parallel_size=dtp,
        adaptive=cfg.adaptive_spec,
        disable_by_batch_size=off_at,
    )
