"""A "side" of `ember bench compare | matrix`: one engine under test, behind one small interface.

decode(prompt_ids, n) -> arrival time of each of n greedy tokens (EOS ignored)
ttft(prompt_ids)      -> seconds to the first token
batch(prompts, n)     -> (seconds, generated tokens) for all prompts, n tokens each
description           -> what ran (a dict for the report); weight_bytes (ember only)

ember is wrapped here; the peers (llamacpp_peer.LlamaCppPeer, hf_peer.HFPeer) already have
this shape. A side is built from a factory path "module:callable" plus keyword arguments, so the
same recipe builds it in this process or in a worker process (worker.py), and a test can swap a
peer for a fake by path. Nothing heavy is imported at module level: worker processes import this
before they know which engine they will build.
"""
from __future__ import annotations

import importlib
import itertools
import resource
import sys

EMBER = "ember.bench.sides:EmberSide"


def build(factory: str, kwargs: dict):
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)(**kwargs)


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class EmberSide:
    def __init__(self, **knobs):
        import torch

        from ember.llm import LLM

        self.llm = LLM(**knobs)
        self.llm.wait_for_compile()  # benchmarks measure the steady state: a background compile finishes first
        eng = self.llm.engine
        self._ids = itertools.count()
        self.weight_bytes = eng.loaded.weight_bytes
        tok = self.llm.get_tokenizer()
        # what the driver needs to draw prompts of ordinary tokens without loading a tokenizer itself
        self.prompt_vocab = (min(tok.vocab_size, eng.model_config.vocab_size), sorted(tok.all_special_ids))
        spec = eng.spec.config.method if eng.spec is not None else "none"
        self.description = {"name": "ember", "model": str(eng.loaded.path).rstrip("/").rsplit("/", 1)[-1],
                            "weights_mb": round(eng.loaded.weight_bytes / 1e6, 1),
                            "dtype": str(eng.dtype).removeprefix("torch."), "quantization": knobs.get("quantization", "auto"),
                            "speculation": spec, "max_num_seqs": eng.max_num_seqs, "threads": torch.get_num_threads()}

    def _rid(self, what: str) -> str:
        return f"bench-{what}-{next(self._ids)}"

    def decode(self, prompt: list[int], n: int) -> list[float]:
        from ember.bench.latency import ember_decode

        return ember_decode(self.llm.engine, self._rid("decode"), prompt, n)

    def ttft(self, prompt: list[int]) -> float:
        from ember.bench.latency import ember_ttft

        return ember_ttft(self.llm.engine, self._rid("ttft"), prompt)

    def batch(self, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
        from ember.bench.throughput import ember_batch

        return ember_batch(self.llm, prompts, output_len)


class LocalSide:
    """A side built in this process (--in-process): cheap to start, but its memory is not its own."""

    shared_process = True
    pid = None  # its CPU time is this process's own

    def __init__(self, factory: str, kwargs: dict):
        self.side = build(factory, kwargs)
        self.description = self.side.description
        self.weight_bytes = getattr(self.side, "weight_bytes", None)
        self.prompt_vocab = getattr(self.side, "prompt_vocab", None)
        self.decode, self.ttft, self.batch = self.side.decode, self.side.ttft, self.side.batch

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes()

    def close(self) -> None:
        self.side = None
