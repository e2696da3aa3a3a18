"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) end to end against transformers'
own load of the same file, in fp32."""

from __future__ import annotations

import os

import pytest
import torch

from ember import LLM, SamplingParams
from ember.default_model import default_model_path
from ember.entrypoints.cli import main as cli_main

pytestmark = pytest.mark.engine  # every test here builds an engine

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
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


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


def test_cli_generate(capsys):
    rc = cli_main(
        [
            "generate",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--kv-cache-memory",
            "0.1",
            "--max-model-len",
            "1024",
        ]
    )
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
    assert engines[0].parts.kv.stats.hits >= 32


@torch.inference_mode()
def _all_logits(engine, ids: list[int]) -> torch.Tensor:
    """float32 logits at every position of one prompt, prefilled in one step through the engine's pool."""
    from ember.engine.scheduler import SchedulerOutput
    from ember.request import Request

    req = Request("logits", ids, sampling_params=None)
    assert engine.parts.kv.allocate_slots(req, len(ids))
    try:
        b = engine.parts.runner.prepare(SchedulerOutput(scheduled=[(req, len(ids))]))
        hidden = engine.parts.runner.model(b.input_ids, b.positions, engine.parts.runner.kv_caches, b.meta)
        return engine.parts.runner.model.compute_logits(hidden).float()
    finally:
        engine.parts.kv.free(req)


@pytest.mark.skipif(
    not __import__("ember.kernels.cpu_tiled_gemv", fromlist=["x"]).has_q8(),
    reason="the int8-activation path needs AVX-512 BF16, VNNI and VBMI",
)
def test_int8_activations_stay_near_fp32_logits(llm):
    """The default bf16 engine on a VNNI CPU prefills through int8 x per group of 32
    (--cpu-int8-activations). Against the exact fp32 model at every position of 4 held-out pydoc
    texts: its logits move at most ~2.5x what bf16 x alone moves them (measured: median of the
    per-position max |difference| 0.70 vs 0.33, argmax agreeing at 95.9% vs 97.5% of 1020
    positions), and it really is another path (its logits differ from bf16 x's)."""
    from ember.train.calibration import pydoc_split

    tok = llm.engine.parts.loaded.tokenizer
    prompts = [tok.encode(t)[:160] for t in pydoc_split("eval")[:4]]
    ref = [_all_logits(llm.engine, p) for p in prompts]
    stats = {}
    for name, kw in (("int8 x", {}), ("bf16 x", {"cpu_int8_activations": False})):
        eng = LLM(dtype="bfloat16", kv_cache_memory=0.05, max_model_len=512, enable_mtp=False, **kw).engine
        got = [_all_logits(eng, p) for p in prompts]
        err = torch.cat([(g - r).abs().amax(dim=1) for g, r in zip(got, ref)])
        agree = sum((g.argmax(1) == r.argmax(1)).sum().item() for g, r in zip(got, ref)) / err.numel()
        stats[name] = (err.median().item(), agree, got)
    (e8, a8, g8), (e16, a16, g16) = stats["int8 x"], stats["bf16 x"]
    assert e8 <= 3 * e16 and e8 < 1.5, (e8, e16)
    assert a8 >= 0.93 and a8 >= a16 - 0.04, (a8, a16)
    assert any(not torch.equal(a, b) for a, b in zip(g8, g16))
