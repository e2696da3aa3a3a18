"""Without a GPU, the Triton kernels in this folder run in Triton's interpreter on CPU tensors.

The attention kernels use tl.max / tl.sum, which triton decorates with @jit when it is first
imported, so TRITON_INTERPRET must be set before that import: conftest files are imported at
collection, before any test module imports triton (test_triton_awq's own fixture keeps working:
it sets the same value).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
