"""The Triton QSA selected-block attention (ember/kernels/triton_qsa.py) against the masked torch reference
on the C++ kernel's test steps (tests/kernels/test_cpu_qsa_attention.QSAStep): decodes and a prefill chunk
in one step, GQA groups 1 / 2 / 6, budgets below and above the visible blocks, one split and several (the
merge). Without a GPU they run in Triton's interpreter (tests/kernels/conftest.py), at tiny shapes; bf16
there checks the kernel's fp32-dot path (ember/kernels/triton_utils.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ember.kernels.triton_qsa import qsa_attention  # noqa: E402
from tests.kernels.test_cpu_qsa_attention import QSAStep, assert_close  # noqa: E402
from tests.models.tiny_models import one_thread  # noqa: E402

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(step: QSAStep, scale: float, **kw) -> torch.Tensor:
    s = step.sel
    to = [t.to(DEVICE) for t in (step.q, step.cache, step.block_tables, s.seq_idx, s.blocks, s.tail_start, s.kv_lens)]
    return qsa_attention(*to, s.ratio, scale, **kw).cpu()


@pytest.mark.parametrize(
    "group,dtype,block_size,k,splits",
    [
        (1, torch.float32, 16, 3, 1),
        (2, torch.float32, 32, 40, 2),
        (6, torch.float32, 16, 5, 3),
        (2, torch.bfloat16, 16, 4, 2),
    ],
)
def test_matches_the_masked_reference(group, dtype, block_size, k, splits):
    step = QSAStep([1, 5, 1], [45, 71, 6], k, 16, group, block_size, dtype, seed=group + k)
    assert_close(run(step, 0.25, num_splits=splits, block_n=16), step.reference(0.25))
