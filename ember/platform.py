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


# EMBER_CPU_ISA=avx2 makes an AVX-512 machine run ember as an AVX2-only one (Zen2/3, Intel's
# 12th-14th generation desktop chips) would: the flags below hide AVX-512, AMX and AVX-VNNI, the C++
# kernels build with -march=haswell (ember.kernels.cpp_build), and torch's own CPU code is held to AVX2
# (ATen's kernels and inductor's generated code: ATEN_CPU_CAPABILITY; oneDNN: ONEDNN_MAX_CPU_ISA; MKL:
# MKL_ENABLE_INSTRUCTIONS; each read when torch first needs it, so set before the first op). It is how
# the AVX2 build is tested and measured on a machine that has more: the instructions are the AVX2
# machine's, the memory system and core are still this one's, so a figure says which it was.
ISA_ENV = "EMBER_CPU_ISA"
ISA_CAPS = ("native", "avx2")
_HIDDEN_UNDER_AVX2 = ("avx512", "amx", "avx_vnni", "avxvnni")
_TORCH_AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def isa_cap() -> str:
    """ "avx2" under EMBER_CPU_ISA=avx2, else "native"; a value ember does not know is refused."""
    cap = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if cap not in ISA_CAPS:
        from ember.errors import ConfigError  # a leaf too: no import of anything else

        raise ConfigError(
            f"{ISA_ENV}={cap!r} is not an ISA ember knows: set it to one of {', '.join(ISA_CAPS)}, or unset it"
        )
    return cap


def cap_torch_isa() -> None:
    """Under EMBER_CPU_ISA=avx2, hold torch's CPU code to AVX2 too (values already set are kept)."""
    if isa_cap() == "avx2":
        for key, value in _TORCH_AVX2_ENV.items():
            os.environ.setdefault(key, value)


@functools.cache
def cpu_flags_line() -> str:
    """/proc/cpuinfo's flags line (kernel builds are hashed to it), "" where unreadable; under
    EMBER_CPU_ISA=avx2 without the flags it hides, and tagged so, so that its builds get names of their own."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
    if isa_cap() == "native":
        return line
    name, _, flags = line.partition(":")
    kept = [f for f in flags.split() if not f.startswith(_HIDDEN_UNDER_AVX2)]
    return f"{name}: {' '.join(kept)} [{ISA_ENV}=avx2]\n"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (as EMBER_CPU_ISA leaves them), empty where they cannot be read."""
    return frozenset(f for f in cpu_flags_line().partition(":")[2].split() if not f.startswith("["))


def march() -> str:
    """The -march of the C++ kernels: this CPU's, or Haswell's (AVX2, FMA, F16C) under EMBER_CPU_ISA=avx2."""
    return "-march=haswell" if isa_cap() == "avx2" else "-march=native"


def has_cpu_flags(*flags: str) -> bool:
    # asked on hot paths (every fused-elementwise call): the set is built once
    return all(f in cpu_flags() for f in flags)


def cpu_has_avx512_bf16() -> bool:
    return has_cpu_flags("avx512_bf16")


def cpu_has_amx() -> bool:
    """AMX's bf16 tiles (Intel Sapphire Rapids on), where oneDNN's bf16 GEMMs beat ember's own kernels on
    many rows (prefill attention, block GEMMs and experts: docs/tuning.md)."""
    return has_cpu_flags("amx_bf16", "amx_tile")


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


def resolve_kv_cache_dtype_name(kv_cache_dtype: str, dtype: str, device_type: str) -> str:
    """--kv-cache-dtype as run: `auto` is the model's dtype, but bfloat16 where --dtype auto chose
    float32 on a CPU without AVX512-BF16. There float32 is that CPU's limit, not the user's wish, and a
    bf16 cache (stored with a cast, widened in the attention kernels: exact products of the rounded
    values) decoded 4% faster and as fast in prefill, in half the bytes: twice the tokens for a budget
    (docs/tuning.md, "A bf16 KV cache under float32 activations"). An explicit --dtype float32 keeps a
    float32 cache."""
    if kv_cache_dtype == "auto" and dtype == "auto" and resolve_dtype_name("auto", device_type) == "float32":
        return "bfloat16" if device_type == "cpu" else kv_cache_dtype
    return kv_cache_dtype


def resolve_dtype_name(name: str, device_type: str) -> str:
    """--dtype -> a concrete dtype name. auto = bfloat16 on CUDA or a CPU with AVX512-BF16 (bf16
    matmuls run natively there), else float32 (elsewhere bf16 on CPU is emulated and slow)."""
    if name != "auto":
        return name
    return "bfloat16" if device_type == "cuda" or cpu_has_avx512_bf16() else "float32"
