"""Stand-ins for the llama.cpp and transformers peers: the shape of a side (ember.bench.sides), no engine.

They return fixed, made-up timings, so a test can check that bars are judged both ways without
llama-cpp-python (CI does not install the bench extra) and without loading transformers.
"""

from __future__ import annotations

import time

from ember.errors import ConfigError


class FakePeer:
    name = "fake"
    tok_s = 1.0  # decode speed it reports (slow enough that ember beats it on a loaded machine too)
    ttft_s = 60.0
    batch_tok_s = 1e6  # offline throughput it reports

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.description = {"name": self.name, **{k: v for k, v in kwargs.items() if k != "gguf_path"}}

    def decode(self, prompt: list[int], n: int) -> list[float]:
        t0 = time.perf_counter()
        return [t0 + i / self.tok_s for i in range(n)]

    def ttft(self, prompt: list[int]) -> float:
        return self.ttft_s

    def batch(self, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
        generated = len(prompts) * output_len
        return generated / self.batch_tok_s, generated


class FakeLlamaCpp(FakePeer):
    """Slow at decode and prefill: ember's llama.cpp bars pass against it."""

    name = "fake llama.cpp"


class FakeHF(FakePeer):
    """Absurdly fast at batched generation: ember's throughput bar fails against it."""

    name = "fake transformers"


def broken_peer(**kwargs):
    raise ConfigError("fake peer: cannot start (as a missing dependency would say)")
