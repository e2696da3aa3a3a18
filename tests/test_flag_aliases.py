"""The launch lines users copy from other engines and guides, with `ember serve` (or `python -m
ember.launch_server`) in place of vLLM's / SGLang's: each parses to the configuration it means, with a
one-line note per foreign spelling, starts on a tiny model of its kind, or is refused naming the fix."""

from __future__ import annotations

import logging
import shlex

import pytest

from ember.config.engine_args import engine_config_from_args
from ember.entrypoints.cli import build_parser
from ember.errors import ConfigError
from ember.launch_server import build_parser as sglang_parser
from tests.spec.test_mtp_spec import mtp_model  # noqa: F401 (fixture)


def parse(line: str, model: str = "M"):
    """`ember serve ...` or `python -m ember.launch_server ...` -> (EngineConfig, parsed args)."""
    words = shlex.split(line.replace("MODEL", model))
    if words[:3] == ["python", "-m", "ember.launch_server"]:
        args = sglang_parser().parse_args(words[3:])
    else:
        assert words[:2] == ["ember", "serve"]
        args = build_parser().parse_args(words[1:])
    return engine_config_from_args(args), args


def test_sglang_launch_line(caplog):
    with caplog.at_level(logging.INFO, logger="ember"):
        cfg, args = parse(
            "python -m ember.launch_server --model-path MODEL --context-length 4096 --tp 1 "
            "--mem-fraction-static 0.85 --max-running-requests 8 --chunked-prefill-size 1024 "
            "--disable-radix-cache --random-seed 3 --trust-remote-code --host 0.0.0.0"
        )
    assert (cfg.model, cfg.max_model_len, cfg.tensor_parallel_size, cfg.gpu_memory_utilization) == ("M", 4096, 1, 0.85)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_prefix_caching, cfg.seed) == (8, 1024, False, 3)
    assert args.port == 30000 and args.host == "0.0.0.0"  # SGLang's default port
    notes = [r.getMessage() for r in caplog.records]
    assert "ember: --context-length is SGLang's name for --max-model-len" in notes
    assert "ember: --disable-radix-cache is SGLang's name for --no-enable-prefix-caching" in notes
    assert any("--trust-remote-code is accepted and ignored" in n for n in notes)


@pytest.mark.parametrize(
    "line, method, k",
    [
        ("ember serve MODEL --speculative-model mtp --num-speculative-tokens 2", "mtp", 2),
        ("ember serve MODEL --mtp-num 2", "mtp", 2),
        ("ember serve MODEL --multi-token-prediction --num-speculative-tokens 1", "mtp", 1),
        (
            'ember serve MODEL --speculative-config \'{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}\'',
            "mtp",
            2,
        ),
        (
            "python -m ember.launch_server --model-path MODEL --speculative-algorithm NEXTN --speculative-num-steps 2 "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 3",
            "mtp",
            2,
        ),
        (
            "python -m ember.launch_server --model-path MODEL --speculative-algorithm NGRAM --speculative-num-steps 3",
            "ngram",
            3,
        ),
    ],
)
def test_speculation_spellings(line, method, k, mtp_model):  # noqa: F811
    path = mtp_model("qwen3", "deepseek")
    cfg, _ = parse(line, path)
    assert cfg.speculative.method == method and cfg.speculative.num_speculative_tokens == k


@pytest.mark.parametrize(
    "line, fix",
    [
        ("python -m ember.launch_server --model-path M --speculative-algorithm EAGLE", "use NEXTN"),
        (
            "python -m ember.launch_server --model-path M --speculative-algorithm NEXTN --speculative-eagle-topk 4",
            "use 1",
        ),
        ("ember serve M --context-length 512 --max-model-len 1024", "give one of them"),
        ("ember serve M --speculative-model mtp --no-enable-mtp", "drop one of them"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_fix(line, fix, capsys):
    with pytest.raises((SystemExit, ConfigError)) as e:
        parse(line)
    message = str(e.value) if isinstance(e.value, ConfigError) else capsys.readouterr().err
    assert fix in message


def test_attention_backend_names_of_other_engines(caplog):
    from ember.config.attention import resolve_attention_backend

    cfg, _ = parse("ember serve M --decode-kernel flash2 --quantization awq_marlin")
    assert cfg.attention_backend == "flash2" and cfg.quantization == "awq"
    with caplog.at_level(logging.INFO, logger="ember"):
        assert resolve_attention_backend("flash2", "cpu") == "cpu"  # on CPU: the fused C++ kernels, said in a note
        assert resolve_attention_backend("flashinfer", "cuda") in ("triton", "torch")
        assert resolve_attention_backend("torch_native", "cpu") == "torch"
    assert any("--attention-backend flash2 is another engine's name; on cpu" in r.getMessage() for r in caplog.records)


@pytest.mark.engine
def test_seed_lines_start_on_tiny_models(mtp_model):  # noqa: F811
    """The MTP launch lines of both engines start an engine that drafts with the model's own layer."""
    from ember.engine.engine import LLMEngine
    from ember.sampling import SamplingParams

    path = mtp_model("qwen3", "deepseek")
    small = "--dtype float32 --kv-cache-memory 0.01 --max-num-seqs 2 --block-size 4"
    for line in (
        f"ember serve MODEL --speculative-model mtp --num-speculative-tokens 2 --max-model-len 128 "
        f"--attention-backend flash2 {small}",
        f"python -m ember.launch_server --model-path MODEL --context-length 128 --speculative-algorithm NEXTN "
        f"--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3 {small}",
    ):
        engine = LLMEngine(parse(line, path)[0])
        spec = engine.parts.spec
        assert spec.config.method == "mtp" and spec.k_max == 2 and engine.parts.limits.max_model_len == 128
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats()["spec_num_drafts"] > 0 and engine.parts.kv.num_free_blocks == engine.parts.kv.num_blocks


@pytest.mark.engine
def test_awq_launch_line_starts(tiny_model_dir, tmp_path):
    """vLLM's AWQ line with its kernel-specific name (awq_marlin) and an fp8 cache, on an AWQ folder."""
    from ember.engine.engine import LLMEngine
    from tests.quant.test_awq import write_awq_pair

    awq_dir, _ = write_awq_pair(tiny_model_dir("qwen3"), str(tmp_path), 32)
    cfg, _ = parse(
        "ember serve MODEL --quantization awq_marlin --kv-cache-dtype fp8 --max-model-len 128 "
        "--gpu-memory-utilization 0.9 --enable-chunked-prefill --max-num-batched-tokens 64 "
        "--dtype float32 --kv-cache-memory 0.01 --max-num-seqs 2",
        awq_dir,
    )
    engine = LLMEngine(cfg)
    assert engine.parts.loaded.quantization == "awq" and engine.parts.limits.kv_dtype.itemsize == 1


def test_harmless_vllm_flags_pass_with_a_note_and_the_rest_are_refused_naming_why(capsys):
    from ember.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--load-format",
            "safetensors",
            "--enable-server-load-tracking",
            "--api-server-count",
            "1",
            "--structured-outputs-config.backend",
            "xgrammar",
        ]
    )
    notes = " ".join(args._alias_notes)
    assert "--load-format is accepted and ignored" in notes and "--enable-server-load-tracking" in notes
    assert "--structured-outputs-config.backend is accepted" in notes
    for argv, says in (
        (["--load-format", "dummy"], "other formats"),
        (["--enable-lora"], "LoRA"),
        (["--api-server-count", "2"], "one API server"),
        (["--limit-mm-per-prompt", "{}"], "text models"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *argv])
        assert says in capsys.readouterr().err
