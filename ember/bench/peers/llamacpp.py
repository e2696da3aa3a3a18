"""llama.cpp as a benchmark peer, through llama-cpp-python (the `bench` extra).

The peer a CPU user would otherwise pick (ollama and LM Studio run it). Same GGUF file, same
thread count, flash attention on; prompts are handed over as token ids so both engines see the
same tokens. llama-cpp-python compiles llama.cpp on install (several minutes on 2 cores).

Offline throughput: llama-cpp-python's high-level API generates one sequence at a time, so
batch() drives llama.cpp's own batch API underneath it (llama_batch with one sequence id per
prompt, a unified KV cache of n_seq_max = the number of prompts, as llama-server's parallel slots
do): all prompts prefilled in n_batch-token batches, then one decode per step over every sequence,
greedy. batch_mode="sequential" instead runs the prompts one after another through generate().
"""

from __future__ import annotations

import time

from ember.bench.lib.machine import package_version
from ember.errors import ConfigError

BATCH_METHODS = {
    "parallel": (
        "llama.cpp offline throughput: all prompts as parallel sequences through llama_decode (llama-cpp-python "
        "has no batched generate; its low-level batch API, unified KV, n_seq_max = prompts, greedy argmax)"
    ),
    "sequential": "llama.cpp offline throughput: the prompts one after another through Llama.generate()",
}

INSTALL_HINT = (
    "pip install 'llama-cpp-python==0.3.36'  (or: pip install -e '.[bench]'; it compiles llama.cpp, "
    "several minutes on 2 cores)"
)


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(f"the llama.cpp peer needs llama-cpp-python: {INSTALL_HINT}") from None
    return llama_cpp


def llama_cpp_version() -> str | None:
    try:
        return import_llama_cpp().__version__
    except ConfigError:
        return None


class LlamaCppPeer:
    name = "llama.cpp"

    def __init__(self, gguf_path: str, threads: int, n_ctx: int = 4096, batch_mode: str = "parallel"):
        if batch_mode not in BATCH_METHODS:
            raise ConfigError(f"batch_mode must be one of {', '.join(BATCH_METHODS)} (got {batch_mode!r})")
        self.batch_mode = batch_mode
        self.description = {
            "name": self.name,
            "version": package_version("llama-cpp-python"),
            "model": str(gguf_path).rsplit("/", 1)[-1],
            "threads": threads,
            "flash_attn": True,
            "n_ctx": n_ctx,
            "batch": batch_mode,
        }
        if not str(gguf_path).endswith(".gguf"):
            raise ConfigError(f"the llama.cpp peer reads .gguf files only; {gguf_path} is not one")
        llama_cpp = import_llama_cpp()
        self.threads = threads
        self.llm = llama_cpp.Llama(
            model_path=str(gguf_path),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            n_batch=512,
            flash_attn=True,
            seed=0,
            verbose=False,
        )

    def _tokens(self, prompt: list[int], n: int, temperature: float, seed: int):
        """Yield n generated tokens (EOS ignored, as ember's ignore_eos); greedy at temperature 0.
        Plain temperature sampling otherwise: top-k/top-p/min-p off, as ember's defaults."""
        self.llm.set_seed(seed)
        gen = self.llm.generate(
            prompt,
            temp=temperature,
            top_k=0 if temperature > 0 else 1,
            top_p=1.0,
            min_p=0.0,
            repeat_penalty=1.0,
            reset=True,
        )
        for i, tok in enumerate(gen):
            yield tok
            if i + 1 >= n:
                break

    def decode(self, prompt: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> list[float]:
        """perf_counter time at which each of n generated tokens arrived (the first one ends the prefill)."""
        times = []
        for _ in self._tokens(prompt, n, temperature, seed):
            times.append(time.perf_counter())
        return times

    def ttft(self, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        self.decode(prompt, 1)
        return time.perf_counter() - t0

    def batch(self, prompts: list[list[int]], output_len: int, mode: str | None = None) -> tuple[float, int]:
        """All prompts, output_len greedy tokens each (see BATCH_METHODS); (seconds, generated tokens).
        mode: parallel or sequential for this call (default: the peer's batch_mode)."""
        if (mode or self.batch_mode) == "sequential":
            t0 = time.perf_counter()
            generated = sum(len(self.decode(p, output_len)) for p in prompts)
            return time.perf_counter() - t0, generated
        from ember.bench.peers.llamacpp_batch import parallel_generate

        seconds, outs = parallel_generate(self.llm, prompts, output_len)
        return seconds, sum(len(o) for o in outs)
