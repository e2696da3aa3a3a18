"""A build killed midway must not hang every later one: torch's lock file outlives its builder."""
import os
import subprocess
import sys

from ember.kernels import cpp_build
from ember.kernels.cpu_paged_attention import MORE_SOURCES, SOURCE

CHILD = """
from ember.kernels.cpu_paged_attention import paged_attention_op
print("built" if paged_attention_op() is not None else "failed")
"""


def test_a_stale_torch_lock_file_is_removed_not_waited_on():
    # the attention kernel builds on every x86 CPU (AVX-512, AVX2 or scalar code), and the engine
    # tests before this one have built it (so this costs a load, not a compile)
    first = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=900)
    assert first.stdout.strip() == "built", first.stderr[-2000:]
    lock = os.path.join(cpp_build._build_directory(cpp_build.build_name(SOURCE, MORE_SOURCES)), "lock")
    # what a builder killed between taking torch's lock and releasing it leaves behind
    open(lock, "w").close()
    try:
        # torch alone would spin on that file forever; the timeout turns a hang into a failure
        again = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    finally:
        stale_left = os.path.exists(lock)
        if stale_left:
            os.remove(lock)
    assert again.stdout.strip() == "built", again.stderr[-2000:]
    assert "stale build lock" in again.stderr and not stale_left


def test_the_build_directory_honours_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = cpp_build._build_directory("ember_x_1234")
    assert path == str(tmp_path / "ember_x_1234") and os.path.isdir(path)
