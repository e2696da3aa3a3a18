"""Kernel builds (ember/kernels/cpp_build.py): built libraries are loaded, not rebuilt; a missing one is
built once however many processes ask at the same time; a build whose owner is killed leaves no
compiler behind and the next start builds it.

A tiny op library stands in for ember's kernels (a real one takes 10-100 s to compile), with a
compiler wrapper ($CXX, which torch's builder runs) that counts its compiles and can stall like a
long compile, so the tests see what the build machinery does, not how long g++ takes.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ember.kernels import cpp_build

SOURCE = """
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <torch/library.h>
namespace { at::Tensor twice(const at::Tensor& x) { return at::add(x, x); } }
TORCH_LIBRARY_FRAGMENT(ember_test_cpp_build, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(ember_test_cpp_build, CPU, m) { m.impl("twice", &twice); }
"""
# builds the tiny library (its source dir in argv[1]) and runs its op: what an engine start does
CHILD = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO)
from ember.kernels.cpp_build import build
assert build("tiny.cpp", source_dir=sys.argv[1])
print(torch.ops.ember_test_cpp_build.twice(torch.ones(2)).tolist())
"""
MARK = "ember-test-compiler-wrapper"


@pytest.fixture
def kernel(tmp_path):
    """(source dir, env) for a cold kernel dir and a counting compiler; env["STALL"] = "1" stalls it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cpp").write_text(SOURCE)
    wrapper = tmp_path / MARK  # its name is in its command line, for pgrep
    # counts (and, with STALL=1, stalls) real compiles, not torch's `$CXX --version` checks
    wrapper.write_text(
        f'#!/bin/sh\ncase " $* " in *" -c "*) echo compile >> {tmp_path}/compiles\n'
        f'  [ "$STALL" = 1 ] && sleep 600;; esac\nexec g++ "$@"\n'
    )
    wrapper.chmod(0o755)
    env = dict(
        os.environ,
        EMBER_KERNEL_DIR=str(tmp_path / "kernels"),
        CXX=str(wrapper),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    )
    return src, env


def compiles(src: Path) -> int:
    counter = src.parent / "compiles"
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def wrappers_running() -> list[str]:
    out = subprocess.run(["pgrep", "-af", MARK], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.mark.slow
def test_two_processes_starting_at_once_build_once_and_both_run(kernel):
    src, env = kernel
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(src)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-1500:] for _, e in outs]
    assert [o.strip() for o, _ in outs] == ["[2.0, 2.0]"] * 2
    assert compiles(src) == 1  # one compile unit, compiled once: the second start waited and loaded it
    assert any("building it once now" in e for _, e in outs)
    # a third start finds the library and only loads it
    again = subprocess.run(
        [sys.executable, "-c", CHILD, str(src)], env=env, capture_output=True, text=True, timeout=300
    )
    assert again.stdout.strip() == "[2.0, 2.0]" and "building" not in again.stderr and compiles(src) == 1


@pytest.mark.slow
def test_a_build_whose_owner_is_killed_leaves_no_compiler_and_the_next_start_builds(kernel):
    src, env = kernel
    owner = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(src)],
        env=dict(env, STALL="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not wrappers_running():  # the "compiler" is running: the build is midway
        assert time.monotonic() < deadline and owner.poll() is None, "the build never started"
        time.sleep(0.2)
    owner.send_signal(signal.SIGKILL)  # no handler of ember's runs: only the kernel's death signal
    owner.wait()
    deadline = time.monotonic() + 20
    while wrappers_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not wrappers_running(), "a compiler outlived the ember process that started its build"
    assert not any(p.suffix == ".so" for p in Path(env["EMBER_KERNEL_DIR"]).iterdir())  # nothing half-built published
    ok = subprocess.run([sys.executable, "-c", CHILD, str(src)], env=env, capture_output=True, text=True, timeout=600)
    assert ok.stdout.strip() == "[2.0, 2.0]", ok.stderr[-2000:]


def test_every_kernel_of_this_cpu_was_built_at_install():
    """`make test` installs with the build step, so no engine here compiles: every kernel this CPU runs
    has its library for this CPU and source."""
    missing = [
        s
        for s, k in cpp_build.KERNELS.items()
        if k.runs_here() and cpp_build.library_path(cpp_build.build_name(s, k.more_sources)) is None
    ]
    assert not missing, f"not built at install: {missing} (in {cpp_build.kernel_dirs()})"


def test_kernel_dirs_honour_ember_kernel_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_KERNEL_DIR", str(tmp_path))
    assert cpp_build.kernel_dirs() == [str(tmp_path)] and cpp_build._writable_dir() == str(tmp_path)
    monkeypatch.delenv("EMBER_KERNEL_DIR")
    assert cpp_build.kernel_dirs()[0].endswith(os.path.join("ember", "kernels", "_prebuilt"))
