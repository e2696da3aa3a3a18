#!/usr/bin/env python
"""ember GPU check: one script, run once on a lent GPU, that prints one markdown table.

How to run (on a lent CUDA machine: no internet, nothing is downloaded; models are built here
from random weights of real shapes):

    python scripts/gpu_check.py --out benchmarks/gpu.md

(through the device tool, whose files come back from $OUT only:
 `PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out $OUT/gpu.md 2>&1 | tee $OUT/log`, timeout_s 600,
 then copy gpu.md / gpu.json into benchmarks/). It needs torch (CUDA), triton, safetensors,
tokenizers, jinja2, tqdm and numpy: the lent machine's image has them; ember comes from this
checkout (the script puts the repo root first on sys.path).

It prints each row as it is measured and rewrites --out (markdown: date, GPU name, the table)
and the JSON next to it (benchmarks/gpu.json) after every section, so a run that is cut short
still leaves what it measured. Without a GPU:

    python scripts/gpu_check.py --cpu-smoke --out /tmp/gpu.md

runs the same flow at toy sizes on the CPU (Triton kernels under TRITON_INTERPRET=1, CUDA-only
rows say "skipped: needs CUDA"); tests/scripts/test_gpu_check.py runs that in CI.

Sections and rows (in run order; names are the same in both modes, toy sizes say so in notes):
  env       machine: GPU, CUDA, torch, triton, ember commit.
            d2d copy: device-to-device copy of 1 GiB, (read + write) bytes / s; the roofline the
            decode rows are compared against.
  kernels   every Triton kernel against the torch reference ON THE GPU, with max errors
            (relative to max|ref|, tolerances as in tests/kernels): split-KV decode (bf16 and fp8
            e4m3 KV; q_len 1 and a 4-token verify), varlen prefill (a mixed step: fresh prompt,
            decode, chunks over a cached prefix; bf16 and fp8), KV store (bit-exact with the
            torch write, bf16 and fp8), AWQ GEMM (M = 1 / 8 / 64) and AWQ dequantize (bit-exact);
            the Gated DeltaNet kernels (ember/kernels/triton_gated_delta_net.py: rows that say "not
            present" while it is not there) against GatedDeltaNet's torch path at Qwen3.5-0.8B's layer
            (Hk = Hv = 16, dk = dv = 128, conv K 4, bf16, fp32 state): the rule and the conv + SiLU
            at decode batch 1 and 16 and a varlen prefill of 2,048 tokens (5 sequences, 2 new), each
            with its output and written-state errors and triton ms vs torch ms.
  attention ember.bench.lib.triton_kernels.bench_decode_attention: Triton split-KV decode vs torch
            SDPA over the gathered (padded) KV, batch 8, 32/8 heads, D 128, at 4K / 32K / 128K
            context (+ an fp8 KV row at 32K); ms each, speedup, KV GB/s, max_abs_diff.
  models    Qwen3-0.6B and Qwen3-8B shapes (dense bf16), Qwen3-8B shape as int4 AWQ (GEMM layout,
            group 128), and Qwen3-30B-A3B's layer shape with 8 of its 48 layers (the full model is
            61 GB of random safetensors: minutes to write and load; per-layer cost is what it
            measures). Random weights written as an HF folder (safetensors + a word-level
            tokenizer of the real vocab size) in /dev/shm (or the temp dir), deleted afterwards.
            Rows per model: build (GB written, seconds); decode tok/s at batch 1 and 8, eager
            (enforce_eager=True) and CUDA graphs (enforce_eager=False, the engine's default on
            CUDA; the executor the engine reports is in the notes; an error is recorded in the row);
            each decode row also gives the weight bytes the step reads per second and that as a
            share of the d2d copy bandwidth (MoE: active experts only, uniform routing assumed).
            decode tok/s = batch / median step time over 128 new tokens after a 32-token prompt.
            Qwen3-0.6B also carries a random MTP layer (DeepSeek-V3 layout): "+mtp" rows decode at
            batch 1 with MTP, k = 1 pinned, eager and on CUDA graphs (the MTP fill captured with
            the main graphs); a random layer's drafts are rejected, so these rows price a verify
            step and check that it replays from a graph, they do not show a speedup.
  ttft      Qwen3-0.6B shape: time to first token of a fresh 32K-token prompt with chunked
            prefill at 2,048 tokens per step vs off (one 32K step); best of 2 after a warmup.
  hybrid    Gated DeltaNet hybrids from random weights of real shapes, written by `ember bench hybrid`'s
            builder (transformers, weights drawn on the GPU; a word-level tokenizer): Qwen3.5-0.8B
            (whole, bf16), Qwen3.5-27B's layer and Qwen3-Next-80B-A3B's (MoE 512 experts top-10 + a
            shared expert) with 4 layers each (3 linear attention + 1 full: per-layer cost), and the
            0.8B folder as int4 AWQ (GEMM, group 128; in_proj_b / in_proj_a, the conv, A_log and
            dt_bias stay dense). One engine per model (the engine's default executor: eager for
            hybrids); rows: build (GB, s); decode tok/s at batch 1 and 16 (64 new tokens after a
            32-token prompt, as the models rows count); verify k=1..3: the median step time of a
            batch-1 step verifying 1 + k tokens (a proposer that drafts k copies of the last token
            every step, on the n-gram path, adaptive k off) over a plain decode step of the same
            engine (no drafts; the engine is built with that speculation config, so the decode and
            prefill rows run with a proposer that drafts nothing); prefill tok/s = prompt / TTFT of a
            fresh 2K prompt (and 32K for the 0.8B), the engine's chunked prefill (2,048 a step),
            best of 2 after a 2K warmup. Expected ~150 s on an H200 (cap 200 s).
  flash-next  Qwen3.8-Flash-Next's layer shape (qwen4_exp: hyper-connections, PLE on one layer, QSA, 10 of 128
            experts + a shared one; 4 of its 48 layers, the real vocabulary; FLASH_NEXT), random bf16 from
            transformers: build, then decode tok/s at batch 1 (eager; 64 new tokens after a 32-token prompt) with
            every expert on the card, with --n-cpu-moe 2 (the first 2 MoE layers' experts in host memory, mapped
            from the folder and run on the CPU, no hot cache) and with --n-cpu-moe 2 and the hot-expert cache
            (sized from what the KV pool leaves); notes: the placement, the cache's hit rate, and how many of
            16 greedy tokens equal the all-on-card run's (host experts run in another precision path: a
            random model may part ways). Expected ~90 s on an H200 (cap 150 s): --only env,flash-next.

Time budget: the whole run must finish within 8 minutes on an H200 (--budget-s 480). Each
section has a cap (SECTION_CAPS); a step that would start past its section's cap or the total
budget is skipped with a row that says so, and every section runs in its own try/except, so a
failure loses only its own rows. A watchdog writes the files and exits if the run hangs past the
budget + 90 s. GPU memory is freed between models (del + gc + torch.cuda.empty_cache()).
--only env,kernels,... reruns some sections (--only env,kernels,hybrid: the hybrid checks alone, ~4 min).
"""

from __future__ import annotations

import os
import sys

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:  # before anything imports triton: @triton.jit reads it at decoration time
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this checkout's ember, not an installed one

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import weakref  # noqa: E402

import torch  # noqa: E402

from ember.bench.commands.hybrid import QWEN35_08B  # noqa: E402
from ember.bench.lib.random_model import QWEN3, build_model  # noqa: E402

E4M3 = torch.float8_e4m3fn
NEEDS_CUDA = "skipped: needs CUDA"
SECTION_CAPS = {
    "env": 20,
    "kernels": 75,
    "attention": 60,
    "qwen3-0.6b": 95,
    "ttft": 45,
    "qwen3-8b": 90,
    "qwen3-8b-awq": 75,
    "qwen3-30b-a3b": 75,
    "hybrid": 200,
    "flash-next": 150,
}  # seconds; sum 885 > 480, the total budget rules (--only env,kernels,hybrid: 295; --only env,flash-next: 170)
SECTIONS = list(SECTION_CAPS)
PROMPT_LEN = 32
HYBRID_NEW_TOKENS = 8 if SMOKE else 64

# Real shapes (the models' config.json), and toy ones for --cpu-smoke.
MODELS = {
    "qwen3-0.6b": dict(
        QWEN3,
        label="Qwen3-0.6B",
        hidden=1024,
        inter=3072,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        tie=True,
        mtp_layers=1,
    ),  # + a random MTP layer for the "+mtp" rows
    "qwen3-8b": dict(
        QWEN3, label="Qwen3-8B", hidden=4096, inter=12288, layers=36, heads=32, kv_heads=8, head_dim=128, tie=False
    ),
    "qwen3-8b-awq": dict(
        QWEN3,
        label="Qwen3-8B AWQ",
        hidden=4096,
        inter=12288,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        tie=False,
        awq_group=128,
    ),
    # Qwen3-30B-A3B: 48 layers; 8 of them here (see the module docstring).
    "qwen3-30b-a3b": dict(
        QWEN3,
        arch="Qwen3MoeForCausalLM",
        label="Qwen3-30B-A3B (8/48 layers)",
        hidden=2048,
        inter=6144,
        layers=8,
        heads=32,
        kv_heads=4,
        head_dim=128,
        tie=False,
        experts=128,
        top_k=8,
        moe_inter=768,
    ),
}
TOY = dict(vocab=512, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, max_pos=40960)
TOY_OVERRIDES = {
    "qwen3-8b-awq": dict(hidden=128, inter=256, head_dim=32, awq_group=32),
    "qwen3-30b-a3b": dict(experts=8, top_k=2, moe_inter=32),
}

log = logging.getLogger("gpu_check")


# -- report ------------------------------------------------------------------------------------


class Report:
    """Rows in run order; rewrites the markdown and JSON files after every section."""

    def __init__(self, out: str, device_name: str, args):
        self.out, self.device_name, self.args = out, device_name, args
        self.rows: list[dict] = []
        self.sections: list[dict] = []
        self.machine: dict = {}
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    def add(self, section: str, case: str, status: str, result: str = "", notes: str = "", **data) -> dict:
        row = dict(section=section, case=case, status=status, result=result, notes=notes, data=data)
        with self.lock:
            self.rows.append(row)
        print(f"| {section} | {case} | {status} | {result} | {notes} |", flush=True)
        return row

    def markdown(self) -> str:
        mode = "cpu-smoke (toy sizes, Triton interpreter; not a measurement)" if SMOKE else "GPU"
        lines = [
            "# ember GPU check",
            "",
            f"- date: {self.date}",
            f"- device: {self.device_name}",
            f"- mode: {mode}",
            f"- command: `python scripts/gpu_check.py {' '.join(sys.argv[1:])}`",
            f"- ember commit: {self.machine.get('ember_commit') or '-'}; torch {torch.__version__}; "
            f"triton {self.machine.get('triton') or '-'}",
            f"- total time: {time.monotonic() - self.t0:.0f} s (budget {self.args.budget_s:.0f} s)",
            "",
            "| section | case | status | result | notes |",
            "|---|---|---|---|---|",
        ]
        for r in self.rows:
            cells = [r["section"], r["case"], r["status"], r["result"], r["notes"]]
            lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
        lines += [
            "",
            "Notes: weights are random (N(0, 0.02); AWQ: random int4 codes), so tok/s and TTFT are "
            "the engine's speed at these shapes, not any model's output quality. Qwen3-30B-A3B runs 8 of "
            "its 48 layers at the real layer shape (decode time per layer is what transfers). Decode "
            "tok/s = batch / median step time; weights GB/s = weight bytes one decode step reads (not "
            "the embedding lookup; MoE: active experts, uniform routing assumed) per second, and its "
            "share of the measured d2d copy rate (read + write bytes / s). Hybrid rows: weights drawn by "
            "transformers (N(0, 0.02), A_log ~ U(-2, 1.5)); the 27B and 80B-A3B shapes run 4 of their layers "
            "(3 linear attention + 1 full); verify rows divide a step verifying 1 + k drafts by a plain decode step.",
        ]
        lines += ["", "| section | elapsed s | cap s | GPU GiB allocated after |", "|---|---|---|---|"]
        lines += [
            f"| {s['section']} | {s['elapsed_s']:.1f} | {s['cap_s']:.0f} | "
            f"{'-' if s['gpu_gib_allocated_after'] is None else format(s['gpu_gib_allocated_after'], '.2f')} |"
            for s in self.sections
        ]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        with self.lock:
            os.makedirs(os.path.dirname(os.path.abspath(self.out)), exist_ok=True)
            with open(self.out, "w") as f:
                f.write(self.markdown())
            blob = dict(
                date=self.date,
                device=self.device_name,
                smoke=SMOKE,
                argv=sys.argv[1:],
                total_s=time.monotonic() - self.t0,
                machine=self.machine,
                sections=self.sections,
                rows=self.rows,
            )
            with open(json_path(self.out), "w") as f:
                json.dump(blob, f, indent=1, default=str)
                f.write("\n")


def json_path(md: str) -> str:
    root, _ = os.path.splitext(md)
    return root + ".json"


class Section:
    """One section's rows and clock. `planned` names every row it should produce: whatever a
    failure or the budget left out still gets a row, so the table always has all of them."""

    def __init__(self, report: Report, name: str, cap_s: float, deadline: float, planned: list[str]):
        self.report, self.name, self.planned = report, name, planned
        self.t0 = time.monotonic()
        self.deadline = min(self.t0 + cap_s, deadline)
        self.cap_s = cap_s
        self.done: set[str] = set()

    def add(self, case: str, status: str, result: str = "", notes: str = "", **data) -> None:
        self.done.add(case)
        self.report.add(self.name, case, status, result, notes, **data)

    def over(self) -> bool:
        return time.monotonic() > self.deadline

    def skip_if_over(self, *cases: str) -> bool:
        """True (and rows for `cases`) when the section is past its cap or the total budget."""
        if not self.over():
            return False
        for c in cases:
            self.add(
                c,
                "skipped",
                notes=f"skipped: over budget ({time.monotonic() - self.t0:.0f} s into the "
                f"section, cap {self.cap_s:.0f} s)",
            )
        return True

    def finish(self, error: BaseException | None) -> None:
        for c in self.planned:
            if c not in self.done:
                why = f"not run: section failed earlier ({_err(error)})" if error else "not run"
                self.add(c, "error" if error else "skipped", notes=why)
        if error is not None and not self.planned:
            self.add("section", "error", notes=_err(error))
        mem = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
        self.report.sections.append(
            dict(section=self.name, elapsed_s=time.monotonic() - self.t0, cap_s=self.cap_s, gpu_gib_allocated_after=mem)
        )
        print(f"-- section {self.name}: {time.monotonic() - self.t0:.1f} s", flush=True)


def _err(e: BaseException | None) -> str:
    if e is None:
        return ""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def free_memory() -> None:
    """gc + empty_cache; never raises (after a sticky CUDA error the rows say so, the run goes on)."""
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            print(f"free_memory: {_err(e)}", file=sys.stderr, flush=True)


# -- timing helpers ------------------------------------------------------------------------------


def time_ms(fn, iters: int, warmup: int, device: torch.device) -> float:
    from ember.bench.lib.triton_kernels import time_ms as median_ms

    return median_ms(fn, iters, warmup, device)


def copy_bandwidth(device: torch.device) -> float:
    """(read + write) bytes / s of a device-to-device copy of 1 GiB (64 MiB on the CPU)."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=20 if device.type == "cuda" else 5, warmup=3, device=device)
    return 2 * n / (ms / 1000)


# -- env ---------------------------------------------------------------------------------------


def section_env(sec: Section, ctx: dict) -> None:
    from ember.bench.lib.machine import machine_info

    m = machine_info()
    try:
        import triton

        m["triton"] = triton.__version__
    except ImportError:
        m["triton"] = None
    dev = ctx["device"]
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        m.update(
            gpu=p.name,
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
            cuda=torch.version.cuda,
        )
    sec.report.machine = m
    gpu = (
        f"{m['gpu']} ({m['gpu_memory_gib']} GiB, sm_{m['capability'].replace('.', '')}, {m['sms']} SMs), CUDA {m['cuda']}"
        if dev.type == "cuda"
        else "no GPU (cpu-smoke)"
    )
    import ember

    sec.add(
        "machine",
        "ok",
        gpu,
        f"torch {torch.__version__}, triton {m['triton']}, ember {m.get('ember_commit')} "
        f"from {os.path.dirname(ember.__file__)}, {m['cpu']} x{m['usable_cores']}",
    )
    bw = copy_bandwidth(dev)
    ctx["copy_bps"] = bw
    sec.add(
        "d2d copy bandwidth",
        "ok",
        f"{bw / 1e9:.0f} GB/s",
        "(read + write) bytes / s, 1 GiB copy"
        if dev.type == "cuda"
        else "(read + write) bytes / s, 64 MiB memcpy on the CPU",
        copy_bps=bw,
    )


# -- kernel correctness ----------------------------------------------------------------------


def paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_dtype, device, seed=0):
    """A varlen step over a paged cache with shuffled block tables; the step's own k/v are read
    back from the cache (what the reference backend is given)."""
    from ember.kernels.metadata import AttentionMetadata
    from ember.layers.attention import quantize_kv

    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in blocks:
        tables.append(perm[i : i + n])
        i += n
    width = max(blocks) + 1  # wider than needed, padded with block 0
    raw = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 3
    fp8 = kv_dtype == E4M3
    k_scale = v_scale = None
    if fp8:  # as calibration sets them: max|x| / 200 (K), / 100 (V) for x ~ 3 * randn
        k_scale, v_scale = torch.tensor(12.0 / 200), torch.tensor(12.0 / 100)
        cache = torch.stack([quantize_kv(raw[0], k_scale, kv_dtype), quantize_kv(raw[1], v_scale, kv_dtype)])
    else:
        cache = raw.to(kv_dtype)
    slots = []
    for n, s, bt in zip(q_lens, seq_lens, tables):
        slots += [bt[p // block_size] * block_size + p % block_size for p in range(s - n, s)]
    T = sum(q_lens)
    q = torch.randn(T, num_heads, head_dim, generator=g).to(dtype)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    k = cache[0].flatten(0, 1)[slot_t]
    v = cache[1].flatten(0, 1)[slot_t]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=slot_t.to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        block_size=block_size,
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return mv(q), mv(k), mv(v), mv(cache), meta, mv(k_scale), mv(v_scale)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    err = (out.float() - ref.float()).abs().max().item()
    return err, err / max(ref.float().abs().max().item(), 1e-30)


def check_row(sec: Section, case: str, out, ref, tol: float, notes: str) -> None:
    finite = bool(torch.isfinite(out.float()).all())
    err, rel = rel_err(out, ref)
    ok = finite and rel <= tol
    sec.add(
        case,
        "ok" if ok else "FAIL",
        f"max abs err {err:.3g}, rel {rel:.2e} (tol {tol:g})",
        notes + ("" if finite else "; NON-FINITE output"),
        max_abs_err=err,
        rel_err=rel,
        tol=tol,
    )


KERNEL_CASES = [
    "decode split-KV bf16 q_len 1",
    "decode split-KV fp8-e4m3 q_len 1",
    "decode split-KV bf16 q_len 4",
    "decode split-KV fp8-e4m3 q_len 4",
    "varlen prefill bf16",
    "varlen prefill fp8-e4m3",
    "KV store bf16",
    "KV store fp8-e4m3",
    "AWQ GEMM M=1",
    "AWQ GEMM M=8",
    "AWQ GEMM M=64",
    "AWQ dequantize",
]


def section_kernels(sec: Section, ctx: dict) -> None:
    from ember.kernels.torch_attention import TorchAttentionBackend
    from ember.kernels.triton_decode import paged_decode_attention
    from ember.kernels.triton_kv_store import store_kv
    from ember.kernels.triton_prefill import paged_prefill_attention

    dev = ctx["device"]
    ref_backend = TorchAttentionBackend()
    if SMOKE:
        heads, kv_heads, D = 6, 2, 16
        decode_lens, prefill = [37, 5, 70], ([20, 1, 13, 33], [20, 40, 50, 50])
    else:
        heads, kv_heads, D = 32, 8, 128
        decode_lens, prefill = [1000, 4097, 37, 8192], ([700, 1, 300, 2048], [700, 2000, 1300, 4096])
    shape = f"heads {heads}/{kv_heads}, D {D}, block 16"

    def attention_case(case, kernel, q_lens, seq_lens, kv_dtype, seed):
        if sec.skip_if_over(case):
            return
        try:
            q, k, v, cache, meta, ks, vs = paged_case(
                q_lens, seq_lens, heads, kv_heads, D, 16, torch.bfloat16, kv_dtype, dev, seed
            )
            scale = D**-0.5
            ref = ref_backend.forward(q, k, v, cache, meta, scale, *((ks, vs) if ks is not None else ()))
            out = torch.zeros_like(q)
            if kernel == "decode":
                paged_decode_attention(
                    q,
                    cache,
                    meta.block_tables,
                    meta.seq_lens,
                    meta.query_start_loc,
                    meta.max_query_len,
                    meta.max_seq_len,
                    q.shape[0],
                    scale,
                    out,
                    ks,
                    vs,
                )
            else:
                paged_prefill_attention(
                    q,
                    cache,
                    meta.block_tables,
                    meta.seq_lens,
                    meta.query_start_loc,
                    meta.max_query_len,
                    scale,
                    out,
                    ks,
                    vs,
                )
            # bf16: the reference's own roundings (tests/kernels/test_triton_attention.py)
            check_row(sec, case, out, ref, 1.5e-2, f"q_lens {q_lens}, seq_lens {seq_lens}, {shape}")
        except Exception as e:
            sec.add(case, "error", notes=_err(e))
            traceback.print_exc()

    for kv_name, kv_dtype in (("bf16", torch.bfloat16), ("fp8-e4m3", E4M3)):
        attention_case(f"decode split-KV {kv_name} q_len 1", "decode", [1] * len(decode_lens), decode_lens, kv_dtype, 1)
    for kv_name, kv_dtype in (("bf16", torch.bfloat16), ("fp8-e4m3", E4M3)):
        attention_case(f"decode split-KV {kv_name} q_len 4", "decode", [4] * len(decode_lens), decode_lens, kv_dtype, 2)
    for kv_name, kv_dtype in (("bf16", torch.bfloat16), ("fp8-e4m3", E4M3)):
        attention_case(f"varlen prefill {kv_name}", "prefill", *prefill, kv_dtype, 3)

    # KV store: bit-exact with the layer's torch path (quantize_kv + write_kv_cache), -1 slots untouched.
    from ember.layers.attention import quantize_kv, write_kv_cache

    T, num_blocks = (21, 24) if SMOKE else (4096, 512)
    for kv_name, kv_dtype in (("bf16", torch.bfloat16), ("fp8-e4m3", E4M3)):
        case = f"KV store {kv_name}"
        if sec.skip_if_over(case):
            continue
        try:
            g = torch.Generator().manual_seed(0)
            k = (torch.randn(T, kv_heads, D, generator=g) * torch.logspace(-4, 1, D)).to(torch.bfloat16)
            v = (torch.randn(T, kv_heads, D, generator=g) * 40).to(torch.bfloat16)  # fp8: some clamp
            ks, vs = torch.tensor(0.01, device=dev), torch.tensor(0.05, device=dev)
            slots = torch.randperm(num_blocks * 16, generator=g)[:T]
            slots[::7] = -1
            cache = torch.randn(2, num_blocks, 16, kv_heads, D, generator=g).to(kv_dtype).to(dev)
            k, v, slots = k.to(dev), v.to(dev), slots.to(dev)
            expected = cache.clone()
            fp8 = kv_dtype == E4M3
            if fp8:
                write_kv_cache(quantize_kv(k, ks, kv_dtype), quantize_kv(v, vs, kv_dtype), expected, slots)
                store_kv(k, v, cache, slots, ks, vs)
            else:
                write_kv_cache(k, v, expected, slots)
                store_kv(k, v, cache, slots)
            diff = int((cache.view(torch.uint8) != expected.view(torch.uint8)).sum())
            sec.add(
                case,
                "ok" if diff == 0 else "FAIL",
                f"{diff} of {cache.numel()} bytes differ",
                f"{T} tokens (every 7th slot -1), {kv_heads} kv heads, D {D}; bf16 k/v in",
                differing_bytes=diff,
            )
        except Exception as e:
            sec.add(case, "error", notes=_err(e))
            traceback.print_exc()

    # AWQ: the GEMM against x @ (exactly dequantized W in x's dtype), fp32 sums.
    from ember.kernels import triton_awq
    from ember.quant.awq_packing import dequantize_awq

    K, N, G = (128, 72, 32) if SMOKE else (4096, 12288, 128)
    g = torch.Generator().manual_seed(0)
    qweight = torch.randint(-(2**31), 2**31, (K, N // 8), generator=g, dtype=torch.int64).to(torch.int32).to(dev)
    qzeros = torch.randint(-(2**31), 2**31, (K // G, N // 8), generator=g, dtype=torch.int64).to(torch.int32).to(dev)
    scales = (torch.rand(K // G, N, generator=g) * 0.01 + 0.001).half().to(dev)
    # The interpreter cannot run bf16 tl.dot (tests/kernels/test_triton_awq.py): fp32 there.
    gemm_dtypes = {1: torch.bfloat16, 8: torch.bfloat16, 64: torch.float16}
    for M, dtype in gemm_dtypes.items():
        case = f"AWQ GEMM M={M}"
        if sec.skip_if_over(case):
            continue
        if SMOKE and dtype == torch.bfloat16:
            dtype = torch.float32
        try:
            x = torch.randn(M, K, generator=g).to(dtype).to(dev)
            wd = dequantize_awq(qweight, qzeros, scales.float(), G)
            ref = x.float() @ wd.to(dtype).float()
            y = triton_awq.awq_gemm(x, qweight, qzeros, scales, G)
            tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
            check_row(sec, case, y, ref, tol, f"K {K}, N {N}, group {G}, {str(dtype).removeprefix('torch.')}")
        except Exception as e:
            sec.add(case, "error", notes=_err(e))
            traceback.print_exc()
    case = "AWQ dequantize"
    if not sec.skip_if_over(case):
        try:
            same = torch.equal(
                triton_awq.awq_dequantize(qweight, qzeros, scales, G), dequantize_awq(qweight, qzeros, scales, G)
            )
            sec.add(
                case,
                "ok" if same else "FAIL",
                "bit-exact" if same else "differs from the torch reference",
                f"fp16, K {K}, N {N}, group {G}",
            )
        except Exception as e:
            sec.add(case, "error", notes=_err(e))
            traceback.print_exc()
    section_gdn_kernels(sec, ctx)


# -- Gated DeltaNet kernels (Triton) against the torch path --------------------------------------

GDN_STEPS = ("decode b1", "decode b16", "varlen prefill 2K")
GDN_CASES = [f"GDN {op} {step}" for step in GDN_STEPS for op in ("rule", "conv")]
GDN_MODULE = "ember/kernels/triton_gated_delta_net.py"


def gdn_step(lens: list[int], news: list[int], dev: torch.device, seed: int) -> dict:
    """One step of Qwen3.5-0.8B's linear-attention layer (Hk = Hv = 16, dk = dv = 128, conv K = 4; toy
    heads under --cpu-smoke), bf16 like the layer: sequences of lens[i] tokens in shuffled slots of an
    fp32 SSM pool and a bf16 conv pool, the ones in `news` new (src -1); a / b views of one projection."""
    Hk, Hv, dk, dv, K = (2, 4, 16, 16, 4) if SMOKE else (16, 16, 128, 128, 4)
    g = torch.Generator().manual_seed(seed)
    N, T, C, bf = len(lens), sum(lens), 2 * Hk * dk + Hv * dv, torch.bfloat16
    dst = torch.randperm(N + 3, generator=g)[:N]
    src = dst.clone()
    src[news] = -1
    d = dict(
        x=torch.randn(T, C, generator=g).to(bf),
        qkv=torch.randn(T, C, generator=g).to(bf),
        ba=(torch.randn(T, 2 * Hv, generator=g) * 2).to(bf),
        A_log=(torch.rand(Hv, generator=g) * 2 - 1).to(bf),
        dt_bias=(torch.randn(Hv, generator=g) * 0.5).to(bf),
        weight=(torch.randn(C, K, generator=g) * 0.5).to(bf),
        state=torch.randn(N + 3, Hv, dk, dv, generator=g) * 0.3,
        conv=torch.randn(N + 3, C, K - 1, generator=g).to(bf),
        src=src,
        dst=dst,
        cu=torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32),
    )
    d = {k: v.to(dev) for k, v in d.items()}
    d.update(a=d["ba"][:, Hv:], b=d["ba"][:, :Hv], lens=lens, Hk=Hk, dk=dk)
    return d


def gdn_rule_ref(d: dict, state: torch.Tensor) -> torch.Tensor:
    """GatedDeltaNet's torch path, state written at dst: decode (one token each) by the recurrence,
    sequences batched; a prefill per sequence by the chunked form. Returns o [T, Hv * dv]."""
    import torch.nn.functional as F

    from ember.layers import gated_delta_rule as gdr

    Hk, dk, Hv, dv = d["Hk"], d["dk"], state.shape[1], state.shape[3]
    q, k, v = d["qkv"].split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    q, k = gdr.prepare_qk(q.reshape(-1, Hk, dk), k.reshape(-1, Hk, dk), Hv)
    v, beta = v.reshape(-1, Hv, dv), d["b"].sigmoid()
    g = -d["A_log"].float().exp() * F.softplus(d["a"].float() + d["dt_bias"])
    src = d["src"]
    s0 = torch.where((src >= 0)[:, None, None, None], state[src.clamp(min=0)], 0.0)
    if max(d["lens"]) == 1:
        o, s1 = gdr.recurrent(q[None], k[None], v[None], g[None], beta[None], s0)
        o = o[0]
    else:
        outs, finals = [], []
        cu = d["cu"].tolist()
        for i, (a, e) in enumerate(zip(cu, cu[1:])):
            o_i, s_i = gdr.chunked(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], s0[i])
            outs.append(o_i)
            finals.append(s_i)
        o, s1 = torch.cat(outs), torch.stack(finals)
    state[d["dst"]] = s1
    return o.reshape(o.shape[0], -1).to(d["qkv"].dtype)


def gdn_conv_ref(d: dict, conv: torch.Tensor) -> torch.Tensor:
    """The layer's conv + SiLU: the step form for decode, the window form per sequence for a
    prefill; the state written at dst."""
    from ember.layers import gated_delta_rule as gdr

    src, x, w = d["src"], d["x"], d["weight"]
    c0 = torch.where((src >= 0)[:, None, None], conv[src.clamp(min=0)], 0).to(conv.dtype)
    if max(d["lens"]) == 1:
        out, c1 = gdr.causal_conv_step(x, c0, w)
    else:
        outs, c1 = [], []
        cu = d["cu"].tolist()
        for i, (a, e) in enumerate(zip(cu, cu[1:])):
            o_i, window = gdr.causal_conv(x[a:e], c0[i], w)
            outs.append(o_i)
            c1.append(window[:, window.shape[1] - c0.shape[2] :])
        out, c1 = torch.cat(outs), torch.stack(c1)
    conv[d["dst"]] = c1
    return out


def gdn_kernel(tg, op: str, d: dict, pool: torch.Tensor) -> torch.Tensor:
    """The Triton op for this step, writing pool (the SSM or conv pool) at dst."""
    varlen = max(d["lens"]) > 1
    if op == "rule":
        args = (d["qkv"], d["a"], d["b"], d["A_log"], d["dt_bias"], pool)
        if varlen:
            return tg.gated_delta_net_varlen(*args, d["cu"], d["src"], d["dst"])
        return tg.gated_delta_net(*args, d["src"], d["dst"])
    if varlen:
        return tg.causal_conv1d_silu_varlen(d["x"], d["weight"], pool, d["cu"], d["src"], d["dst"])
    return tg.causal_conv1d_silu(d["x"], d["weight"], pool, d["src"], d["dst"])


def gdn_row(sec: Section, tg, op: str, step: str, d: dict, dev: torch.device) -> None:
    """Output and written state against the torch path (o: bf16 roundings; the fp32 SSM state: summation
    order, a chunked prefill's more; the conv state is a copy: bit-exact), then both timed on CUDA."""
    key = "state" if op == "rule" else "conv"
    ref_fn, ref_pool, pool = (gdn_rule_ref if op == "rule" else gdn_conv_ref), d[key].clone(), d[key].clone()
    ref = ref_fn(d, ref_pool)
    out = gdn_kernel(tg, op, d, pool)
    _, o_rel = rel_err(out, ref)
    dst = d["dst"]
    _, s_rel = rel_err(pool[dst], ref_pool[dst])
    s_tol = 0.0 if op == "conv" else (1e-2 if "prefill" in step else 1e-4)
    finite = bool(torch.isfinite(out.float()).all())
    ok = finite and o_rel <= 1.5e-2 and s_rel <= s_tol
    timing, data = f"timing: {NEEDS_CUDA}", {}
    if dev.type == "cuda":
        iters = 10 if "prefill" in step else 50
        k_ms = time_ms(lambda: gdn_kernel(tg, op, d, pool), iters, 3, dev)
        r_ms = time_ms(lambda: ref_fn(d, ref_pool), iters, 3, dev)
        timing, data = f"triton {k_ms:.3f} ms vs torch {r_ms:.3f} ms = {r_ms / k_ms:.1f}x", dict(ms=k_ms, torch_ms=r_ms)
    H = "Hk 2, Hv 4, dk = dv 16 (cpu-smoke toy)" if SMOKE else "Hk 16, Hv 16, dk = dv 128"
    sec.add(
        f"GDN {op} {step}",
        "ok" if ok else "FAIL",
        f"o rel err {o_rel:.2e} (tol 1.5e-02), state rel err {s_rel:.2e} (tol {s_tol:g}); {timing}",
        f"{len(d['lens'])} sequences, {sum(d['lens'])} tokens ({sum(s < 0 for s in d['src'].tolist())} new), "
        f"{H}, conv K 4, bf16" + ("" if finite else "; NON-FINITE output"),
        rel_err=o_rel,
        state_rel_err=s_rel,
        **data,
    )


def section_gdn_kernels(sec: Section, ctx: dict) -> None:
    """The GDN rows of the kernels section: skipped with a note while the Triton module is not there."""
    try:
        from ember.kernels import triton_gated_delta_net as tg
    except ImportError as e:
        for c in GDN_CASES:
            sec.add(c, "skipped", notes=f"not present: {GDN_MODULE} ({_err(e)})")
        return
    dev = ctx["device"]
    prefill = ([9, 4, 2, 1], [1, 3]) if SMOKE else ([1024, 512, 384, 127, 1], [1, 4])
    steps = {"decode b1": ([1], []), "decode b16": ([1] * (4 if SMOKE else 16), [1]), "varlen prefill 2K": prefill}
    for i, (step, (lens, news)) in enumerate(steps.items()):
        d = None
        for op in ("rule", "conv"):
            case = f"GDN {op} {step}"
            if sec.skip_if_over(case):
                continue
            try:
                d = d or gdn_step(lens, news, dev, seed=40 + i)
                gdn_row(sec, tg, op, step, d, dev)
            except Exception as e:
                sec.add(case, "error", notes=_err(e))
                traceback.print_exc()
        free_memory()


# -- decode attention bench ----------------------------------------------------------------

ATTN_CASES = [
    ("ctx 4K", 4096, torch.bfloat16),
    ("ctx 32K", 32768, torch.bfloat16),
    ("ctx 128K", 131072, torch.bfloat16),
    ("ctx 32K fp8-e4m3 KV", 32768, E4M3),
]


def section_attention(sec: Section, ctx: dict) -> None:
    dev = ctx["device"]
    for i, (case, context, kv_dtype) in enumerate(ATTN_CASES):
        case = f"split-KV vs SDPA {case}"
        if sec.skip_if_over(case):
            continue
        try:
            if dev.type == "cuda":
                from ember.bench.lib.triton_kernels import bench_decode_attention

                r = bench_decode_attention(
                    contexts=(context,),
                    batch_size=8,
                    num_heads=32,
                    num_kv_heads=8,
                    head_dim=128,
                    kv_dtype=kv_dtype,
                    iters=20,
                    warmup=3,
                )[0]
                # Random q, k, v ~ N(0, 1): scores ~ N(0, 1), so |out| has rms sqrt(e / context)
                # (0.026 at 4K, 0.0046 at 128K); a wrong kernel is off by about that, rounding by ~1%.
                tol = 0.1 * math.sqrt(math.e / context)
                ok = r["max_abs_diff"] <= tol
                sec.add(
                    case,
                    "ok" if ok else "FAIL",
                    f"triton {r['triton_ms']:.3f} ms vs SDPA {r['torch_ms']:.3f} ms = {r['speedup']:.2f}x",
                    f"{r['triton_gbps']:.0f} GB/s KV; max_abs_diff {r['max_abs_diff']:.3g} (tol {tol:.2g}); "
                    f"splits {r['num_splits']}; batch 8, heads 32/8, D 128",
                    tol=tol,
                    **r,
                )
            else:  # the same case builder, kernel and baseline at a toy size; no timing without CUDA events
                from ember.bench.lib.triton_kernels import decode_case, gathered_sdpa
                from ember.kernels.triton_decode import paged_decode_attention

                toy = 64 << i
                q, cache, meta, ks, vs = decode_case(2, toy, 4, 2, 16, 16, torch.bfloat16, kv_dtype, 1, dev)
                out = paged_decode_attention(
                    q,
                    cache,
                    meta.block_tables,
                    meta.seq_lens,
                    meta.query_start_loc,
                    1,
                    toy,
                    q.shape[0],
                    0.25,
                    torch.empty_like(q),
                    ks,
                    vs,
                )
                diff = (out.float() - gathered_sdpa(q, cache, meta, 0.25, ks, vs).float()).abs().max().item()
                sec.add(
                    case,
                    "skipped",
                    f"max_abs_diff {diff:.3g}",
                    f"{NEEDS_CUDA} (timing); toy context {toy}, batch 2, heads 4/2, D 16",
                    max_abs_diff=diff,
                )
        except Exception as e:
            sec.add(case, "error", notes=_err(e))
            traceback.print_exc()
        finally:
            free_memory()


# -- random-weight model folders -------------------------------------------------------------


def model_spec(key: str) -> dict:
    spec = dict(MODELS[key])
    if SMOKE:
        spec.update(TOY)
        spec.update(TOY_OVERRIDES.get(key, {}))
    return spec


# -- engine measurements -------------------------------------------------------------------


def make_llm(path: str, ctx: dict, **knobs):
    from ember import LLM

    kw = dict(dtype="bfloat16", device=ctx["device"].type, seed=0)
    if SMOKE:
        kw.update(kv_cache_memory=0.05, num_threads=1)
    else:
        kw.update(gpu_memory_utilization=0.5)  # leaves room should a freed engine linger
    kw.update(knobs)
    return LLM(path, **kw)


def executor_name(llm) -> str:
    ex = getattr(llm.engine.parts.runner, "executor", None)
    return type(ex).__name__ if ex is not None else "none (runner has no executor)"


def graph_replays(llm) -> int | None:
    """Steps the CUDA-graph executor ran from a graph so far (None: no such counter)."""
    return getattr(getattr(llm.engine.parts.runner, "executor", None), "replays", None)


def check_freed(sec: Section, engine_ref, what: str) -> None:
    """A row (FAIL) when a deleted engine is still alive: its KV pool would stay allocated and
    the next engine's memory budget would be wrong."""
    free_memory()
    if engine_ref() is not None:
        sec.add(
            f"{what} engine freed",
            "FAIL",
            "the engine is still referenced after del + gc",
            "its GPU memory (weights + KV pool) is not released",
        )


def engine_rows(sec: Section, cases: list[str], what: str, start, rows):
    """One engine's rows: start() builds it (an LLM), rows(llm, load_s) writes its rows and gives what this
    returns. Where either raises, every one of `cases` not written yet is an error row (None returned); the
    engine is shut down after and checked freed (its only reference is this frame's, dropped first)."""
    llm = engine_ref = None
    try:
        t = time.monotonic()
        llm = start()
        engine_ref = weakref.ref(llm.engine)
        return rows(llm, time.monotonic() - t)
    except Exception as e:  # the engine did not build (e.g. graph capture raised), or a row broke: say why
        for c in cases:
            if c not in sec.done:
                sec.add(c, "error", notes=f"engine: {_err(e)}")
        traceback.print_exc()
        return None
    finally:
        if llm is not None:
            llm.engine.shutdown()
        del llm
        if engine_ref is not None:
            check_freed(sec, engine_ref, what)
        free_memory()


def build_row(sec: Section, cases: list[str], build, notes) -> tuple[str, str] | None:
    """A random model's build row (cases[0]): build() gives (HF folder, scratch folder), the row its size and
    time, notes(path) its notes. Where the build raises, every one of `cases` is an error row and None returned."""
    t = time.monotonic()
    try:
        path, scratch = build()
        free_memory()
    except Exception as e:
        for c in cases:
            sec.add(c, "error", notes=f"build: {_err(e)}")
        traceback.print_exc()
        return None
    nbytes, seconds = folder_bytes(path), time.monotonic() - t
    sec.add(cases[0], "ok", f"{nbytes / 1e9:.2f} GB in {seconds:.1f} s", notes(path), bytes=nbytes, seconds=seconds)
    return path, scratch


def decode_row(sec: Section, llm, case: str, batch: int, new_tokens: int, vocab: int, notes, **data) -> float:
    """A decode row after a 4-token warmup: steady tok/s (mean), notes(steps) its notes (called after the run);
    returns the steady tok/s."""
    decode_rate(llm, batch, 4, vocab, seed=100 + batch)  # warmup: compile / capture this batch
    steady, mean, steps = decode_rate(llm, batch, new_tokens, vocab, seed=batch)
    sec.add(
        case,
        "ok",
        f"{steady:.1f} tok/s (mean {mean:.1f})",
        notes(steps),
        tok_s=steady,
        mean_tok_s=mean,
        steps=steps,
        **data,
    )
    return steady


def step_bytes(model: torch.nn.Module, s: dict, batch: int) -> float:
    """Weight bytes one decode step reads: every parameter (and CPU int4/int8 copy) except the
    embedding, which is a row lookup (a tied embedding is read whole as the head). MoE experts:
    only the active ones, with uniform routing: E * (1 - (1 - k/E)^batch) of E."""
    total = 0.0
    frac = 1.0
    if "experts" in s:
        E, k = s["experts"], s["top_k"]
        frac = 1 - (1 - k / E) ** batch
    for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if "int" in n]:
        if "embed_tokens" in name and not s["tie"]:
            continue
        total += t.numel() * t.element_size() * (frac if ".experts." in name else 1.0)
    return total


def decode_rate(llm, batch: int, new_tokens: int, vocab: int, seed: int) -> tuple[float, float, int]:
    """(steady tok/s = batch / median step time, mean tok/s, steps) over the decode steps after
    the step that prefilled every prompt and sampled its first token."""
    from ember.sampling import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        engine.add_request(
            None, {"prompt_token_ids": torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist()}, params
        )
    stamps = []
    while engine.has_unfinished_requests():
        engine.step()  # returns after sampling: the tokens are on the host, the step is done
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    if not gaps:
        raise RuntimeError("no decode steps")
    return batch / statistics.median(gaps), batch * len(gaps) / (stamps[-1] - stamps[0]), len(gaps)


MTP_K = 1  # the "+mtp" rows: MTP with one draft token per step, k pinned (a random layer's drafts are all
#            rejected, and adaptive k would stop drafting): they measure what a verify step with a captured
#            MTP fill costs and check that those steps run from graphs; acceptance is in the notes.


def decode_modes(key: str) -> list[tuple[str, tuple[int, ...]]]:
    """(mode, batches): eager and CUDA graphs at batch 1 and 8; + MTP at batch 1 where the shape has MTP layers."""
    modes = [("eager", (1, 8)), ("cuda-graph", (1, 8))]
    if MODELS[key].get("mtp_layers"):
        modes += [("eager+mtp", (1,)), ("cuda-graph+mtp", (1,))]
    return modes


def model_cases(key: str) -> list[str]:
    label = MODELS[key]["label"]
    return [f"{label} build"] + [f"{label} decode {mode} b{b}" for mode, batches in decode_modes(key) for b in batches]


def section_model(sec: Section, ctx: dict, key: str) -> None:
    s = model_spec(key)
    label = MODELS[key]["label"]
    dev = ctx["device"]
    toy = "; cpu-smoke: toy shape" if SMOKE else ""
    if sec.skip_if_over(*model_cases(key)):
        return
    t = time.monotonic()
    path, nbytes = build_model(s, dev)
    try:
        free_memory()
        sec.add(
            f"{label} build",
            "ok",
            f"{nbytes / 1e9:.2f} GB in {time.monotonic() - t:.1f} s",
            f"{s['layers']} layers, hidden {s['hidden']}, vocab {s['vocab']}, in {os.path.dirname(path)}{toy}",
            bytes=nbytes,
            seconds=time.monotonic() - t,
        )
        new_tokens = 8 if SMOKE else 128
        for mode, batches in decode_modes(key):
            cases = [f"{label} decode {mode} b{b}" for b in batches]
            graphs, mtp = mode.startswith("cuda-graph"), mode.endswith("+mtp")
            if graphs and dev.type != "cuda":
                for c in cases:
                    sec.add(c, "skipped", notes=NEEDS_CUDA)
                continue
            if sec.skip_if_over(*cases):
                continue
            llm = engine_ref = None
            try:
                t = time.monotonic()
                spec = dict(enable_mtp=True, num_speculative_tokens=MTP_K, adaptive_spec=False) if mtp else {}
                llm = make_llm(path, ctx, enforce_eager=not graphs, max_model_len=1024, max_num_seqs=8, **spec)
                engine_ref = weakref.ref(llm.engine)
                load_s = time.monotonic() - t
                ex = executor_name(llm)
                for b, case in zip(batches, cases):
                    if sec.skip_if_over(case):
                        continue
                    try:
                        decode_rate(llm, b, 4, s["vocab"], seed=100 + b)  # warmup: compile / capture this batch
                        r0 = graph_replays(llm)
                        drafts0 = llm.engine.stats().get("spec_num_drafts", 0)
                        steady, mean, steps = decode_rate(llm, b, new_tokens, s["vocab"], seed=b)
                        r1 = graph_replays(llm)
                        replays = "" if r0 is None else f"; {r1 - r0} of the {steps} decode steps ran from a graph"
                        if graphs and not (r0 is not None and r1 > r0):
                            replays += "; NOTE: no step ran from a CUDA graph"
                        if mtp:
                            st = llm.engine.stats()
                            acc = st.get("spec_acceptance_per_pos") or [0.0]
                            replays += (
                                f"; MTP k={MTP_K} pinned: {st.get('spec_num_drafts', 0) - drafts0} verify "
                                f"steps, acceptance {acc[0]:.2f} (random layer; with the warmup), "
                                f"mean accepted length {st.get('spec_mean_accepted_length', 0.0):.2f}"
                            )
                        wb = step_bytes(llm.engine.parts.loaded.model, s, b) * steady / b  # bytes / step * steps / s
                        share = wb / ctx["copy_bps"] if ctx.get("copy_bps") else None
                        of_copy = f"{100 * share:.3g}% of d2d copy" if share else "d2d copy not measured (env not run)"
                        sec.add(
                            case,
                            "ok",
                            f"{steady:.1f} tok/s (mean {mean:.1f})",
                            f"weights {wb / 1e9:.3g} GB/s = {of_copy}; {steps} steps; "
                            f"executor {ex}{replays}; engine built in {load_s:.1f} s{toy}",
                            tok_s=steady,
                            mean_tok_s=mean,
                            steps=steps,
                            weight_bps=wb,
                            copy_share=share,
                            executor=ex,
                            graph_replays=None if r0 is None else r1 - r0,
                            engine_s=load_s,
                        )
                    except Exception as e:
                        sec.add(case, "error", notes=f"{_err(e)}; executor {ex}")
                        traceback.print_exc()
            except Exception as e:  # the engine did not build (e.g. graph capture raised): say why
                for c in cases:
                    if c not in sec.done:
                        sec.add(c, "error", notes=f"engine: {_err(e)}")
                traceback.print_exc()
            finally:
                if llm is not None:
                    llm.engine.shutdown()
                del llm
                if engine_ref is not None:
                    check_freed(sec, engine_ref, f"{label} {mode}")
                free_memory()
    finally:
        shutil.rmtree(path, ignore_errors=True)


TTFT_CASES = ["Qwen3-0.6B TTFT 32K, chunked prefill 2048", "Qwen3-0.6B TTFT 32K, chunked prefill off"]


def section_ttft(sec: Section, ctx: dict) -> None:
    from ember.sampling import SamplingParams

    s = model_spec("qwen3-0.6b")
    dev = ctx["device"]
    prompt_len, chunk = (256, 64) if SMOKE else (32768, 2048)
    if sec.skip_if_over(*TTFT_CASES):
        return
    path, _ = build_model(s, dev)
    try:
        free_memory()
        max_len = prompt_len + 64
        for case, chunked in zip(TTFT_CASES, (True, False)):
            if sec.skip_if_over(case):
                continue
            llm = engine_ref = None
            try:
                knobs = (
                    dict(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
                    if chunked
                    else dict(enable_chunked_prefill=False, max_num_batched_tokens=max_len)
                )
                # eager: prefill never runs from a graph, and capture would only cost budget
                llm = make_llm(path, ctx, max_model_len=max_len, max_num_seqs=4, enforce_eager=True, **knobs)
                engine = llm.engine
                engine_ref = weakref.ref(engine)
                g = torch.Generator().manual_seed(7)
                params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
                times = []
                for r in range(3):  # run 0: warmup (kernel compiles) at the same length
                    prompt = torch.randint(3, s["vocab"], (prompt_len,), generator=g).tolist()
                    t = time.perf_counter()
                    engine.add_request(None, {"prompt_token_ids": prompt}, params)
                    while engine.has_unfinished_requests():
                        engine.step()
                    if r:
                        times.append(time.perf_counter() - t)
                    if sec.over():
                        break
                if not times:
                    raise RuntimeError("over budget before a timed run")
                sec.add(
                    case,
                    "ok",
                    f"{1000 * min(times):.0f} ms",
                    f"best of {len(times)} ({', '.join(f'{1000 * x:.0f}' for x in times)} ms); "
                    f"{prompt_len}-token prompt, "
                    + (f"{chunk} tokens per step" if chunked else "one step")
                    + "; enforce_eager"
                    + ("; cpu-smoke: toy shape and prompt" if SMOKE else ""),
                    ttft_s=min(times),
                    runs_s=times,
                )
            except Exception as e:
                sec.add(case, "error", notes=_err(e))
                traceback.print_exc()
            finally:
                if llm is not None:
                    llm.engine.shutdown()
                del llm
                engine = None  # noqa: F841 (drop the last reference before the check)
                if engine_ref is not None:
                    check_freed(sec, engine_ref, case)
                free_memory()
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- hybrid models (Gated DeltaNet + gated attention) -----------------------------------------------

LIN, FULL = "linear_attention", "full_attention"
QWEN35_27B = dict(
    QWEN35_08B,
    hidden_size=5120,
    num_hidden_layers=4,
    layer_types=[LIN] * 3 + [FULL],
    num_attention_heads=24,
    num_key_value_heads=4,
    linear_num_value_heads=48,
    intermediate_size=17408,
    tie_word_embeddings=False,
)  # Qwen3.5-27B's layer (64 layers: 48 linear / 16 full), 4 of them
QWEN3_NEXT_80B = dict(
    vocab_size=151936,
    hidden_size=2048,
    num_hidden_layers=4,
    layer_types=[LIN] * 3 + [FULL],
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    intermediate_size=5120,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=512,
    num_experts_per_tok=10,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)  # Qwen3-Next-80B-A3B's layer (48 layers: 36 linear / 12 full; MoE 512 experts top-10 + shared), 4 of them
HYBRIDS = {
    "qwen3.5-0.8b": dict(label="Qwen3.5-0.8B", arch="Qwen3_5", shape=dict(QWEN35_08B, max_position_embeddings=262144)),
    "qwen3.5-27b": dict(label="Qwen3.5-27B (4/64 layers)", arch="Qwen3_5", shape=QWEN35_27B),
    "qwen3-next-80b-a3b": dict(label="Qwen3-Next-80B-A3B (4/48 layers)", arch="Qwen3Next", shape=QWEN3_NEXT_80B),
    # int4 AWQ (GEMM, group 128) of the 0.8B folder: q/k/v/o, in_proj_qkv / in_proj_z, out_proj and the MLP
    # packed; in_proj_b / in_proj_a (the gates), the conv, A_log and dt_bias dense (hybrid.md, pitfall 5)
    "qwen3.5-0.8b-awq": dict(label="Qwen3.5-0.8B AWQ", arch="Qwen3_5", base="qwen3.5-0.8b", awq_group=128),
}
HYBRID_TOY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=[LIN] * 3 + [FULL],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
)
AWQ_QUANTIZED = re.compile(r"\.((q|k|v|o|gate|up|down)_proj|in_proj_qkvz?|in_proj_z|out_proj)\.weight$")
AWQ_DENSE = [
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_ba",
    "mlp.gate",
    "shared_expert_gate",
]
VERIFY_K = (1, 2, 3)


def hybrid_prefills(key: str) -> tuple[int, ...]:
    return (2048, 32768) if key == "qwen3.5-0.8b" else (2048,)


def hybrid_cases(key: str) -> list[str]:
    label = HYBRIDS[key]["label"]
    prefills = [f"{label} prefill {n // 1024}K" for n in hybrid_prefills(key)]
    return [f"{label} build", f"{label} decode b1", f"{label} decode b16", f"{label} verify k=1..3 b1", *prefills]


def hybrid_shape(key: str) -> dict:
    shape = dict(HYBRIDS[HYBRIDS[key].get("base", key)]["shape"])
    if SMOKE:
        shape.update(
            HYBRID_TOY if "num_experts" in shape else {k: v for k, v in HYBRID_TOY.items() if "expert" not in k}
        )
    return shape


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def build_hybrid(key: str, dev: torch.device, folders: dict) -> tuple[str, str]:
    """(HF folder, the scratch folder to delete): ember bench hybrid's builder (transformers draws the
    weights, here on the GPU) with random_model's word-level tokenizer; AWQ: from its base, see awq_folder."""
    from ember.bench.commands.hybrid import build_folder
    from ember.bench.lib.random_model import scratch_dir, write_tokenizer

    m = HYBRIDS[key]
    if "base" in m:
        path = awq_folder(os.path.join(folders[m["base"]], "hf"), 32 if SMOKE else m["awq_group"], dev)
        return path, path
    shape, root = hybrid_shape(key), scratch_dir(16 << 30)
    try:
        tok = lambda p: write_tokenizer(p, shape["vocab_size"])  # noqa: E731
        return build_folder(os.path.join(root, "hf"), shape=shape, arch=m["arch"], tokenizer=tok, device=dev), root
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def awq_folder(src: str, G: int, dev: torch.device) -> str:
    """src with every AWQ_QUANTIZED linear (outside AWQ_DENSE) replaced by random packed int4 words (any
    int32 is a valid word) with scales giving weights of ~0.02, and an AWQ quantization_config."""
    from safetensors.torch import load_file, save_file

    from ember.bench.lib.random_model import scratch_dir

    path = scratch_dir(2 << 30)
    g = torch.Generator(device=dev).manual_seed(0)

    def words(*shape):
        return torch.randint(-(2**31), 2**31, shape, generator=g, device=dev, dtype=torch.int64).to(torch.int32)

    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            out = {}
            for name, w in load_file(os.path.join(src, f)).items():
                module = name.removesuffix(".weight")
                if not AWQ_QUANTIZED.search(name) or any(module.endswith(s) for s in AWQ_DENSE):
                    out[name] = w
                    continue
                N, K = w.shape
                out[f"{module}.qweight"] = words(K, N // 8).cpu()
                out[f"{module}.qzeros"] = words(K // G, N // 8).cpu()
                scales = torch.rand(K // G, N, generator=g, device=dev) * 0.004 + 0.002
                out[f"{module}.scales"] = scales.half().cpu()
            save_file(out, os.path.join(path, f), metadata={"format": "pt"})
        elif not f.endswith(".index.json"):
            shutil.copy(os.path.join(src, f), path)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(
        quant_method="awq", bits=4, group_size=G, zero_point=True, version="gemm", modules_to_not_convert=AWQ_DENSE
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def fixed_drafts():
    """A proposer drafting k copies of each request's last token (a random model rejects most of them),
    so every step verifies 1 + k tokens; k = 0 (set .k): no drafts, plain decode steps."""
    from ember.request import Draft
    from ember.spec.proposer import Proposer

    class FixedDrafts(Proposer):
        num_speculative_tokens, k = max(VERIFY_K), 0

        def propose(self, requests, max_tokens):
            return [Draft([r.token_ids[-1]] * min(self.k, m)) if self.k else None for r, m in zip(requests, max_tokens)]

    return FixedDrafts()


def hybrid_engine(path: str, ctx: dict, max_len: int):
    """(llm, its fixed_drafts proposer, None): the engine with n-gram speculation (k <= 3, adaptive off)
    whose proposer is replaced; where that does not build, (llm without speculation, None, the error)."""
    kw = dict(max_model_len=max_len, max_num_seqs=16)
    try:
        spec = dict(method="ngram", num_speculative_tokens=max(VERIFY_K))
        llm = make_llm(path, ctx, speculative_config=spec, adaptive_spec=False, **kw)
    except Exception as e:  # noqa: BLE001 (the decode and prefill rows still run)
        traceback.print_exc()
        return make_llm(path, ctx, **kw), None, e
    drafts = fixed_drafts()
    llm.engine.parts.spec.proposer = drafts
    return llm, drafts, None


def hybrid_decode_rows(sec: Section, llm, key: str, notes: str) -> float | None:
    """decode tok/s at batch 1 and 16 (no drafts); returns the batch-1 step in ms."""
    label, vocab = HYBRIDS[key]["label"], hybrid_shape(key)["vocab_size"]
    step_ms = None
    for b in (1, 16):
        case = f"{label} decode b{b}"
        if sec.skip_if_over(case):
            continue
        try:
            after = f" steps after {PROMPT_LEN}-token prompts; {notes}"
            steady = decode_row(sec, llm, case, b, HYBRID_NEW_TOKENS, vocab, lambda steps: f"{steps}{after}")
            step_ms = 1000 / steady if b == 1 else step_ms
        except Exception as e:
            sec.add(case, "error", notes=f"{_err(e)}; {notes}")
            traceback.print_exc()
    return step_ms


def hybrid_verify_row(sec: Section, llm, drafts, key: str, base_ms: float | None, notes: str) -> None:
    """The step time of a verify of 1 + k tokens (batch 1, k fixed drafts every step) over a plain
    decode step's (the same engine with no drafts)."""
    label, vocab = HYBRIDS[key]["label"], hybrid_shape(key)["vocab_size"]
    case = f"{label} verify k=1..3 b1"
    if sec.skip_if_over(case):
        return
    ms, verified = {}, []
    try:
        for k in VERIFY_K:
            drafts.k = k
            decode_rate(llm, 1, 4, vocab, seed=200 + k)  # warmup
            n0 = llm.engine.stats().get("spec_num_drafts", 0)
            steady, _, steps = decode_rate(llm, 1, HYBRID_NEW_TOKENS, vocab, seed=300 + k)
            ms[k] = 1000 / steady
            verified.append(f"{llm.engine.stats().get('spec_num_drafts', 0) - n0}/{steps}")
        drafts.k = 0
        if base_ms is None:
            raise RuntimeError("no decode b1 step to compare with")
        sec.add(
            case,
            "ok",
            ", ".join(f"k={k} {ms[k] / base_ms:.2f}x" for k in VERIFY_K) + " a decode step",
            f"verify step {' / '.join(f'{ms[k]:.2f}' for k in VERIFY_K)} ms vs decode {base_ms:.2f} ms (median, "
            f"batch 1); steps with drafts {', '.join(verified)} (k fixed drafts per step: copies of the last "
            f"token via the n-gram path, adaptive k off); {notes}",
            verify_ms=ms,
            decode_ms=base_ms,
        )
    except Exception as e:
        drafts.k = 0
        sec.add(case, "error", notes=f"{_err(e)}; {notes}")
        traceback.print_exc()


def prefill_once(llm, prompt: list[int]) -> float:
    """Seconds from adding a fresh prompt to its first token (max_tokens 1)."""
    from ember.sampling import SamplingParams

    t = time.perf_counter()
    llm.engine.add_request(None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return time.perf_counter() - t


def hybrid_prefill_rows(sec: Section, llm, key: str, notes: str) -> None:
    """prefill tok/s of a fresh prompt (2K; 32K for the 0.8B shape), the engine's chunked prefill (2,048
    tokens a step); best of 2 where the budget allows, after a warmup at 2K."""
    label, vocab = HYBRIDS[key]["label"], hybrid_shape(key)["vocab_size"]
    g = torch.Generator().manual_seed(9)
    prompt = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731 (fresh: no prefix hits)
    warm = False
    for n in hybrid_prefills(key):
        case, toy = f"{label} prefill {n // 1024}K", n // 64 if SMOKE else n
        if sec.skip_if_over(case):
            continue
        try:
            if not warm:
                prefill_once(llm, prompt(min(toy, 2048)))
                warm = True
            times = []
            while len(times) < 2 and not (times and sec.over()):
                times.append(prefill_once(llm, prompt(toy)))
            t = min(times)
            sec.add(
                case,
                "ok",
                f"{toy / t:.0f} tok/s (TTFT {1000 * t:.0f} ms)",
                f"{toy}-token prompt, best of {len(times)}; {notes}",
                tok_s=toy / t,
                ttft_s=t,
                runs_s=times,
            )
        except Exception as e:
            sec.add(case, "error", notes=f"{_err(e)}; {notes}")
            traceback.print_exc()


def hybrid_model(sec: Section, ctx: dict, key: str, folders: dict) -> None:
    """One hybrid shape: build, then one engine for its decode, verify and prefill rows."""
    m, cases = HYBRIDS[key], hybrid_cases(key)
    toy = "; cpu-smoke: toy shape" if SMOKE else ""
    if sec.skip_if_over(*cases):
        return
    s = hybrid_shape(key)
    built = build_row(
        sec,
        cases,
        lambda: build_hybrid(key, ctx["device"], folders),
        lambda path: (
            f"{s['num_hidden_layers']} layers, hidden {s['hidden_size']}, vocab {s['vocab_size']}, in {path}{toy}"
        ),
    )
    if built is None:
        return
    path, folders[key] = built
    spec: dict = {}

    def start():
        llm, spec["drafts"], spec["err"] = hybrid_engine(
            path, ctx, max(hybrid_prefills(key)) // (64 if SMOKE else 1) + 256
        )
        return llm

    def rows(llm, load_s: float) -> None:
        notes = f"executor {executor_name(llm)}; engine built in {load_s:.1f} s{toy}"
        base_ms = hybrid_decode_rows(sec, llm, key, notes)
        if spec["drafts"] is None:
            sec.add(cases[3], "error", notes=f"engine with n-gram speculation: {_err(spec['err'])}")
        else:
            hybrid_verify_row(sec, llm, spec["drafts"], key, base_ms, notes)
        hybrid_prefill_rows(sec, llm, key, notes)

    try:
        engine_rows(sec, cases, m["label"], start, rows)
    finally:
        spec.clear()  # the proposer: no reference to the engine outlives it
        if not any(h.get("base") == key for h in HYBRIDS.values()):
            shutil.rmtree(folders.pop(key), ignore_errors=True)


def section_hybrid(sec: Section, ctx: dict) -> None:
    folders: dict[str, str] = {}
    try:
        for key in HYBRIDS:
            hybrid_model(sec, ctx, key, folders)
    finally:
        for root in folders.values():
            shutil.rmtree(root, ignore_errors=True)


# -- Flash-Next: experts beside the card ---------------------------------------------------------

# Qwen3.8-Flash-Next's layer shape (qwen4_exp: hyper-connections, PLE, QSA, MoE with a shared expert), 4 of its
# 48 layers (3 Gated DeltaNet + 1 QSA attention, PLE on layer 2) and 128 of its 512 experts (top-10), the full
# vocabulary; its n-gram table ~0.5 GB (the release's is 102 GB, read by row either way). 7.7 GB of bf16.
FLASH_NEXT = dict(
    vocab_size=248320,
    hidden_size=2560,
    num_hidden_layers=4,
    layer_types=[LIN] * 3 + [FULL],
    num_attention_heads=24,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=128,
    num_experts_per_tok=10,
    moe_intermediate_size=640,
    shared_expert_intermediate_size=640,
    norm_topk_prob=True,
    hc_count=4,
    hc_lowrank=320,
    ple_layer_ids=[2],
    ple_embed_dim=2560,
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=8,
    ngram_vocab_size_base=100_000,
    make_ngram_vocab_size_divisible_by=128,
    split_ngram_parts=4,
    seed=1234,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=2048,
    indexer_compress_ratio=4,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        mrope_section=[11, 11, 10],
        mrope_interleaved=True,
    ),
    max_position_embeddings=262144,
    output_gate_type="sigmoid",
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    eos_token_id=1,
)
FLASH_NEXT_TOY = dict(
    vocab_size=512,
    hidden_size=64,
    num_attention_heads=4,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    hc_lowrank=16,
    ple_embed_dim=64,
    heads_per_ngram=2,
    ngram_vocab_size_base=1000,
    indexer_n_heads=2,
    indexer_head_dim=16,
    indexer_budget=64,
    rope_parameters=dict(
        rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[2, 1, 1], mrope_interleaved=True
    ),
    max_position_embeddings=4096,
)
FLASH_NEXT_LABEL = "Flash-Next (4/48 layers, 128/512 experts)"
FLASH_NEXT_NEW_TOKENS = 8 if SMOKE else 64
# (row, engine knobs): every expert on the card; the first 2 MoE layers' experts in host memory (mapped, run on
# the CPU kernels) with no hot cache; and with the hot-expert cache (on CUDA: what the KV pool leaves; the
# smoke's CPU "device" has none by default, so it is given 4 experts' worth)
FLASH_NEXT_RUNS = (
    ("all on the card", {}),
    ("--n-cpu-moe 2", dict(n_cpu_moe=2, moe_hot_cache_memory=0)),
    (
        "--n-cpu-moe 2 + hot cache",
        dict(n_cpu_moe=2, moe_hot_cache_memory=4.5 * 3 * 64 * 32 * 2 / 2**30 if SMOKE else None),
    ),
)


def flash_next_cases() -> list[str]:
    return [f"{FLASH_NEXT_LABEL} build"] + [f"{FLASH_NEXT_LABEL} decode {name} b1" for name, _ in FLASH_NEXT_RUNS]


def build_flash_next(dev: torch.device) -> tuple[str, str]:
    """(HF folder, scratch folder): a random qwen4_exp of FLASH_NEXT's shape drawn by transformers on the device
    (weights N(0, 0.02), norms zero: identity), with random_model's word-level tokenizer."""
    import transformers

    from ember.bench.lib.random_model import scratch_dir, write_tokenizer

    shape = dict(FLASH_NEXT, **(FLASH_NEXT_TOY if SMOKE else {}))
    root = scratch_dir(12 << 30)
    try:
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(dev):
                model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**shape)).eval()
        finally:
            torch.set_default_dtype(default)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.zero_() if "norm" in name else p.normal_(0.0, 0.02)
        path = os.path.join(root, "hf")
        model.save_pretrained(path)
        write_tokenizer(path, shape["vocab_size"])
        return path, root
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def placement_note(llm) -> str:
    """Where the run's experts were: host layers, their mapped bytes, the hot cache's slots and hit rate."""
    loaded = llm.engine.parts.loaded
    placement = loaded.placement
    if placement is None or not placement.host_layers:
        return "every expert on the device; "
    note = f"experts of MoE layers {sorted(placement.host_layers)} in host memory ({loaded.mapped_expert_bytes / 1e6:.1f} MB mapped)"
    cache = placement.hot_cache
    if cache is not None and cache.capacity:
        st = cache.stats()
        note += f"; hot cache {st['slots']} experts, hit rate {st['hit_rate']:.2f} ({st['hits']} / {st['hits'] + st['misses']})"
    return note + "; "


def flash_next_run(sec: Section, ctx: dict, path: str, name: str, knobs: dict, prompt: list[int], want: list | None):
    """One engine of the section: its decode row; returns its greedy tokens of `prompt`."""
    from ember.sampling import SamplingParams

    case, vocab = f"{FLASH_NEXT_LABEL} decode {name} b1", (FLASH_NEXT_TOY if SMOKE else FLASH_NEXT)["vocab_size"]

    def rows(llm, load_s: float) -> list[int]:
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        tokens = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        agree = (
            ""
            if want is None
            else f"greedy tokens = all on the card's: {sum(a == b for a, b in zip(tokens, want))}/16; "
        )
        toy = "; cpu-smoke: toy shape" if SMOKE else ""
        after = f" steps; eager; engine built in {load_s:.1f} s{toy}"
        notes = lambda steps: f"{placement_note(llm)}{agree}{steps}{after}"  # noqa: E731 (after the run: the hit rate)
        decode_row(sec, llm, case, 1, FLASH_NEXT_NEW_TOKENS, vocab, notes, engine_s=load_s)
        return tokens

    start = lambda: make_llm(path, ctx, enforce_eager=True, max_model_len=2048, max_num_seqs=4, **knobs)  # noqa: E731
    return engine_rows(sec, [case], f"Flash-Next {name}", start, rows)


def section_flash_next(sec: Section, ctx: dict) -> None:
    """The Flash-Next shape built once, then one engine a placement: all on the card, --n-cpu-moe, the hot cache."""
    cases = flash_next_cases()
    if sec.skip_if_over(*cases):
        return
    built = build_row(sec, cases, lambda: build_flash_next(ctx["device"]), lambda path: f"in {path}")
    if built is None:
        return
    path, root = built
    try:
        vocab = (FLASH_NEXT_TOY if SMOKE else FLASH_NEXT)["vocab_size"]
        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
        want = None
        for (name, knobs), case in zip(FLASH_NEXT_RUNS, cases[1:]):
            if sec.skip_if_over(case):
                continue
            tokens = flash_next_run(sec, ctx, path, name, knobs, prompt, want)
            want = want if want is not None else tokens
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- main ------------------------------------------------------------------------------------


def planned(name: str) -> list[str]:
    if name == "env":
        return ["machine", "d2d copy bandwidth"]
    if name == "kernels":
        return KERNEL_CASES + GDN_CASES
    if name == "attention":
        return [f"split-KV vs SDPA {c}" for c, _, _ in ATTN_CASES]
    if name == "ttft":
        return list(TTFT_CASES)
    if name == "hybrid":
        return [c for key in HYBRIDS for c in hybrid_cases(key)]
    if name == "flash-next":
        return flash_next_cases()
    return model_cases(name)


def all_cases() -> list[tuple[str, str]]:
    """(section, case) of every row a full run writes; the smoke test checks them."""
    return [(name, c) for name in SECTIONS for c in planned(name)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "gpu.md"))
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU, Triton under TRITON_INTERPRET=1")
    ap.add_argument("--budget-s", type=float, default=480.0, help="total time budget (seconds)")
    ap.add_argument("--only", default=None, help=f"comma-separated sections of: {', '.join(SECTIONS)}")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.cpu_smoke:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --cpu-smoke to check the script on a CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (cpu-smoke)"
    report = Report(args.out, device_name, args)
    sections = SECTIONS if not args.only else [s.strip() for s in args.only.split(",")]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    deadline = report.t0 + args.budget_s

    def watchdog():  # a hung kernel or engine: keep what was measured, then stop
        report.add("run", "watchdog", "error", notes=f"still running {args.budget_s + 90:.0f} s after start: exited")
        report.write()
        os._exit(3)

    timer = threading.Timer(args.budget_s + 90, watchdog)
    timer.daemon = True
    timer.start()
    ctx: dict = {"device": device}
    print("| section | case | status | result | notes |\n|---|---|---|---|---|", flush=True)
    for name in sections:
        sec = Section(report, name, SECTION_CAPS[name], deadline, planned(name))
        error = None
        try:
            if name == "env":
                section_env(sec, ctx)
            elif name == "kernels":
                section_kernels(sec, ctx)
            elif name == "attention":
                section_attention(sec, ctx)
            elif name == "ttft":
                section_ttft(sec, ctx)
            elif name == "hybrid":
                section_hybrid(sec, ctx)
            elif name == "flash-next":
                section_flash_next(sec, ctx)
            else:
                section_model(sec, ctx, name)
        except Exception as e:
            error = e
            traceback.print_exc()
        finally:
            free_memory()
        sec.finish(error)
        report.write()
    timer.cancel()
    print("\n" + report.markdown(), flush=True)  # the whole table once more, last: it ends the log
    print(f"-- total {time.monotonic() - report.t0:.1f} s; wrote {args.out} and {json_path(args.out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
