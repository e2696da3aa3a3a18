"""ember as a side: an LLM built from the command's engine flags, timed through its own step loop.

EmberSide is what `ember bench compare | hybrid | matrix` build (here or in a worker process);
ember_knobs turns the command's flags into its knobs. engine_and_peer builds the two sides of
`ember bench latency | throughput` in this process: ember, then transformers on the same weights.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time

from ember.engine.planner import DTYPE_BYTES, kv_elem_bytes
from ember.platform import resolve_dtype_name, resolve_kv_cache_dtype_name

EMBER = "ember.bench.sides.ember:EmberSide"
# ember's KV pool when --kv-cache-memory is not given, per byte of a KV element: 64 sequences of 640
# tokens of the default model (23 KB a token in bf16, 46 KB in float32) fit; larger workloads or
# models want the flag
KV_GIB_PER_BYTE = 0.5
# engine knobs that turn every kind of speculation off
NO_SPECULATION = {
    "speculative_config": None,
    "speculative_model": None,
    "enable_mtp": False,
    "num_speculative_tokens": None,
}


def ember_factory(checkout: str | None = None) -> str:
    """EmberSide's factory path in this ember, or in the ember of another checkout (one from before
    bench/sides/ has it at ember.bench.sides:EmberSide: a baseline is often an earlier commit)."""
    if checkout is None or os.path.exists(os.path.join(checkout, "ember", "bench", "sides", "ember.py")):
        return EMBER
    return "ember.bench.sides:EmberSide"


class EmberSide:
    def __init__(self, **knobs):
        import torch

        from ember.llm import LLM

        self.llm = LLM(**knobs)
        self.llm.wait_for_compile()  # benchmarks measure the steady state: a background compile finishes first
        parts = self.llm.engine.parts
        self._ids = itertools.count()
        self.weight_bytes = parts.loaded.weight_bytes
        tok = self.llm.get_tokenizer()
        # what the driver needs to draw prompts of ordinary tokens without loading a tokenizer itself
        self.prompt_vocab = (min(tok.vocab_size, parts.loaded.model_config.vocab_size), sorted(tok.all_special_ids))
        spec = parts.spec.config.method if parts.spec is not None else "none"
        self.description = {
            "name": "ember",
            "model": str(parts.loaded.path).rstrip("/").rsplit("/", 1)[-1],
            "weights_mb": round(parts.loaded.weight_bytes / 1e6, 1),
            "dtype": str(parts.setup.dtype).removeprefix("torch."),
            "quantization": knobs.get("quantization", "auto"),
            "speculation": spec,
            "max_num_seqs": parts.limits.max_num_seqs,
            "threads": torch.get_num_threads(),
        }

    def _rid(self, what: str) -> str:
        return f"bench-{what}-{next(self._ids)}"

    def decode(self, prompt: list[int], n: int) -> list[float]:
        from ember.bench.lib.timing import ember_decode

        return ember_decode(self.llm.engine, self._rid("decode"), prompt, n)

    def ttft(self, prompt: list[int]) -> float:
        from ember.bench.lib.timing import ember_ttft

        return ember_ttft(self.llm.engine, self._rid("ttft"), prompt)

    def batch(self, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
        from ember.bench.lib.timing import ember_batch

        return ember_batch(self.llm, prompts, output_len)

    def draft_cost(self, prompt: list[int], n: int) -> dict:
        """What a draft step costs (`ember bench flash`'s MTP row), measured: n tokens decoded greedily with k
        pinned at 1, so every step drafts once whatever the acceptance; the drafter's seconds (the fill of
        the step's rows and the draft: SpecStats.draft_seconds) over its drafts, from the first token on
        (the prompt's fill is not a draft step). With the engine's own estimate (draft_token_cost: weight
        bytes) and the speculation counters of the rounds before (adaptive k)."""
        from ember.sampling import SamplingParams
        from ember.spec.adaptive import AdaptiveK

        engine = self.llm.engine
        spec = engine.parts.spec
        rounds = spec.stats.as_dict()
        saved, spec.adaptive = spec.adaptive, AdaptiveK(1, enabled=False)
        rid, marks, steps = self._rid("draft"), [], 0
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        try:
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            while engine.has_unfinished_requests():
                outs = engine.step()
                steps += bool(marks)
                if not marks and any(out.request_id == rid for out in outs):
                    marks.append(dict(spec.stats.as_dict(), t=time.perf_counter()))  # after the first token
            marks.append(dict(spec.stats.as_dict(), t=time.perf_counter()))
        finally:
            spec.adaptive = saved
        first, last = marks
        drafts = last["spec_num_draft_tokens"] - first["spec_num_draft_tokens"]
        seconds = last["spec_draft_seconds"] - first["spec_draft_seconds"]
        keys = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_draft_seconds")
        return {
            "draft_ms": 1000 * seconds / drafts if drafts else None,
            "drafts": drafts,
            "pinned_step_ms": 1000 * (last["t"] - first["t"]) / max(1, steps),  # a step with its draft
            "estimate": spec.draft_token_cost,
            "rounds": {k.removeprefix("spec_"): rounds[k] for k in keys},
        }

    def op_split(self, prompt: list[int], steps: int) -> dict:
        """Where a batch-1 decode step's time goes (ember.bench.lib.op_split)."""
        from ember.bench.lib.op_split import decode_split

        return decode_split(self.llm, self._rid("split"), prompt, steps)


def ember_knobs(args, num_prompts: int) -> tuple[dict, int]:
    """The command's engine knobs as a dict, with max_num_seqs sized to the throughput batch when
    unset (the peers run all prompts at once), KV cache for that batch when unset, and the thread count
    pinned; and that thread count."""
    import torch

    from ember.config.engine_args import engine_config_from_args

    config = engine_config_from_args(args)
    threads = config.num_threads or torch.get_num_threads()
    torch.set_num_threads(threads)  # the driver's bandwidth probe runs on the sides' thread count
    knobs = config.flags()
    knobs["num_threads"] = threads
    if knobs["kv_cache_memory"] is None:
        # the pool is allocated (and touched) up front, so it is in peak RSS: size it to the workload,
        # not to the machine's RAM, or the memory figure says more about the default than the engine
        # (a 1 GiB pool in float32 held 36 of the 64 sequences: half the batch the peers run)
        kv_name = resolve_kv_cache_dtype_name(config.kv_cache_dtype, config.dtype, "cpu")
        element = kv_elem_bytes(kv_name, DTYPE_BYTES[resolve_dtype_name(config.dtype, "cpu")])
        knobs["kv_cache_memory"] = KV_GIB_PER_BYTE * element
    if knobs["max_num_seqs"] is None:
        # a budget left unset grows to max_num_seqs (SchedulerConfig.token_budget); one given caps it
        knobs["max_num_seqs"] = min(num_prompts, config.max_num_batched_tokens or num_prompts)
    return knobs, threads


def engine_and_peer(args, batch: int | None = None):
    """(LLM, peer or None, the ember description for the report). `batch` sets max_num_seqs
    when the user left it unset (capped by the step budget, as the engine requires)."""
    from ember.config.engine_args import engine_config_from_args
    from ember.llm import LLM

    config = engine_config_from_args(args)
    if batch is not None and config.max_num_seqs is None:
        config = dataclasses.replace(config, max_num_seqs=min(batch, config.max_num_batched_tokens or batch))
    llm = LLM(**config.flags())
    llm.wait_for_compile()  # benchmarks measure the steady state: a background compile finishes first
    # the peer loads after ember so it runs on the thread count ember chose (torch's is per-process)
    peer = None
    if args.peer == "hf":
        from ember.bench.peers.hf import HFPeer

        peer = HFPeer(str(llm.engine.parts.loaded.path))
    return llm, peer, describe_engine(llm)


def describe_engine(llm) -> dict:
    """What an ember engine in this process runs, for the report."""
    import torch

    config, parts = llm.engine.config, llm.engine.parts
    name = str(parts.loaded.path).rstrip("/").rsplit("/", 1)[-1]
    return {
        "model": f"{name} ({parts.loaded.weight_bytes / 1e6:.0f} MB weights{parts.copies.note()})",
        "dtype": str(parts.setup.dtype).removeprefix("torch."),
        "device": str(parts.setup.device),
        "max_num_seqs": parts.limits.max_num_seqs,
        "max_num_batched_tokens": parts.limits.max_num_batched_tokens,
        "prefix_caching": config.enable_prefix_caching,
        "enforce_eager": config.enforce_eager,
        "executor": parts.limits.executor,
        "threads": torch.get_num_threads(),
    }
