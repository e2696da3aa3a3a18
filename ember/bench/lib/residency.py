"""How many bytes of a file's byte range a process holds resident through its mappings of the file.

A process that maps a model file (llama.cpp maps the whole GGUF; ember maps its weights) holds in its resident
set the pages of the mapping it has touched, and only those. /proc/PID/maps says where each mapping of the
file starts and at which file offset; /proc/PID/pagemap has one 64-bit entry per virtual page whose bit 63
says the page is present in the process's page table (readable for a process of one's own, or a child,
without privileges: the frame numbers are zeroed, the bits are not). So the resident bytes of, say, the
n-gram table of a GGUF file are the present pages of every mapping's intersection with the table's range,
counted once per page (two mappings of one range count twice: both are in the resident set).
What a process reads with pread (ember's table rows) lands in the page cache, not in its resident set.
"""

from __future__ import annotations

import os
import struct

PAGE = os.sysconf("SC_PAGE_SIZE")
PRESENT = 1 << 63


def file_mappings(pid: int, path: str) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of each mapping of `path` in process pid."""
    real = os.path.realpath(path)
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, int(parts[2], 16)))
    return out


def resident_bytes(pid: int, path: str, offset: int, length: int) -> int:
    """Bytes of path's [offset, offset + length) present in process pid's mappings of it (whole pages)."""
    total = 0
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for start, end, file_off in file_mappings(pid, path):
            lo = max(offset, file_off)
            hi = min(offset + length, file_off + (end - start))
            if hi <= lo:
                continue
            first = (start + lo - file_off) // PAGE
            last = (start + hi - file_off - 1) // PAGE
            total += _present_pages(pagemap, first, last - first + 1) * PAGE
    return total


def _present_pages(pagemap, first: int, count: int, chunk: int = 1 << 16) -> int:
    n = 0
    for at in range(first, first + count, chunk):
        k = min(chunk, first + count - at)
        pagemap.seek(at * 8)
        entries = struct.unpack(f"<{k}Q", pagemap.read(8 * k))
        n += sum(1 for e in entries if e & PRESENT)
    return n
