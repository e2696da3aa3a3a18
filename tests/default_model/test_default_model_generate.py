"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) end to end against transformers'
own load of the same file, in fp32 (the engine: the `llm` fixture of tests/default_model/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from ember import SamplingParams

pytestmark = pytest.mark.engine  # every test here builds an engine

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def hf_model(default_hf_model):  # tests/conftest.py: loaded once a session
    return default_hf_model


def test_greedy_32_tokens_equal_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist(), prompt


def test_chat_answers_sensibly(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=16),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with <|im_end|>
