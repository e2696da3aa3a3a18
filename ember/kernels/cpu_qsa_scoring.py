"""QSA block scoring and top-k selection on CPU (qwen4_exp's indexer, ember/layers/qsa.py QSAIndexer.select_blocks).

Contract: query row i (q [T, heads, d], float32 or bf16) of sequence seq_idx[i] sees that sequence's first nc[i]
block keys (keys [B, nb, d] float32, as QSAIndexer.batch_block_keys pools them); a block's score is
sum_h ReLU(q_h . K_b) / sqrt(d) in float32 (divided, as the torch path divides), and the row keeps the ids of
its k best visible blocks, ascending, then -1 pads: every visible block where nc[i] <= k. Ties at the cut are
broken as torch.topk over the row's nc[i] scores breaks them (qsa.top_blocks' rule): the kernel runs the same
standard partial sort / selection ATen's CPU topk runs on the same (value, index) queue.

Why a kernel: the torch path builds the scores [rows, heads, nb] of a tile, ReLUs and sums them in three passes,
runs a batched top-k over rows padded to the longest sequence, and asks torch.topk again for each row whose cut
ties; the kernel scores each row's visible blocks in registers (a key read once for all heads) and selects in
the same pass. Rows of a step go to the threads longest first. AVX-512 and AVX2 + FMA builds (16 or 8 float
lanes, the same loops); on by default where --cpu-paged-attention is (CpuKernels.qsa_scoring). Dispatcher ops
with fake kernels: a compiled decode step selects with it too (ember.layers.qsa_graph), sync-free (each row's
selection is the row's own, at a fixed width k).
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build

SOURCE = "cpu_qsa_scoring.cpp"
Q_DTYPES = (torch.float32, torch.bfloat16)


def _fake_select(q, keys, seq_idx, nc, k):
    return seq_idx.new_empty((q.shape[0], k))


def _fake_scores(q, keys, seq_idx, nc):
    return keys.new_empty((q.shape[0], keys.shape[1]))


# the shapes torch.compile traces the ops with
FAKES = {"ember_cpu::qsa_select_blocks": _fake_select, "ember_cpu::qsa_block_scores": _fake_scores}


def available() -> bool:
    """The ops can run here (AVX-512 or AVX2 + FMA; loaded, built once first where they were not built at install)."""
    return build(SOURCE, fakes=FAKES) is not None


def supports(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Tensors the compiled kernel takes (else the caller uses the torch path)."""
    return q.device.type == "cpu" and keys.device.type == "cpu" and q.dtype in Q_DTYPES and available()


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def select_blocks(q: torch.Tensor, keys: torch.Tensor, seq_idx: torch.Tensor, nc: torch.Tensor, k: int) -> torch.Tensor:
    """q [T, heads, d], keys [B, nb, d], seq_idx / nc [T] -> blocks [T, k] int32 (the module docstring). Call
    where supports()."""
    return torch.ops.ember_cpu.qsa_select_blocks(q.contiguous(), keys.float().contiguous(), _i32(seq_idx), _i32(nc), k)


def block_scores(q: torch.Tensor, keys: torch.Tensor, seq_idx: torch.Tensor, nc: torch.Tensor) -> torch.Tensor:
    """The scores select_blocks ranks: [T, nb] float32, -inf past each row's nc visible blocks."""
    return torch.ops.ember_cpu.qsa_block_scores(q.contiguous(), keys.float().contiguous(), _i32(seq_idx), _i32(nc))
