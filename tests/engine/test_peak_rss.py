"""`ember plan`'s peak RSS (ember.engine.peak_rss) against a measured process: an engine in a fresh
interpreter, started with the same flags, one prefill of a full step budget and a few decodes, its
high-water mark (VmHWM). Within 10% on the default model (SmolLM2-135M, Q4_1 GGUF) and on
a tiny Qwen3.5 hybrid written to GGUF by llama.cpp's converter (state slots that matter: 16 value
heads of 128 x 128)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ember.config import EngineConfig
from ember.engine.planner import plan

pytestmark = pytest.mark.engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# what the measured process runs: the engine, a prompt of the whole step budget, then 4 tokens
MEASURE = """
import json, sys
from ember import LLM, SamplingParams
flags = json.loads(sys.argv[1])
llm = LLM(**flags)
prompt = [(t * 37) % 5000 + 100 for t in range(flags["max_num_batched_tokens"] - 1)]
llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
# VmHWM, not getrusage's ru_maxrss: Linux carries that over exec from the forking parent (pytest's own)
print("PEAK", next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) * 1024)
"""


def measured_peak(flags: dict) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps(flags)], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return int(next(line for line in out.stdout.splitlines() if line.startswith("PEAK")).split()[1])


def check(flags: dict) -> None:
    predicted = plan(EngineConfig(device="cpu", **flags))
    peak = measured_peak(flags)
    parts = {k: round(v / 2**20) for k, v in predicted.peak_rss_parts.items()}
    print(f"planned {predicted.peak_rss_bytes / 2**20:.0f} MiB {parts}, measured {peak / 2**20:.0f} MiB")
    assert abs(predicted.peak_rss_bytes / peak - 1) <= 0.10, (
        f"planned {predicted.peak_rss_bytes / 2**20:.0f} MiB {parts}, measured {peak / 2**20:.0f} MiB"
    )


def test_k_quant_held_bytes_and_copy_follow_the_layout():
    """Q6_K holds the file's bytes where the tiled GEMV's Q6_K tiles take it (both builds), and needs no
    dense copy where the tiled kernel serves every row count (the int8-x path, the AVX2 build); torch's
    int4 kernel (Q6KPart) holds 1.25 B (1.5 in float32) and needs one. Types dequantized at load need none."""
    from ember.engine.peak_rss import GGUFTensorInfo, held_bytes, needs_copy

    t = GGUFTensorInfo("blk.0.ffn_down.weight", "Q6_K", 1 << 20, 2)
    assert held_bytes(t, 2, "tiled", False) == held_bytes(t, 2, "int4", True) == (1 << 20) * 210 / 256
    assert held_bytes(t, 4, "tiled", False) == (1 << 20) * 210 / 256  # the AVX2 float32 build's tiles
    assert held_bytes(t, 2, "int4", False) == (1 << 20) * 1.25
    assert held_bytes(t, 4, "int4", False) == (1 << 20) * 1.5
    assert not needs_copy("Q6_K", "tiled", any_rows=True)
    k = GGUFTensorInfo("blk.0.ffn_up.weight", "Q4_K", 1 << 20, 2)  # two-level scales kept in either build
    assert held_bytes(k, 2, "tiled", False) == held_bytes(k, 4, "tiled", False) == (1 << 20) * (0.5 + 2 / 32 + 4 / 256)
    assert needs_copy("Q6_K", "tiled", any_rows=False) and needs_copy("Q6_K", "int4", any_rows=False)
    assert not needs_copy("Q2_K", "int4", any_rows=False) and not needs_copy("F16", "int4", any_rows=False)


ENGINE = {"executor": "eager", "num_threads": 1, "max_num_batched_tokens": 1024, "dtype": "bfloat16"}


def test_default_model_peak_rss_is_planned_within_10_percent():
    from ember.default_model import default_model_path

    check({"model": default_model_path(), "max_model_len": 2048, "max_num_seqs": 8, "kv_cache_memory": 0.25, **ENGINE})


def test_hybrid_gguf_peak_rss_is_planned_within_10_percent(tmp_path):
    from ember.bench.peers.llamacpp_convert import convert, write_qwen_tokenizer
    from tests.models.tiny_hybrids import build_hybrid

    heads = dict(linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)
    model = build_hybrid("qwen3_5", vocab_size=151936, **heads)
    folder = str(tmp_path / "qwen3_5")
    model.save_pretrained(folder)
    write_qwen_tokenizer(folder)
    path = convert(folder, folder + ".f32.gguf", "f32", ("--no-mtp",))
    flags = {"model": path, "max_model_len": 512, "max_num_seqs": 16, "kv_cache_memory": 0.25}
    flags = {**ENGINE, **flags, "max_num_batched_tokens": 512}  # the tiny model's context is 512
    predicted = plan(EngineConfig(device="cpu", **flags))
    assert predicted.state_slots == 48 and predicted.peak_rss_parts["state pool"] > 90 * 2**20
    check(flags)


def test_packaged_graphs_cost_no_inductor_machinery():
    """A GGUF file whose linears are all packed runs AOTInductor packages (no dynamo or inductor in the
    process): compile costs a few MiB a size. A float linear (freezing on) or MoE experts (their op keeps
    torch.compile) bring inductor's machinery back."""
    from ember.engine.peak_rss import COMPILE_BYTES, GGUFTensorInfo, compile_bytes, packaged

    def info(name, type_name, dims=2):
        return GGUFTensorInfo(name, type_name, 1024, dims)

    packed = [
        info("token_embd.weight", "Q6_K"),
        info("blk.0.attn_qkv.weight", "Q8_0"),
        info("blk.0.ssm_conv1d.weight", "F32"),
        info("blk.0.attn_norm.weight", "F32", 1),
    ]
    assert packaged(packed)
    assert not packaged(packed + [info("blk.0.ffn_down.weight", "BF16")])
    assert packaged(packed + [info("blk.0.ffn_down.weight", "BF16")], half_kept=True)  # a HalfPart: packed
    assert not packaged(packed + [info("blk.0.ffn_down.weight", "F32")], half_kept=True)
    assert not packaged(packed + [info("blk.0.ffn_down_exps.weight", "Q8_0", 3)])
    assert not packaged(None)
    assert compile_bytes(16, packages=True) < 64 << 20 < COMPILE_BYTES < compile_bytes(16)


def test_plan_counts_a_first_starts_package_build():
    """`ember plan` states the package build beside a first start (a worker that loads the weights for their
    shapes only, then holds its live state slots and one max_model_len sequence of KV through export,
    lowering and the compiler), and none where no package is built (eager)."""
    from ember.default_model import default_model_path
    from ember.engine import peak_rss

    flags = {"model": default_model_path(), "device": "cpu", "max_model_len": 2048, "kv_cache_memory": 0.25}
    p = plan(EngineConfig(**flags, enable_mtp=False))
    kv_one_sequence = -(-2048 // p.block_size) * p.block_size * p.kv_bytes_per_token
    parts = p.peak_rss_parts
    assert p.package_worker_bytes == (  # the build's part: the largest tensor's load (the embedding) is less
        parts["process"] + kv_one_sequence + peak_rss.PACKAGE_BUILD_BYTES + peak_rss.PACKAGE_COMPILER_BYTES
    )
    assert p.package_worker_bytes < parts["process"] + parts["weights"] + kv_one_sequence + (1 << 30)
    assert plan(EngineConfig(**flags, enable_mtp=False, executor="eager")).package_worker_bytes == 0
