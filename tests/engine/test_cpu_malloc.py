"""The engine raises glibc's malloc thresholds on CPU (see ember/engine/startup/cpu_malloc.py)."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import ctypes, mmap
from ember.engine.startup.cpu_malloc import keep_freed_memory_in_heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc.mallinfo2.restype = MallInfo2

def mapped_by_malloc(nbytes):
    before = libc.mallinfo2().hblks  # blocks malloc serves with their own mmap
    p = libc.malloc(nbytes)
    during = libc.mallinfo2().hblks
    libc.free(p)
    return during > before

assert mapped_by_malloc(64 << 20), "glibc default: a 64 MB block is its own mmap"
assert keep_freed_memory_in_heap()
assert keep_freed_memory_in_heap()  # idempotent
assert not mapped_by_malloc(64 << 20), "after: it comes from the heap"
print("ok")
"""


def test_large_blocks_come_from_the_heap_after_the_call():
    # A child process: the thresholds are process-wide and this one's must not change under other tests.
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


RELEASE_CHILD = r"""
import ctypes
from ember.engine.startup.cpu_malloc import keep_freed_memory_in_heap, release_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss_mib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) // 1024

assert keep_freed_memory_in_heap()
before = rss_mib()
blocks = [libc.malloc(1 << 20) for _ in range(256)]  # 256 MiB of 1 MiB blocks, touched
for p in blocks:
    ctypes.memset(p, 1, 1 << 20)
for p in blocks[:-1]:  # the last one stays: the freed ones sit below it, where no trim of the top reaches
    libc.free(p)
kept = rss_mib()
assert kept - before >= 200, (before, kept)  # the raised thresholds keep freed memory resident
assert release_freed_memory()
released = rss_mib()
assert kept - released >= 200, (kept, released)
print("ok")
"""


def test_freed_heap_pages_leave_the_resident_set_on_release():
    out = subprocess.run([sys.executable, "-c", RELEASE_CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
