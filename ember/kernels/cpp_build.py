"""Building and loading ember's C++ CPU kernels (TORCH_LIBRARY op libraries, g++ -O3 -march=native).

Built at install: setup.py's build step runs `python -m ember.kernels.cpp_build --all`, which
compiles every kernel this CPU can run (KERNELS) into ember/kernels/_prebuilt/ (`make run` and
`make test` install with --no-build-isolation, so torch is there to build against). Each library
is named by a hash of its sources, the headers beside them, the CPU's flags and torch's version
(-march=native code must not run on another CPU, an edited source must not load an old build);
at run time a kernel whose library is there is loaded with torch.ops.load_library: no compiler,
no ninja, a few milliseconds.

A kernel whose library is missing (another CPU, an edited source, an install whose build
environment had no torch) is built once, with one log line saying so, in a child process
(`python -m ember.kernels.cpp_build SOURCE`) that:
- holds an flock on the kernel's lock file for the whole build: a second process asking for the
  same kernel waits for that build and loads its result instead of compiling again;
- dies with its owner: it has the kernel send it SIGTERM when its parent dies (PR_SET_PDEATHSIG,
  so even a SIGKILLed ember), and on SIGTERM (or its parent's Ctrl-C) stops its process group,
  ninja included, which stops its compilers; the flock goes with it;
- publishes the library by an atomic rename, so a half-written file is never loaded.
Where a build fails (no compiler, no ninja) the caller gets None, a warning says why, and the
torch path runs instead. Measured cold on 2 Zen4 cores: ~8-12 s a kernel, the paged attention
kernel's two units ~45 s (ATen's core headers only: torch/extension.h made it 241 s for four).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ember.platform import cpu_flags_line, has_cpu_flags, march  # noqa: F401 -- has_cpu_flags: the kernels' and tests' import

logger = logging.getLogger("ember")
HERE = os.path.dirname(os.path.abspath(__file__))
CFLAGS, LDFLAGS = ["-O3", march(), "-fopenmp"], ["-fopenmp"]  # march: this CPU, or Haswell under EMBER_CPU_ISA=avx2


@dataclass(frozen=True)
class Kernel:
    what: str
    more_sources: tuple[str, ...] = ()
    # CPU flag sets of which one must be present for the code to compile and run (none: any x86)
    cpu_flags: tuple[tuple[str, ...], ...] = ()

    def runs_here(self) -> bool:
        return not self.cpu_flags or any(has_cpu_flags(*flags) for flags in self.cpu_flags)


KERNELS = {
    "cpu_paged_attention.cpp": Kernel("CPU attention kernel", ("cpu_paged_attention_fp32_fp8.cpp",)),
    "cpu_tiled_gemv.cpp": Kernel(
        "CPU GEMV kernel", (), (("avx512f", "avx512bw", "avx512_bf16"), ("avx2", "fma", "f16c"))
    ),
    "cpu_causal_attention.cpp": Kernel("CPU prefill attention kernel", (), (("avx512f",), ("avx2", "fma"))),
    "cpu_fused_elementwise.cpp": Kernel(
        "CPU fused elementwise kernels", (), (("avx512f", "avx512bw"), ("avx2", "fma"))
    ),
    "cpu_row_top.cpp": Kernel("CPU row argmax/top-k kernels", (), (("avx512f",), ("avx2",))),
    "cpu_gated_delta_net.cpp": Kernel("CPU Gated DeltaNet kernels", (), (("avx512f",), ("avx2", "fma"))),
    "cpu_half_gemv.cpp": Kernel("CPU 16-bit weight GEMV", (), (("avx2", "fma", "f16c"),)),
    "cpu_qsa_attention.cpp": Kernel("CPU QSA selected-block attention", (), (("avx512f",), ("avx2", "fma"))),
    "cpu_qsa_scoring.cpp": Kernel("CPU QSA block scoring and top-k", (), (("avx512f",), ("avx2", "fma"))),
    "cpu_hc_mixer.cpp": Kernel("CPU hyper-connection mixer", (), (("avx512f",), ("avx2", "fma"))),
    "cpu_fp8_gemv.cpp": Kernel("CPU fp8 block-scaled weight GEMV", (), (("avx2", "fma", "f16c"),)),
    "cpu_ple.cpp": Kernel("CPU PLE gate and conv", (), (("avx512f",), ("avx2", "fma"))),
    # any x86 (scalar dots without AVX2); the grid-coded IQ types live in their own source
    "cpu_block_gemv.cpp": Kernel("CPU GEMV / MoE over GGUF blocks", ("cpu_block_gemv_iq.cpp",)),
}

_loaded: dict[str, bool | None] = {}  # source -> loaded (None: could not be built)


def kernel_dirs() -> list[str]:
    """Where libraries are looked for, in order (and built into: the first writable one):
    $EMBER_KERNEL_DIR alone when set (folders joined by os.pathsep); else the package's _prebuilt/ (install),
    then ~/.cache/ember."""
    if os.environ.get("EMBER_KERNEL_DIR"):
        return os.environ["EMBER_KERNEL_DIR"].split(os.pathsep)
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ember", "kernels")
    return [os.path.join(HERE, "_prebuilt"), cache]


def build_name(source: str, more_sources: tuple[str, ...] = (), source_dir: str = HERE) -> str:
    """The library's name: the source's, tagged with a hash of the CPU's flags, torch's version, the
    sources and the headers beside them (a changed header must not load an old build)."""
    digest = hashlib.sha1((cpu_flags_line() + torch.__version__).encode())
    for name in [source, *more_sources] + sorted(n for n in os.listdir(source_dir) if n.endswith(".h")):
        with open(os.path.join(source_dir, name), "rb") as f:
            digest.update(f.read())
    return f"ember_{os.path.splitext(source)[0]}_{digest.hexdigest()[:8]}"


def library_path(name: str) -> str | None:
    """The built library `name` in one of kernel_dirs(), or None."""
    return next((p for d in kernel_dirs() if os.path.isfile(p := os.path.join(d, name + ".so"))), None)


def build(source: str, fakes: dict[str, Callable] | None = None, source_dir: str = HERE) -> bool | None:
    """Load kernel `source` (a KERNELS key; its ops registered, with `fakes`: op name -> the fake
    kernel torch.compile traces with), building it once first where no library for this CPU and
    source exists. True, or None where this CPU cannot run it or it cannot be built."""
    if source in _loaded:
        return _loaded[source]
    kernel = KERNELS.get(source, Kernel(source))
    result = None
    if kernel.runs_here():
        try:
            name = build_name(source, kernel.more_sources, source_dir)
            path = library_path(name)
            if path is None:
                logger.info(
                    "ember: the C++ %s was not built for this CPU and source (%s); building it once now",
                    kernel.what,
                    name,
                )
                t0 = time.perf_counter()
                path = _build_in_child(source, source_dir)
                logger.info("ember: built the C++ %s in %.0f s (%s)", kernel.what, time.perf_counter() - t0, path)
            torch.ops.load_library(path)
            for op, fake in (fakes or {}).items():
                torch.library.register_fake(op)(fake)
            result = True
        except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
            logger.warning(
                "ember: the C++ %s could not be built (%s: %s); using the slower torch path. Install g++ "
                "and ninja (pip install ninja) to get it",
                kernel.what,
                type(e).__name__,
                str(e)[:300],
            )
    _loaded[source] = result
    return result


def _build_in_child(source: str, source_dir: str) -> str:
    """Build in `python -m ember.kernels.cpp_build` (its own process group, stopped with this
    process: see the module docstring); returns the library's path."""
    cmd = [
        sys.executable,
        "-m",
        "ember.kernels.cpp_build",
        source,
        "--source-dir",
        source_dir,
        "--parent",
        str(os.getpid()),
    ]
    proc = subprocess.Popen(cmd, process_group=0, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate()
    except BaseException:  # Ctrl-C or an exception here: the build goes with us
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError((err or out).strip()[-1500:] or f"the kernel build exited with {proc.returncode}")
    return out.strip().splitlines()[-1]


def compile_kernel(source: str, source_dir: str = HERE, out_dir: str | None = None) -> str:
    """Compile `source` into out_dir (default: the first writable of kernel_dirs()) unless it is
    there already; returns the library's path. Serialised across processes by an flock."""
    from torch.utils.cpp_extension import load

    kernel = KERNELS.get(source, Kernel(source))
    name = build_name(source, kernel.more_sources, source_dir)
    out_dir = out_dir or _writable_dir()
    target = os.path.join(out_dir, name + ".so")
    build_dir = os.path.join(out_dir, "build", name)
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".lock"), "w") as lock:  # closing it (or dying) releases it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(target):  # another process built it while this one waited
            return target
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):  # torch's own lock, left by a builder killed midway (it held the flock too)
            os.remove(stale)
        _put_ninja_on_path()
        load(
            name=name,
            sources=[os.path.join(source_dir, s) for s in (source, *kernel.more_sources)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            is_python_module=False,
            verbose=False,
            build_directory=build_dir,
        )
        tmp = f"{target}.{os.getpid()}.tmp"
        shutil.copyfile(os.path.join(build_dir, name + ".so"), tmp)
        os.replace(tmp, target)  # atomic: a reader sees no library or the whole one
        shutil.rmtree(build_dir, ignore_errors=True)  # objects of a name that is never built again
    return target


def _writable_dir() -> str:
    for d in kernel_dirs():
        with contextlib.suppress(OSError):
            os.makedirs(d, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
    raise OSError(f"none of {kernel_dirs()} is writable; set EMBER_KERNEL_DIR to a folder ember may write")


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary sits in the venv, which a plain
    `.venv/bin/python` does not put on PATH."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _die_with(parent: int) -> None:
    """This builder stops, with its process group (ninja, which stops its compilers), when its
    parent dies or SIGTERM / SIGINT arrives."""

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)  # ninja forwards it to its compilers and exits
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    if os.getppid() != parent:  # the parent died before the line above took effect
        stop(signal.SIGTERM, None)


def list_kernels(source_dir: str = HERE) -> int:
    """One line a kernel: built for this CPU (and where), not built yet, or not for this CPU (the flags
    it needs); 1 if one this CPU can run is not built (CI prints this after the install)."""
    missing = 0
    print(f"ember kernels for this CPU ({march()}):")
    for source, kernel in KERNELS.items():
        if not kernel.runs_here():
            needs = " or ".join("+".join(flags) for flags in kernel.cpu_flags)
            print(f"  {kernel.what} ({source}): not for this CPU (needs {needs})")
            continue
        path = library_path(build_name(source, kernel.more_sources, source_dir))
        missing += path is None
        print(f"  {kernel.what} ({source}): {'built, ' + path if path else 'NOT BUILT'}")
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ember.kernels.cpp_build", description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", help="one kernel (a KERNELS key); prints its library's path")
    p.add_argument("--all", action="store_true", help="every kernel this CPU can run (the install step)")
    p.add_argument("--list", action="store_true", help="each kernel: built for this CPU (where), or why not")
    p.add_argument("--out", default=None, help="folder for the libraries (default: the first writable kernel dir)")
    p.add_argument("--source-dir", default=HERE)
    p.add_argument("--parent", type=int, default=None, help="stop when this process dies (set by build())")
    args = p.parse_args(argv)
    if args.parent is not None:
        _die_with(args.parent)
    if args.list:
        return list_kernels(args.source_dir)
    if not args.all:
        print(compile_kernel(args.source, args.source_dir, args.out))
        return 0
    return build_all(args.source_dir, args.out)


def build_all(source_dir: str = HERE, out: str | None = None) -> int:
    """Every kernel this CPU can run, as many at a time as this process may use cores, the largest
    sources first (one after another, the six took 189 s on 2 Zen3 cores: benchmarks/startup.md; a
    compiler waits on nothing, so two kernels at a time fill two cores, where one kernel's build is
    mostly a single translation unit). 1 if one of them failed (each failure is said; the others go on)."""
    from concurrent.futures import ThreadPoolExecutor

    from ember.platform import usable_cores

    todo = []
    for source, kernel in KERNELS.items():
        if kernel.runs_here():
            todo.append(source)
        else:
            print(f"ember: {kernel.what}: not for this CPU, skipped", file=sys.stderr)
    todo.sort(key=lambda src: -sum(os.path.getsize(os.path.join(source_dir, s)) for s in _sources(src)))

    def one(source: str) -> bool:
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "ember.kernels.cpp_build", source, "--source-dir", source_dir]
        run = subprocess.run(cmd + (["--out", out] if out else []), capture_output=True, text=True)
        what = KERNELS[source].what
        if run.returncode == 0:
            path = run.stdout.strip().splitlines()[-1]
            print(f"ember: {what}: {path} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            return True
        print(
            f"ember: {what} did not build ({(run.stderr or run.stdout).strip()[-500:]}); it will be built on first "
            "use or its torch path runs",
            file=sys.stderr,
        )
        return False

    with ThreadPoolExecutor(max_workers=max(1, min(usable_cores(), len(todo)))) as pool:
        ok = list(pool.map(one, todo))
    return 0 if all(ok) else 1


def _sources(source: str) -> tuple[str, ...]:
    return (source, *KERNELS[source].more_sources)


if __name__ == "__main__":
    sys.exit(main())
