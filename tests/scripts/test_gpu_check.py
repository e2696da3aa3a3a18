"""scripts/gpu_check.py --cpu-smoke: the GPU check's whole flow at toy sizes on the CPU (Triton
kernels under TRITON_INTERPRET=1, CUDA-only rows skipped), so the script a lent GPU runs once
is known to work before it gets there."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "gpu_check.py")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(out, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the script must set it itself, before triton is imported
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--cpu-smoke", "--out", str(out), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def table(md_text: str) -> dict[tuple[str, str], list[str]]:
    """(section, case) -> [status, result, notes] from the markdown table."""
    rows = {}
    for line in md_text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] not in ("section", "---"):
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


@pytest.mark.engine
def test_cpu_smoke_writes_every_row(tmp_path):
    out = tmp_path / "gpu.md"
    run(out)
    md = out.read_text()
    assert md.startswith("# ember GPU check") and "- device: cpu (cpu-smoke)" in md
    rows = table(md)
    expected = load_script().all_cases()
    # 2 env, 12 + 6 GDN kernels, 4 attention, 2 ttft, 4 models x 5, 2 MTP rows, 4 hybrids x 5 + a 32K prefill,
    # Flash-Next's build and 3 placements
    assert len(expected) == 73
    missing = [c for c in expected if c not in rows]
    assert not missing, missing
    for key, (status, result, notes) in rows.items():
        if status == "skipped":  # on a CPU only the CUDA-only parts (and kernels not yet there) may be skipped
            assert "needs CUDA" in notes or (key[1].startswith("GDN ") and "not present" in notes), (key, notes)
        else:
            assert status == "ok", (key, status, result, notes)
    # Kernel rows carry their errors; the toy decode runs measured something.
    assert rows[("kernels", "decode split-KV fp8-e4m3 q_len 4")][1].startswith("max abs err")
    assert rows[("kernels", "KV store fp8-e4m3")][1] == "0 of 24576 bytes differ"
    assert "max_abs_diff" in rows[("attention", "split-KV vs SDPA ctx 128K")][1]
    assert "tok/s" in rows[("qwen3-30b-a3b", "Qwen3-30B-A3B (8/48 layers) decode eager b8")][1]
    assert rows[("qwen3-8b", "Qwen3-8B decode cuda-graph b1")][0] == "skipped"
    # the random MTP layer loaded and verified drafts (k = 1 pinned: one draft per step)
    status, result, notes = rows[("qwen3-0.6b", "Qwen3-0.6B decode eager+mtp b1")]
    assert "tok/s" in result and "MTP k=1 pinned" in notes and " 0 verify steps" not in notes, notes
    assert rows[("qwen3-0.6b", "Qwen3-0.6B decode cuda-graph+mtp b1")][0] == "skipped"
    # the hybrid shapes: decode, a verify of 1 + k tokens every step (fixed drafts), prefill; AWQ loaded
    status, result, notes = rows[("hybrid", "Qwen3.5-0.8B verify k=1..3 b1")]
    assert result.startswith("k=1 ") and "a decode step" in result and "steps with drafts 0/" not in notes, notes
    assert "tok/s" in rows[("hybrid", "Qwen3-Next-80B-A3B (4/48 layers) decode b16")][1]
    assert "tok/s" in rows[("hybrid", "Qwen3.5-0.8B AWQ decode b1")][1]
    assert "tok/s" in rows[("hybrid", "Qwen3.5-0.8B prefill 32K")][1]
    # Flash-Next: every expert on the "card", then the first 2 MoE layers' in host memory, then with the hot cache
    label = "Flash-Next (4/48 layers, 128/512 experts)"
    split = rows[("flash-next", f"{label} decode --n-cpu-moe 2 b1")]
    assert "tok/s" in split[1] and "MoE layers [0, 1] in host memory" in split[2] and "greedy tokens" in split[2]
    assert "hit rate" in rows[("flash-next", f"{label} decode --n-cpu-moe 2 + hot cache b1")][2]
    gdn_status, gdn_result, _ = rows[("kernels", "GDN rule varlen prefill 2K")]
    assert gdn_status == "skipped" or gdn_result.startswith("o rel err"), gdn_result
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["smoke"] and len(data["rows"]) == len(rows)
    assert [s["section"] for s in data["sections"]] == load_script().SECTIONS


def test_over_budget_sections_are_skipped_with_a_row(tmp_path):
    """Budget 0: nothing after the env rows runs, yet every row is in the table, saying why."""
    out = tmp_path / "gpu.md"
    run(out, "--budget-s", "0", "--only", "env,kernels,qwen3-8b,ttft")
    rows = table(out.read_text())
    assert rows[("env", "machine")][0] == "ok"
    for key in [
        ("kernels", "AWQ GEMM M=1"),
        ("qwen3-8b", "Qwen3-8B build"),
        ("ttft", "Qwen3-0.6B TTFT 32K, chunked prefill off"),
    ]:
        status, _, notes = rows[key]
        assert status == "skipped" and "over budget" in notes, (key, notes)
    assert not any(s == "qwen3-0.6b" for s, _ in rows)  # --only


@pytest.mark.parametrize("key", ["qwen3-0.6b", "qwen3-8b", "qwen3-8b-awq", "qwen3-30b-a3b"])
def test_real_shapes_load_on_meta(key, tmp_path):
    """The GPU run's real-shape folders (config.json + every tensor's name and shape) load into
    ember's model: built on the meta device, so 16 GB of weights cost nothing here."""
    import torch

    from ember.bench.lib import random_model as rm
    from ember.config.model_config import ModelConfig
    from ember.kernels.torch_attention import TorchAttentionBackend
    from ember.models.registry import get_model_class
    from ember.quant import resolve_quant_config

    gc = load_script()
    assert not gc.SMOKE
    spec = gc.model_spec(key)
    (tmp_path / "config.json").write_text(json.dumps(rm.hf_config(spec)))
    cfg = ModelConfig.from_folder(str(tmp_path))
    quant = resolve_quant_config("auto", str(tmp_path), cfg.raw)
    assert (quant is not None) == ("awq_group" in spec)
    meta = torch.device("meta")
    with meta:
        model = get_model_class(cfg.architecture)(
            cfg, dtype=torch.bfloat16, device=meta, attn_backend=TorchAttentionBackend(), quant_config=quant
        )
    nbytes = 0
    names = []
    for name, t in rm.model_tensors(spec, meta):
        nbytes += t.numel() * t.element_size()
        names.append(name)
    model.load_weights(rm.model_tensors(spec, meta))  # raises on a missing or wrongly shaped tensor
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    # every tensor loads into the model but the MTP layer's (after the decoder; enable_mtp loads those)
    mtp_prefixes = tuple(f"model.layers.{cfg.num_layers + j}." for j in range(spec.get("mtp_layers", 0)))
    main = [n for n in names if not n.startswith(mtp_prefixes)]
    assert len(names) - len(main) == (15 if mtp_prefixes else 0)  # 3 norms + eh_proj + an 11-tensor block
    assert all(model.route_weight(n, params, modules) is not None for n in main)  # none ignored
    assert len(names) == len(set(names))
    assert abs(nbytes - rm.estimate_bytes(spec)) < 0.01 * nbytes
    want_gb = {"qwen3-0.6b": 1.2, "qwen3-8b": 16.4, "qwen3-8b-awq": 6.1, "qwen3-30b-a3b": 11.2}[key]
    assert abs(nbytes / 1e9 - want_gb) < 0.05 * want_gb, nbytes / 1e9
