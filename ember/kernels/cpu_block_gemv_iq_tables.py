"""The IQ types' lookup tables, read from the installed gguf-py (gguf.quants), for the C++ block
kernels' set_iq_table (cpu_block_gemv_iq.cpp): name -> bytes, one byte per grid element.

gguf-py keeps each grid packed (2 or 3 bits an element, hex-coded) and decodes it with its own
`init_grid`; the decoded float grid holds the real magnitudes (8/25/43 for the IQ2 types, 4..62 for
IQ3_XXS, 1..15 for IQ3_S, -1/0/1 for IQ1), which fit a byte each. Reading them from the package, not
pasting them, keeps ember's kernels on the very tables its reference dequantizer uses.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def iq_tables() -> dict[str, bytes]:
    """name -> the table's bytes, as set_iq_table expects them (names and sizes: cpu_block_gemv_iq.cpp)."""
    from gguf import quants

    def grid(cls, dtype) -> bytes:
        cls.init_grid()
        return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape)).astype(dtype).tobytes()

    return {
        "iq2xxs_grid": grid(quants.IQ2_XXS, np.uint8),
        "iq2xs_grid": grid(quants.IQ2_XS, np.uint8),
        "iq2s_grid": grid(quants.IQ2_S, np.uint8),
        "iq3xxs_grid": grid(quants.IQ3_XXS, np.uint8),
        "iq3s_grid": grid(quants.IQ3_S, np.uint8),
        "iq1s_grid": grid(quants.IQ1_S, np.int8),
        "ksigns": bytes(quants.IQ2_XXS.ksigns),
    }
