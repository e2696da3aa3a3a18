"""Without a GPU, the Triton kernels in this folder run in Triton's interpreter on CPU tensors.

The attention kernels use tl.max / tl.sum, which triton decorates with @jit when it is first
imported, so TRITON_INTERPRET must be set before that import: conftest files are imported at
collection, before any test module imports triton (test_triton_awq's own fixture keeps working:
it sets the same value).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _threads_split_the_work():
    """The C++ kernels split their work over torch's threads (sequences x heads, row tiles): every
    test here runs on at least two, even in an xdist worker pinned to one core (tests/conftest.py),
    so a split that loses or repeats a piece fails here, not only on a user's many-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)
