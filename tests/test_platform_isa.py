"""EMBER_CPU_ISA=avx2: a process reads the CPU as an AVX2-only one (no AVX-512, AMX or AVX-VNNI flags, a
flags line of its own for kernel build names), builds its kernels -march=haswell, and holds torch to AVX2;
an unknown value is refused with what to set. Each case in a fresh interpreter: the flags are read once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, os
import ember
from ember import platform
print(json.dumps({"flags": sorted(platform.cpu_flags()), "line": platform.cpu_flags_line(), "march": platform.march(),
                  "aten": os.environ.get("ATEN_CPU_CAPABILITY"), "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA")}))
"""


def _probe(isa: str | None) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("EMBER_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    }
    if isa is not None:
        env["EMBER_CPU_ISA"] = isa
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


def test_avx2_cap_hides_the_wider_flags_and_holds_torch_to_avx2():
    native, capped = (json.loads(_probe(isa).stdout) for isa in (None, "avx2"))
    assert native["march"] == "-march=native" and native["aten"] is None
    assert capped["march"] == "-march=haswell"
    assert capped["aten"] == "avx2" and capped["onednn"] == "AVX2"
    assert not [f for f in capped["flags"] if f.startswith(("avx512", "amx", "avx_vnni"))]
    assert set(capped["flags"]) <= set(native["flags"]) and "avx2" in capped["flags"]
    assert capped["line"] != native["line"]  # kernel builds of the capped process get names of their own


def test_an_unknown_isa_is_refused_with_what_to_set():
    run = _probe("sse")
    assert run.returncode != 0
    assert "ConfigError" in run.stderr and "set it to one of native, avx2" in run.stderr
