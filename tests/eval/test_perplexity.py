"""Perplexity through the engine equals the one computed from HF transformers' logits."""

import math

import pytest
import torch
import torch.nn.functional as F

from ember import LLM
from ember.errors import ConfigError
from ember.eval.perplexity import perplexity

pytestmark = pytest.mark.engine  # every test here builds an engine


def hf_perplexity(model_dir: str, ids: list[int], window: int) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids), window):
            part = ids[s : s + window]
            if len(part) < 2:
                break
            logits = hf(torch.tensor([part])).logits[0, :-1]
            total += F.cross_entropy(logits, torch.tensor(part[1:]), reduction="sum").item()
            n += len(part) - 1
    return math.exp(total / n)


@pytest.mark.parametrize("chunk", [7, 64])
def test_matches_transformers(tiny_model_dir, chunk):
    path = tiny_model_dir("qwen3")
    llm = LLM(model=path, dtype="float32", kv_cache_memory=0.01, max_model_len=256)
    ids = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = perplexity(llm.engine, ids, window=64, chunk=chunk)
    assert ours.windows == 3 and ours.scored_tokens == 63 + 63 + 21
    assert ours.perplexity == pytest.approx(hf_perplexity(path, ids, 64), rel=1e-4)
    # the KV blocks it borrowed are back
    assert llm.engine.parts.kv.num_free_blocks == llm.engine.parts.kv.num_blocks


def test_empty_text_is_refused(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("llama"), dtype="float32", kv_cache_memory=0.01, max_model_len=128)
    with pytest.raises(ConfigError, match="no tokens"):
        perplexity(llm.engine, [5])
