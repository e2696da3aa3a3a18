"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) in fp32, shared by the files here.

The tests of the default model are split by theme into files of their own, so that pytest-xdist's
--dist loadfile can put them on different workers (as one file they were the suite's largest unit);
a module-scoped fixture builds one engine per file that uses it.
"""

from __future__ import annotations

import pytest

from ember import LLM


@pytest.fixture(scope="module")
def llm():
    # Dequantized fp32, as transformers loads it (the packed path is checked against this one in
    # tests/quant/test_gguf_packed.py; torch's int4 kernel is slow in fp32).
    return LLM(dtype="float32", kv_cache_memory=0.25, max_model_len=2048, quantization="none")
