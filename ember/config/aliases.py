"""Every other engine's spelling ember accepts, in one place: flag names (each with a note), and the
values of ember's own flags.

People copy launch lines from SGLang (`python -m sglang.launch_server --model-path ... --context-length
...`), older vLLM and the guides our users follow (`--mtp-num`, `--multi-token-prediction`,
`--decode-kernel flash2`). Each flag alias below sets ember's own flag (vLLM's name) and leaves a
one-line note naming it; a value ember cannot honour (EAGLE drafting, tree drafts) is refused with what
to use instead. Value spellings of ember's own flags (`--speculative-model mtp`, `--attention-backend
flash2`, `--quantization awq_marlin`, `--dtype half`, a speculative method `deepseek_mtp`) are the
*_ALIASES tables; EngineConfig and the speculative config map them where they read the flag.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

# -- values of ember's own flags ------------------------------------------------------------------

# vLLM's other names of dtypes
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# vLLM's kernel-specific quantization names -> the weight format ember loads
QUANTIZATION_ALIASES = {"awq_marlin": "awq"}
# other engines' attention backend names -> ember's: "gpu" = its GPU kernels (triton) on CUDA, the cpu
# backend on CPU. flash2: an older guide's name for a split-KV decode kernel; flashinfer / fa3: SGLang's and
# vLLM's GPU backends (ember.config.attention resolves "gpu" and logs the note)
ATTENTION_BACKEND_ALIASES = {
    "flash2": "gpu",
    "flashinfer": "gpu",
    "fa3": "gpu",
    "flash_attn": "gpu",
    "torch_native": "torch",
}
# --speculative-model values that mean "the model's own MTP layers" (older vLLM and older guides)
SPEC_MODEL_MTP = ("mtp", "[mtp]", "deepseek_mtp", "qwen3_next_mtp", "qwen3_5_mtp")
# speculative_config["method"] spellings -> ember's method; vLLM's older per-family MTP names
# (deepseek_mtp, qwen3_next_mtp, mimo_mtp, ...) all end in SPEC_METHOD_MTP_SUFFIX
SPEC_METHOD_ALIASES = {"[ngram]": "ngram", "draft_model": "draft"}
SPEC_METHOD_MTP_SUFFIX = "_mtp"


def speculative_method(name: str) -> str:
    """A speculative method as ember names it (unknown names come back as given, lowercased)."""
    m = name.strip().lower()
    if m.endswith(SPEC_METHOD_MTP_SUFFIX):
        return "mtp"
    return SPEC_METHOD_ALIASES.get(m, m)


# -- flags ------------------------------------------------------------------------------------------

# alias -> (ember's flag as its EngineConfig field, whose name it is)
RENAMED = {
    "--model-path": ("model", "SGLang"),
    "--tokenizer-path": ("tokenizer", "SGLang"),
    "--context-length": ("max_model_len", "SGLang"),
    "--tp": ("tensor_parallel_size", "SGLang"),
    "--tp-size": ("tensor_parallel_size", "SGLang"),
    "--mem-fraction-static": ("gpu_memory_utilization", "SGLang"),
    "--max-running-requests": ("max_num_seqs", "SGLang"),
    "--chunked-prefill-size": ("max_num_batched_tokens", "SGLang"),
    "--random-seed": ("seed", "SGLang"),
    "--speculative-draft-model-path": ("speculative_model", "SGLang"),
    "--speculative-num-steps": ("num_speculative_tokens", "SGLang"),
    "--decode-kernel": ("attention_backend", "an older guide"),
    "-ncmoe": ("n_cpu_moe", "llama.cpp"),
}
# alias without a value -> (field, the value it sets, whose name it is)
SWITCHES = {
    "--multi-token-prediction": ("enable_mtp", True, "an older guide"),
    "--disable-radix-cache": ("enable_prefix_caching", False, "SGLang"),
    "--disable-cuda-graph": ("enforce_eager", True, "SGLang"),
    "-cmoe": ("cpu_moe", True, "llama.cpp"),
}


# harmless flags of other engines that ember has no use for -> why (accepted with that note)
IGNORED = {
    "--trust-remote-code": "ember runs its own model code for the architectures it supports; a model's remote "
    "code is never executed, so the flag changes nothing",
    "--disable-log-stats": "ember logs no periodic stats line; /metrics has them",
    "--disable-frontend-multiprocessing": "ember's server and engine share one process (the engine on its own thread)",
    "--enable-server-load-tracking": "ember always counts the generation requests in flight; GET /load reports them",
}
# other engines' flags that take a value: the values that change nothing here -> why; any other value is refused
IGNORED_VALUES = {
    "--load-format": (
        ("auto", "safetensors", "gguf"),
        "ember reads safetensors folders and .gguf files as they are; "
        "other formats (pt, dummy, bitsandbytes, ...) it does not load",
    ),
    "--api-server-count": (("1",), "ember runs one API server process; use one process per port to scale out"),
    "--structured-outputs-config.backend": (("xgrammar", "auto"), "ember's structured outputs are built by xgrammar"),
}
# other engines' flags for features ember does not have -> what to do instead (refused at start)
REFUSED = {
    "--enable-lora": "ember serves no LoRA adapters; merge the adapter into the weights first",
    "--lora-modules": "ember serves no LoRA adapters; merge the adapter into the weights first",
    "--skip-tokenizer-init": "ember needs the tokenizer (chat templates, stop strings, structured outputs)",
    "--enable-sleep-mode": "ember has no sleep mode; stop the server to free its memory",
    "--enable-prompt-embeds": "ember takes text or token ids, not embeddings",
    "--limit-mm-per-prompt": "ember serves text models only",
}


def _speculative_algorithm(value: str) -> dict[str, Any]:
    v = value.strip().upper()
    if v in ("NEXTN", "MTP"):
        return {"enable_mtp": True}
    if v == "NGRAM":
        return {"speculative_model": "ngram"}
    if v == "STANDALONE":  # a draft model, named by --speculative-draft-model-path
        return {}
    raise argparse.ArgumentTypeError(
        f"--speculative-algorithm {value}: ember has no EAGLE-style drafter; use NEXTN (the model's MTP layers, "
        "= --enable-mtp), NGRAM (= --speculative-model ngram), or a draft model with --speculative-model DIR"
    )


def _eagle_topk(value: str) -> dict[str, Any]:
    if int(value) != 1:
        raise argparse.ArgumentTypeError(
            f"--speculative-eagle-topk {value}: ember drafts one chain, not a tree; use 1 (or leave it out)"
        )
    return {}


def _num_draft_tokens(value: str) -> dict[str, Any]:
    # SGLang verifies num_draft_tokens = num_steps + 1 tokens a step (the last sampled one and the drafts)
    n = int(value)
    if n < 2:
        raise argparse.ArgumentTypeError(f"--speculative-num-draft-tokens must be >= 2 (got {value})")
    return {"num_speculative_tokens": n - 1}


def _mtp_num(value: str) -> dict[str, Any]:
    return {"enable_mtp": True, "num_speculative_tokens": int(value)}


# alias -> (its value -> the fields it sets, what it means in ember's words)
MAPPED: dict[str, tuple[Callable[[str], dict[str, Any]], str]] = {
    "--speculative-algorithm": (_speculative_algorithm, "SGLang's; NEXTN / MTP = --enable-mtp"),
    "--speculative-eagle-topk": (_eagle_topk, "SGLang's; ember drafts a chain (topk 1)"),
    "--speculative-num-draft-tokens": (_num_draft_tokens, "SGLang's; N = --num-speculative-tokens N-1"),
    "--mtp-num": (_mtp_num, "an older guide's; = --enable-mtp --num-speculative-tokens N"),
}


class _Alias(argparse.Action):
    """Sets ember's own fields from an alias, refusing a contradiction with a flag already given,
    and records a note (ns._alias_notes) that ember.config.engine_args logs."""

    def __init__(self, option_strings, dest, fields: Callable[[str | None], dict[str, Any]], note: str, **kw):
        self.fields, self.note = fields, note
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            fields = self.fields(values)
        except (argparse.ArgumentTypeError, ValueError) as e:
            parser.error(str(e))
        for name, value in fields.items():
            if hasattr(namespace, name) and getattr(namespace, name) != value:
                parser.error(
                    f"{option_string} {values if values is not None else ''} sets --{name.replace('_', '-')} "
                    f"to {value!r}, but it was given as {getattr(namespace, name)!r}; give one of them"
                )
            setattr(namespace, name, value)
            # ember's own flag may still come later on the line: check_aliases compares at the end
            namespace._alias_set = {**getattr(namespace, "_alias_set", {}), name: (option_string, value)}
        notes = list(getattr(namespace, "_alias_notes", []))
        notes.append(f"{option_string} is {self.note}")
        namespace._alias_notes = notes


def _only(alias: str, allowed: tuple[str, ...], why: str) -> Callable[[str], dict[str, Any]]:
    def fields(value: str) -> dict[str, Any]:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{alias} {value}: {why}; leave it out or say {allowed[0]}")
        return {}

    return fields


def _refuse(alias: str, instead: str) -> Callable[[str | None], dict[str, Any]]:
    def fields(value: str | None) -> dict[str, Any]:
        raise argparse.ArgumentTypeError(f"{alias}: {instead}")

    return fields


def add_aliases(group, field_types: dict[str, Callable]) -> None:
    """Add every alias to an argparse group; field_types: EngineConfig field -> its argparse type."""
    for alias, (field, whose) in RENAMED.items():
        group.add_argument(
            alias,
            action=_Alias,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            fields=lambda v, f=field: {f: field_types[f](v)},
            note=f"{whose}'s name for --{field.replace('_', '-')}",
            help=argparse.SUPPRESS,
        )
    for alias, (field, value, whose) in SWITCHES.items():
        group.add_argument(
            alias,
            action=_Alias,
            nargs=0,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            fields=lambda v, f=field, x=value: {f: x},
            note=f"{whose}'s name for --{'' if value else 'no-'}{field.replace('_', '-')}",
            help=argparse.SUPPRESS,
        )
    for alias, why in IGNORED.items():
        group.add_argument(
            alias,
            action=_Alias,
            nargs=0,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            fields=lambda v: {},
            note=f"accepted and ignored: {why}",
            help=argparse.SUPPRESS,
        )
    for alias, (allowed, why) in IGNORED_VALUES.items():
        group.add_argument(
            alias,
            action=_Alias,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            fields=_only(alias, allowed, why),
            note=f"accepted and ignored: {why}",
            help=argparse.SUPPRESS,
        )
    for alias, instead in REFUSED.items():
        group.add_argument(
            alias,
            action=_Alias,
            nargs="?",
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            fields=_refuse(alias, instead),
            note="",
            help=argparse.SUPPRESS,
        )
    for alias, (fn, note) in MAPPED.items():
        group.add_argument(
            alias,
            action=_Alias,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            fields=fn,
            note=note,
            help=argparse.SUPPRESS,
        )


def check_aliases(args: argparse.Namespace) -> list[str]:
    """After parsing: ConfigError where ember's own flag, given after an alias, says otherwise;
    else the notes to log."""
    from ember.errors import ConfigError

    for name, (option, value) in getattr(args, "_alias_set", {}).items():
        if getattr(args, name) != value:
            raise ConfigError(
                f"{option} sets --{name.replace('_', '-')} to {value!r}, but --{name.replace('_', '-')} "
                f"says {getattr(args, name)!r}; give one of them"
            )
    return list(getattr(args, "_alias_notes", []))
