"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) end to end against transformers'
own load of the same file, in fp32."""
from __future__ import annotations

import os

import pytest
import torch

from ember import LLM, SamplingParams
from ember.cli import main as cli_main
from ember.default_model import default_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    # Dequantized fp32, as transformers loads it (the packed path is checked against this one in
    # tests/quant/test_gguf_packed.py; torch's int4 kernel is slow in fp32).
    return LLM(dtype="float32", kv_cache_memory=0.25, max_model_len=2048, quantization="none")


def test_greedy_32_tokens_equal_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt


def test_chat_answers_sensibly(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with <|im_end|>


def test_cli_generate(capsys):
    rc = cli_main(["generate", "The capital of France is", "--max-tokens", "8", "--kv-cache-memory", "0.1",
                   "--max-model-len", "1024"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_reports_errors_without_a_traceback(capsys):
    rc = cli_main(["generate", "hi", "--max-num-seqs", "100", "--max-num-batched-tokens", "10"])
    assert rc == 2
    assert "max-num-seqs" in capsys.readouterr().err


def test_cli_chat_is_multi_turn_and_reuses_the_prefix(monkeypatch, capsys):
    turns = iter(["Name the capital of France.", "And of Italy?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(turns))
    engines = []
    from ember.engine import engine as engine_mod

    real_init = engine_mod.LLMEngine.__init__

    def spy_init(self, config):
        real_init(self, config)
        engines.append(self)

    monkeypatch.setattr(engine_mod.LLMEngine, "__init__", spy_init)
    rc = cli_main(["chat", "--max-tokens", "12", "--kv-cache-memory", "0.1", "--max-model-len", "1024"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "Rome" in out
    # the second turn's prompt starts with the whole first turn: it came from the prefix cache
    assert engines[0].kv.stats.hits >= 32
