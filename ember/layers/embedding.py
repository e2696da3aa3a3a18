"""Token embedding and LM head. A tied head shares the embedding's Parameter (one copy in memory)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(vocab_size, hidden_size, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", quant_method=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.quant_method = quant_method  # packed weights (GGUF) replace `weight`; see ember.quant
        self.weight = _param(vocab_size, hidden_size, dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, V] in float32 (sampling and logprobs want fp32)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tied_to: VocabEmbedding | None = None, quant_method=None):
        super().__init__()
        self.quant_method = quant_method
        self.vocab_size = vocab_size
        self.tied = tied_to is not None
        if self.tied:
            self.weight = tied_to.weight
        else:
            self.weight = _param(vocab_size, hidden_size, dtype, device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # GEMM in the model dtype (as HF does), upcast after.
        return F.linear(hidden, self.weight).float()
