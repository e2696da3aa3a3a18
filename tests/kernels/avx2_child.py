"""A kernel test module run again against the kernel's AVX2 build on an AVX-512 machine (each kernel
module's test_avx2_build_passes_this_module): the kernel is compiled with -march=haswell under the name
this machine looks for, in a kernel dir of its own (EMBER_KERNEL_DIR), then probed and the module's other
tests run in child processes that read the CPU flags as an AVX2-only machine's (the haswell_flags plugin).
Not the plugin itself: importing that masks the flags of the process that imports it."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN = "tests.kernels.haswell_flags"
HASWELL = ("-march=haswell",)
AVXVNNI = ("-march=haswell", "-mavxvnni")
# the builds the kernel modules' AVX2 tests take (test_avx2_build_passes_this_module), prebuilt by `make test`'s
# install (scripts/install.py) so that pytest runs them instead of compiling them
TEST_BUILDS = [
    *(
        (source, HASWELL)
        for source in (
            "cpu_block_gemv.cpp",
            "cpu_causal_attention.cpp",
            "cpu_fp8_gemv.cpp",
            "cpu_fused_elementwise.cpp",
            "cpu_gated_delta_net.cpp",
            "cpu_hc_mixer.cpp",
            "cpu_half_gemv.cpp",
            "cpu_ple.cpp",
            "cpu_qsa_attention.cpp",
            "cpu_qsa_scoring.cpp",
            "cpu_row_top.cpp",
            "cpu_tiled_gemv.cpp",
        )
    ),
    ("cpu_tiled_gemv.cpp", AVXVNNI),
]


def build_dir(source: str, march: tuple[str, ...]) -> str:
    """A kernel dir of this source's own for this -march, kept across runs: the library's name hashes its
    sources, so an edited kernel is built again and an unchanged one is not."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    tag = "".join(m.lstrip("-").replace("=", "-") for m in march)
    return os.path.join(cache, "ember", "kernels-test", tag, source.removesuffix(".cpp"))


def build(source: str, march: tuple[str, ...] = HASWELL, also: tuple[str, ...] = ()) -> dict:
    """Compile `source` (a cpp_build.KERNELS key) with `march` into its own kernel dir (unless built
    there already); the environment that finds it. also: other kernels the module's tests run (a packed
    projection's tiled GEMV), built the same way in theirs: a kernel missing from EMBER_KERNEL_DIR would be
    built for this machine's own CPU, and the child would call an AVX-512 build as if it were the AVX2 one."""
    dirs = []
    for src in (source, *also):
        kernel_dir = build_dir(src, march)
        os.makedirs(kernel_dir, exist_ok=True)
        code = (
            "import sys; from ember.kernels import cpp_build as b; "
            "b.CFLAGS[:] = ['-O3', *sys.argv[3:], '-fopenmp']; "
            "b.compile_kernel(sys.argv[1], out_dir=sys.argv[2])"
        )
        cmd = [sys.executable, "-c", code, src, kernel_dir, *march]
        subprocess.run(cmd, env=dict(os.environ, EMBER_KERNEL_DIR=kernel_dir), cwd=REPO, check=True, timeout=600)
        dirs.append(kernel_dir)
    return dict(os.environ, EMBER_KERNEL_DIR=os.pathsep.join(dirs))


def run_module(env: dict, path: str, masked: bool = True) -> subprocess.CompletedProcess:
    """The module's tests but the AVX2 one, in a child pytest (the flags masked unless not `masked`)."""
    plugin = ["-p", PLUGIN] if masked else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *plugin, path, "-k", "not avx2"]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


def probe_and_run(
    env: dict, code: str, path: str, masked: bool = True
) -> tuple[list[str], subprocess.CompletedProcess]:
    """probe's words and run_module's result from one child: `code` runs first, then the module's tests in the
    same interpreter (one start of Python and torch a module, not two)."""
    end = "--- end of the probe ---"
    prefix = f"import {PLUGIN}; " if masked else ""
    args = ["-q", "-x", "-p", "no:cacheprovider", *(["-p", PLUGIN] if masked else []), path, "-k", "not avx2"]
    script = f"{prefix}{code}; print({end!r}, flush=True); import sys, pytest; sys.exit(pytest.main({args!r}))"
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    said, _, rest = run.stdout.partition(end)
    return said.split(), subprocess.CompletedProcess(run.args, run.returncode, rest, run.stderr)


def prebuild() -> None:
    """Every TEST_BUILDS build, two at a time (what `make test`'s install runs on an AVX-512 machine)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda b: build(*b), TEST_BUILDS))


if __name__ == "__main__":
    prebuild()
