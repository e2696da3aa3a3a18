"""Engine flags for every subcommand, generated from EngineConfig so CLI and LLM(**knobs) never drift.

Each flag lands in the `--help` group of the sub-config it feeds (EngineConfig's field metadata).
Other engines' spellings of them (ember.config.aliases) are accepted too, each with a one-line note.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing

from ember.config import EngineConfig
from ember.config.aliases import add_aliases, check_aliases

logger = logging.getLogger("ember")

GROUP_TITLES = {
    "load": "model loading",
    "cache": "KV cache",
    "scheduler": "scheduler",
    "executor": "executor",
    "kernels": "kernels",
    "parallel": "parallelism",
    "placement": "placement (experts and tables in host memory beside a device)",
    "speculative": "speculative decoding",
    "structured": "structured outputs and reasoning",
}


def _base_type(tp):
    if isinstance(tp, str):
        tp = eval(tp, vars(typing) | {"dict": dict, "list": list})  # annotations are strings (PEP 563)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        tp = args[0]
    return typing.get_origin(tp) or tp


def _flags():
    """EngineConfig's flag fields (not the sub-configs built from them)."""
    return [f for f in dataclasses.fields(EngineConfig) if f.init]


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    groups = {key: parser.add_argument_group(f"engine: {title}") for key, title in GROUP_TITLES.items()}
    types = {}
    for f in _flags():
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        if f.name == "model" and positional_model:
            parser.add_argument("model_pos", nargs="?", metavar="MODEL", default=None, help=help_)
        group = groups[f.metadata["group"]]
        tp = types[f.name] = _base_type(f.type)
        kw: dict = {"dest": f.name, "default": argparse.SUPPRESS, "help": f"{help_} (default: {f.default})"}
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif tp is dict:
            group.add_argument(flag, type=str, metavar="JSON", **kw)
        else:
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            group.add_argument(flag, type=tp, **kw)
    add_aliases(parser, types)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    for note in check_aliases(args):
        logger.info("ember: %s", note)
    knobs = {f.name: getattr(args, f.name) for f in _flags() if hasattr(args, f.name)}
    if getattr(args, "model_pos", None) is not None:
        knobs["model"] = args.model_pos
    return EngineConfig(**knobs)


def engine_args_to_words(args: argparse.Namespace) -> list[str]:
    """The engine flags that were given, back as command-line words (they default to SUPPRESS,
    so present = given): for recording a reproducible command or launching a server."""
    words = [args.model_pos] if getattr(args, "model_pos", None) else []
    for f in _flags():
        if not hasattr(args, f.name):
            continue
        v, flag = getattr(args, f.name), "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            words.append(flag if v else "--no-" + f.name.replace("_", "-"))
        else:
            words += [flag, v if isinstance(v, str) else str(v)]
    return words
