"""Shared fixtures: tiny random HF models saved as model folders (with a tiny tokenizer), built offline."""
from __future__ import annotations

import json
import os

import pytest

# --executor auto on CPU compiles decode graphs on a background thread (ember.engine.background_compile).
# The suite starts hundreds of short-lived engines: there auto stays eager, and the tests of the background
# compile (tests/engine/test_background_compile.py) turn it on. Set here, so servers the tests launch inherit it.
os.environ.setdefault("EMBER_AUTO_COMPILE", "0")

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tiny_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE trained on CPython's own docs, with ChatML specials and a chat template."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = list(pydoc_data.topics.topics.values())[:200]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}, f)


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory):
    """tiny_hybrid_dir(arch) -> a tiny hybrid Qwen folder (tests/models/tiny_hybrids.py), built once per session."""
    from tests.models.tiny_hybrids import build_hybrid, save_hybrid

    cache: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in cache:
            cache[arch] = save_hybrid(build_hybrid(arch), str(tmp_path_factory.mktemp(f"tiny-{arch}")))
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch) -> folder with config.json, model.safetensors, tokenizer files (fp32)."""
    from tests.models.tiny_models import VOCAB, build_hf_model, save_hf_model

    cache: dict[str, str] = {}

    def make(arch: str = "qwen3") -> str:
        if arch not in cache:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            save_hf_model(build_hf_model(arch), path)
            write_tiny_tokenizer(path, VOCAB)
            cache[arch] = path
        return cache[arch]

    return make
