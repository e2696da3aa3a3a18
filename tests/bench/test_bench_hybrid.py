"""`ember bench hybrid`'s model files: a random Qwen3.5 folder written by transformers with the
default model's tokenizer, converted by llama.cpp's own converter (fetched from the llama-cpp-python
sdist), which ember loads and runs; and the command's defaults (no bars judged, its own section)."""

import argparse

import pytest
import torch

from ember import LLM, SamplingParams
from ember.bench.commands.hybrid import QWEN35_08B, add_cli_args, build_folder, build_gguf

TINY = dict(
    QWEN35_08B,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    intermediate_size=96,
    vocab_size=152000,
)


@pytest.mark.engine
def test_the_model_files_are_built_converted_and_run(tmp_path):
    folder = build_folder(str(tmp_path / "q35"), shape=TINY)
    gguf = build_gguf(folder)
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "qwen35"
    llm = LLM(folder, dtype="float32", kv_cache_memory=0.01, max_model_len=128, num_threads=1)
    out = llm.generate(
        [{"prompt_token_ids": list(range(5, 40))}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 4 and torch.tensor(out.outputs[0].token_ids).lt(152000).all()
    assert build_folder(folder, shape=TINY) == folder and build_gguf(folder) == gguf  # built once


def test_defaults_write_their_own_section_without_bars():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([])
    assert args.output == "benchmarks/hybrid.md" and args.prompt_lens == [2000] and args.num_prompts == 16
    assert args.mtp is False and args.decode_prompt == "random"
