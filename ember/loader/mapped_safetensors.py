"""A safetensors file's tensors as views of the file's memory mapping, for weights read only by rows
(qwen4_exp's n-gram table: ember.layers.ple). Nothing is read at open. Each view carries file_region
(path, byte offset), so that a row reader can pread its rows instead of touching the mapping
(ember.layers.table_rows says why).

The mapping is private (copy-on-write), so the views are writable tensors without ever writing the
file, and MADV_RANDOM: a row touched through it must not pull in the readahead window around it.
"""

from __future__ import annotations

import json
import mmap
import struct

import torch

from ember.errors import ModelLoadError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class MappedSafetensors:
    """One .safetensors file, its header parsed, its data mapped. get(name) -> a tensor viewing the map."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(n))
            fd = f.fileno()
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        self._map.madvise(mmap.MADV_RANDOM)
        self._data_start = 8 + n

    def get(self, name: str) -> torch.Tensor:
        info = self.header.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path} has no tensor {name!r}")
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has dtype {info['dtype']}, which ember cannot map")
        begin, end = info["data_offsets"]
        shape = info["shape"]
        count = (end - begin) // dtype.itemsize
        if count != torch.Size(shape).numel() or self._data_start + end > len(self._map):
            raise ModelLoadError(f"{self.path}: tensor {name!r} runs past the file; download it again")
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        view = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + begin).view(shape)
        # where its bytes are, for a reader that reads rows from the file (ember.layers.table_rows)
        view.file_region = (self.path, self._data_start + begin)
        return view
