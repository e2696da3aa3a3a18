"""What this machine is: CPU flags, the cores this process may use, available RAM, and the dtype
`--dtype auto` means here.

A leaf module (no torch, no other ember package): the config validates against it, the kernels
ask it which builds can run, the planner and the engine resolve `--dtype auto` through the one
function below, so the two can never disagree.
"""

from __future__ import annotations

import functools
import os

DTYPES = ("auto", "float32", "bfloat16", "float16")


@functools.cache
def cpu_flags_line() -> str:
    """/proc/cpuinfo's flags line as it is (kernel builds are hashed to it), "" where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, empty where they cannot be read."""
    return frozenset(cpu_flags_line().partition(":")[2].split())


def has_cpu_flags(*flags: str) -> bool:
    # asked on hot paths (every fused-elementwise call): the set is built once
    return all(f in cpu_flags() for f in flags)


def cpu_has_avx512_bf16() -> bool:
    return has_cpu_flags("avx512_bf16")


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (a container's cpuset, taskset, a test
    worker pinned to its own core), not the machine's count, which oversubscribes the cores it
    may use when the two differ."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this OS
        return os.cpu_count() or 1


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def resolve_dtype_name(name: str, device_type: str) -> str:
    """--dtype -> a concrete dtype name. auto = bfloat16 on CUDA or a CPU with AVX512-BF16 (bf16
    matmuls run natively there), else float32 (elsewhere bf16 on CPU is emulated and slow)."""
    if name != "auto":
        return name
    return "bfloat16" if device_type == "cuda" or cpu_has_avx512_bf16() else "float32"
