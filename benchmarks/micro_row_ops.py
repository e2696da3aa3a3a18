"""Micro-benchmark of the fused elementwise and row kernels (ember/kernels/cpu_fused_elementwise.cpp,
cpu_row_top.cpp) against the torch ops they replace, on float32 rows (what `--dtype auto` runs on a CPU
without AVX512-BF16), or bf16 with --dtype bfloat16.

    python benchmarks/micro_row_ops.py [--isa native|avx2] [--threads 2] [--reps 11]

--isa avx2 (on an AVX-512 machine): both kernels are compiled with -march=haswell into a temporary
kernel dir and the timing runs in a child process that reads the CPU flags without AVX-512 (as
tests/kernels/haswell_flags.py) and holds torch's own kernels to AVX2 (ATEN_CPU_CAPABILITY=avx2),
so both sides run the instructions an AVX2-only CPU (Zen2/3, Intel 12th-14th gen desktop) has; the
memory system and cores are still this machine's. Prints one markdown row per case: the medians of
--reps timings (each of enough calls to last ~20 ms) of the torch path and the kernel, in microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("cpu_fused_elementwise.cpp", "cpu_row_top.cpp")


def calls_for(fn) -> int:
    """Calls per timing: enough for ~20 ms."""
    fn()
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.02 or calls < 3:
        fn()
        calls += 1
    return calls


def medians_us(ref, kernel, reps: int) -> tuple[float, float]:
    """Median microseconds a call of each, their timings alternating (a neighbour's load hits both)."""
    n_ref, n_kernel = calls_for(ref), calls_for(kernel)
    times = {ref: [], kernel: []}
    for _ in range(reps):
        for fn, n in ((ref, n_ref), (kernel, n_kernel)):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[fn].append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times[ref]), statistics.median(times[kernel])


def cases(dtype):
    """(name, shape, torch path, kernel path) for each case: the layer's call, built without and with
    the kernel (so the kernel's side includes the layer's per-call checks)."""
    import torch

    from ember.kernels.cpu_kernels import CpuKernels
    from ember.layers import activation
    from ember.layers.norm import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm
    from ember.layers.rotary import apply_rotary

    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    out, none = [], CpuKernels.none()
    for T in (2048, 1):
        x, r = rand(T, 1024), rand(T, 1024)
        for cls, zc in ((RMSNorm, False), (ZeroCenteredRMSNorm, True)):
            name = "zero-centred rms_norm + residual" if zc else "rms_norm + residual"
            out.append(
                (
                    name,
                    [T, 1024],
                    partial(cls(1024, 1e-6, dtype, kernels=none), x, r),
                    partial(cls(1024, 1e-6, dtype), x, r),
                )
            )
        gu = rand(T, 2 * 3072)
        out.append(
            (
                "silu_and_mul",
                [T, 6144],
                partial(activation.silu_and_mul, gu, False),
                partial(activation.silu_and_mul, gu, True),
            )
        )
        q, ang = rand(T, 32, 128)[:, :16], torch.rand(T, 64, generator=g) * 100  # q: a view of the qkv output
        c, s = ang.cos().to(dtype), ang.sin().to(dtype)
        out.append(
            (
                "rotary (q of a qkv row)",
                [T, 16, 128],
                partial(apply_rotary, q, c, s, False),
                partial(apply_rotary, q, c, s, True),
            )
        )
        o, z = rand(T, 16, 128), rand(T, 32, 128)[:, :16]  # z: a view of the qkvz projection
        ref = partial(GatedRMSNorm(128, 1e-6, dtype, kernels=none), o, z)
        out.append(("gated rms_norm", [T, 16, 128], ref, partial(GatedRMSNorm(128, 1e-6, dtype), o, z)))
    for n, V in ((64, 49152), (1, 151936)):
        lg = torch.randn(n, V, generator=g)
        out.append(("argmax", [n, V], partial(torch.argmax, lg, -1), partial(torch.ops.ember_cpu.argmax_rows, lg)))
        out.append(("top-8", [n, V], partial(torch.topk, lg, 8, -1), partial(torch.ops.ember_cpu.topk_rows, lg, 8)))
    return out


def child(args) -> None:
    import ember.platform as platform

    if args.isa == "avx2":  # as tests/kernels/haswell_flags.py: the flags of an AVX2-only CPU
        flags = frozenset(f for f in platform.cpu_flags() if not f.startswith("avx512"))
        platform.cpu_flags = lambda: flags
    import torch

    from ember.kernels import cpu_fused_elementwise as fused
    from ember.kernels import cpu_row_top

    torch.set_num_threads(args.threads)
    assert fused.available() and cpu_row_top.available()
    dtype = getattr(torch, args.dtype)
    rows = cases(dtype)
    lanes = (fused.lanes(), torch.ops.ember_cpu.row_top_lanes())
    print(
        f"isa {args.isa}, {lanes[0]}/{lanes[1]} lanes, torch {torch.backends.cpu.get_cpu_capability()}, {args.dtype}, {args.threads} threads, medians of {args.reps}"
    )
    print("| op | shape | torch (us) | kernel (us) | speed-up |\n|---|---|---|---|---|")
    for name, shape, ref, kernel in rows:
        a, b = medians_us(ref, kernel, args.reps)
        print(f"| {name} | {shape} | {a:.1f} | {b:.1f} | {a / b:.2f}x |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--isa", choices=("native", "avx2"), default="native")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child or args.isa == "native":
        return child(args)
    with tempfile.TemporaryDirectory() as kernel_dir:
        build = "import sys; from ember.kernels import cpp_build as b; b.CFLAGS[:] = ['-O3', '-march=haswell', '-fopenmp']; "
        build += "".join(f"b.compile_kernel({s!r}, out_dir=sys.argv[1]); " for s in SOURCES)
        env = dict(os.environ, EMBER_KERNEL_DIR=kernel_dir)
        subprocess.run([sys.executable, "-c", build, kernel_dir], env=env, cwd=REPO, check=True)
        env["ATEN_CPU_CAPABILITY"] = "avx2"  # torch's side as on the AVX2 machine
        subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, cwd=REPO, check=True)


if __name__ == "__main__":
    main()
