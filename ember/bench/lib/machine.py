"""The machine a benchmark ran on, as every results file names it: CPU, cores, RAM, versions, commit, load.

Every figure names its machine; a result measured on another CPU or under another load is another result.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

from ember.platform import isa_cap, usable_cores


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def machine_info() -> dict:
    import torch

    flags = (_cpuinfo_field("flags") or "").split()
    return {
        "cpu": _cpuinfo_field("model name") or platform.processor() or "unknown",
        "logical_cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(_ram_gib() or 0.0, 1),
        "avx512_bf16": "avx512_bf16" in flags,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "ember": package_version("ember") or "source",
        "ember_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_at_end": load_average(),
        # EMBER_CPU_ISA=avx2: ember ran as on an AVX2-only CPU (its -march=haswell kernels, torch held to AVX2)
        "isa_cap": isa_cap(),
        # a llama.cpp of another build than llama-cpp-python's own (e.g. an AVX2-only one beside an isa_cap run)
        "llama_cpp_lib_path": os.environ.get("LLAMA_CPP_LIB_PATH"),
    }


def load_average() -> float | None:
    """1-minute load average: above the core count means other processes shared the cores."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine_line(m: dict) -> str:
    bf16 = ", AVX512-BF16" if m["avx512_bf16"] else ""
    if m.get("isa_cap") == "avx2":
        bf16 += (
            "; run as an AVX2-only CPU: EMBER_CPU_ISA=avx2, the instructions of one, this machine's memory and cores"
        )
    if m.get("llama_cpp_lib_path"):
        bf16 += f"; llama.cpp's libraries from LLAMA_CPP_LIB_PATH={m['llama_cpp_lib_path']}"
    commit = f" @ {m['ember_commit']}" if m.get("ember_commit") else ""
    return (
        f"{m['cpu']} ({m['usable_cores']} cores{bf16}), {m['ram_gib']} GiB RAM, {m['os']}; "
        f"Python {m['python']}, torch {m['torch']}, transformers {m['transformers'] or '-'}, "
        f"ember {m['ember']}{commit}; {m['torch_threads']} torch threads; {m['date']}"
    )
