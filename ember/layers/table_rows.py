"""Row sources: a large table read only by rows (qwen4_exp's n-gram table, ember.layers.ple.NGramTable).

A source has num_rows, nbytes, mapped (whether its bytes stay in the file, not resident), tensor (what is
resident, or a view of the file's mapping) and read(rows, dtype) -> [k, dim].

FileRows reads each row with pread from the checkpoint file: the rows land in a fresh buffer and the
process's resident set holds nothing of the table. Reading through the file's mapping instead is not
cold: a page fault maps the neighbouring pages that are in the page cache too (the kernel's fault-around,
64 KiB, which MADV_RANDOM does not turn off), so 6,000 hashed rows of a 300 MB table just written brought
the whole table into the resident set (tests/models/test_qwen4_cold_table.py). pread costs ~2 us a row
here: 16 rows a token are ~30 us of decode, 2,000 prompt tokens ~65 ms of prefill.
GGUFRows does the same for a GGUF tensor of any ggml type (llama.cpp's per_layer_token_embd), dequantizing
only the rows read (dequantize_rows: the C++ row dequantizer where it is built, else gguf-py's).
"""

from __future__ import annotations

import os
import weakref

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize


class TensorRows:
    """Rows resident in memory as a tensor [rows, dim], with a per-tensor scale for fp8 rows."""

    mapped = False

    def __init__(self, tensor: torch.Tensor, scale: float | None = None):
        self.tensor, self.scale = tensor, scale
        self.num_rows = tensor.shape[0]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def read(self, rows: torch.Tensor, dtype: torch.dtype, columns: slice | None = None) -> torch.Tensor:
        """rows [k] int64, local to this source -> [k, dim] in dtype (or those columns of each row: a
        tensor-parallel rank's share of the table)."""
        return self.finish(self.fetch(rows, columns), dtype, columns)

    def fetch(self, rows: torch.Tensor, columns: slice | None = None) -> torch.Tensor:
        """What read() waits on, without a torch op (every source's fetch runs on the prefetch thread:
        ember.layers.ple_gather): here nothing, the rows are in memory."""
        return rows

    def finish(self, rows: torch.Tensor, dtype: torch.dtype, columns: slice | None = None) -> torch.Tensor:
        out = self.tensor.index_select(0, rows.to(self.tensor.device))
        out = (out if columns is None else out[:, columns]).to(dtype)
        return out if self.scale is None else out * self.scale


class FileRows:
    """Rows [num_rows, dim] of `dtype` stored contiguously at byte `offset` of the file at `path`, read
    with pread (the module docstring). tensor: a view of the same bytes in the file's mapping."""

    mapped = True

    def __init__(self, tensor: torch.Tensor, path: str, offset: int, scale: float | None = None):
        self.tensor, self.path, self.offset, self.scale = tensor, path, offset, scale
        self.num_rows, self.dim = tensor.shape[0], tensor[0].numel()
        self.row_bytes = self.dim * tensor.element_size()
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    def identity(self) -> tuple:
        """Where the rows live (ember.layers.ple_gather keys a table by it: the same in every process)."""
        return ("file", self.path, self.offset, str(self.tensor.dtype), self.num_rows, self.dim, self.scale)

    def read(self, rows: torch.Tensor, dtype: torch.dtype, columns: slice | None = None) -> torch.Tensor:
        """Only the window's bytes of each row are read when columns is given (a tensor-parallel rank's)."""
        return self.finish(self.fetch(rows, columns), dtype, columns)

    def fetch(self, rows: torch.Tensor, columns: slice | None = None) -> bytearray:
        """The rows' bytes (pread: the part of read() that may wait on the disk)."""
        first, width = (0, self.dim) if columns is None else (columns.start, columns.stop - columns.start)
        elem = self.tensor.element_size()
        return pread_rows(self._fd, self.path, self.offset + first * elem, width * elem, rows, self.row_bytes)

    def finish(self, raw: bytearray, dtype: torch.dtype, columns: slice | None = None) -> torch.Tensor:
        width = self.dim if columns is None else columns.stop - columns.start
        out = torch.frombuffer(raw, dtype=self.tensor.dtype).view(-1, width) if raw else self.tensor[:0, :width]
        out = out.to(dtype)
        return out if self.scale is None else out * self.scale


def pread_rows(
    fd: int, path: str, offset: int, row_bytes: int, rows: torch.Tensor, stride: int | None = None
) -> bytearray:
    """row_bytes of each row r at offset + r * stride of the file (stride: row_bytes), one pread a row, in order."""
    stride = stride or row_bytes
    raw = bytearray(b"".join([os.pread(fd, row_bytes, offset + r * stride) for r in rows.tolist()]))
    if len(raw) != row_bytes * rows.numel():
        raise OSError(f"{path}: short read of the n-gram table's rows; the file is truncated")
    return raw


_GGUF_FLOATS = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


class GGUFRows:
    """Rows [num_rows, dim] of one GGUF tensor of any ggml type (F32/F16/BF16 or a block type: Q8_0,
    Q4_0, IQ4_NL, ...), stored contiguously at byte `offset` of the file at `path` (ne = [dim, num_rows]:
    each row is dim / block_size whole blocks). read() preads only the asked rows' bytes and dequantizes
    only them (dequantize_rows: gguf-py's values exactly, for every block type); nothing of the
    table is ever mapped, dequantized or held whole. The loader makes one for llama.cpp's
    per_layer_token_embd (ember.loader.gguf_qwen4). tensor: an empty tensor of the rows' dequantized
    dtype (the source holds nothing resident)."""

    mapped = True

    def __init__(self, path: str, offset: int, qtype: int, num_rows: int, dim: int):
        self.path, self.offset, self.qtype = path, offset, GGMLQuantizationType(qtype)
        self.num_rows, self.dim = num_rows, dim
        block, size = GGML_QUANT_SIZES[self.qtype]
        if dim % block:
            raise ValueError(f"rows of {dim} cannot hold whole {self.qtype.name} blocks of {block}")
        self.row_bytes = dim // block * size
        self.tensor = torch.empty(0, dim, dtype=_GGUF_FLOATS.get(self.qtype, torch.float32))
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.dim)

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    def identity(self) -> tuple:
        """Where the rows live (as FileRows.identity)."""
        return ("gguf", self.path, self.offset, int(self.qtype), self.num_rows, self.dim)

    def read(self, rows: torch.Tensor, dtype: torch.dtype, columns: slice | None = None) -> torch.Tensor:
        """A column window (a tensor-parallel rank's) is cut from the dequantized rows: a window need not
        fall on the type's block boundaries (the release's 160-wide rows in halves of 80, blocks of 32)."""
        return self.finish(self.fetch(rows, columns), dtype, columns)

    def fetch(self, rows: torch.Tensor, columns: slice | None = None) -> bytearray:
        """The rows' blocks (pread: the part of read() that may wait on the disk)."""
        return pread_rows(self._fd, self.path, self.offset, self.row_bytes, rows)

    def finish(self, raw: bytearray, dtype: torch.dtype, columns: slice | None = None) -> torch.Tensor:
        out = self._dequantize(raw, dtype)
        return out if columns is None else out[:, columns]

    def _dequantize(self, raw: bytearray, dtype: torch.dtype) -> torch.Tensor:
        size = self.row_bytes
        if not raw:
            return torch.empty(0, self.dim, dtype=dtype)
        floats = _GGUF_FLOATS.get(self.qtype)
        if floats is not None:
            return torch.frombuffer(raw, dtype=floats).view(-1, self.dim).to(dtype)
        return dequantize_rows(raw, self.qtype, size, self.dim).to(dtype)


def dequantize_rows(raw: bytearray, qtype: GGMLQuantizationType, row_bytes: int, dim: int) -> torch.Tensor:
    """The gathered rows' blocks (row_bytes each) -> float32 [rows, dim], gguf-py's values. The C++ row
    dequantizer (ember.kernels.cpu_block_gemv's block_dequant_rows, bit for bit gguf-py's, every ggml type)
    where that kernel is in this tree and built here; gguf-py's numpy dequantizer otherwise."""
    blocks = torch.frombuffer(raw, dtype=torch.uint8).view(-1, row_bytes)
    kernel = _block_dequantizer(qtype)
    if kernel is not None:
        return kernel(blocks, qtype).view(-1, dim)
    values = np.asarray(gguf_dequantize(blocks.numpy(), qtype), dtype=np.float32)
    return torch.from_numpy(values.reshape(-1, dim))


def _block_dequantizer(qtype: GGMLQuantizationType):
    """cpu_block_gemv.dequant_rows where it takes qtype here, else None (the kernel comes with the packed
    quant types' branch; before it, and where it cannot be built, gguf-py dequantizes)."""
    try:
        from ember.kernels import cpu_block_gemv
    except ImportError:
        return None
    return cpu_block_gemv.dequant_rows if cpu_block_gemv.supports(qtype) else None


def table_rows(tensor, scale: float | None = None):
    """A source for a loaded tensor: the tensor itself when the loader hands over a row source (GGUFRows),
    FileRows where the loader left it in the file (a view that carries file_region = (path, byte offset):
    ember.loader.mapped_safetensors), else TensorRows."""
    if isinstance(tensor, GGUFRows):
        return tensor
    region = getattr(tensor, "file_region", None)
    if region is None:
        return TensorRows(tensor, scale)
    return FileRows(tensor, region[0], region[1], scale)


RESIDENT_CHUNK_ROWS = 1 << 16


def resident_rows(source, device, dtype: torch.dtype) -> TensorRows:
    """The whole source read onto `device` (--no-ple-offload: a table that fits the device), a chunk of rows at
    a time: float rows as they are (an fp8 shard keeps its bytes and its scale), block types dequantized."""
    if isinstance(source, (TensorRows, FileRows)):
        return TensorRows(source.tensor.to(device), source.scale)
    out = torch.empty(source.num_rows, source.dim, dtype=dtype, device=device)
    for at in range(0, source.num_rows, RESIDENT_CHUNK_ROWS):
        rows = torch.arange(at, min(at + RESIDENT_CHUNK_ROWS, source.num_rows))
        out[at : at + len(rows)] = source.read(rows, dtype).to(device)
    return TensorRows(out)
