"""A side's peak RSS is its own process's: a worker started by a large driver does not report the
driver's size (getrusage's ru_maxrss carries over exec; VmHWM does not)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ember.bench.sides.local import peak_rss_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_child_of_a_big_process_reports_its_own_peak():
    ballast = bytearray(1 << 30)
    ballast[:: 1 << 12] = b"\x01" * len(ballast[:: 1 << 12])  # every page touched: 1 GiB resident here
    assert peak_rss_bytes() >= 1 << 30
    code = "from ember.bench.sides.local import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    del ballast
    assert 1 << 20 < child < 768 << 20  # the interpreter and ember's imports, not the 1 GiB parent
