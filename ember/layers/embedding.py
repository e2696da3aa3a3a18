"""Token embedding and LM head. A tied head shares the embedding's Parameter (one copy in memory).

A quant_method (GGUF: ember.quant.gguf_quant.GGUFEmbeddingMethod) replaces the dense `weight`
by packed data: then `weight` is an empty placeholder, the lookup is `method.embed(ids)` and the
head `method.logits(hidden)`. A tied head takes the embedding's method, and with it its data.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.linear import copy_checked


def _param(vocab_size, hidden_size, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False)


def _make_weight(module: nn.Module, vocab_size, hidden_size, dtype, device) -> None:
    if module.quant_method is None:
        module.weight = _param(vocab_size, hidden_size, dtype, device)
    else:
        module.quant_method.create_weights(module, vocab_size, hidden_size, dtype, device)


def _load(module: nn.Module, param_name: str, tensor, shard_id):
    if module.quant_method is None:
        copy_checked(getattr(module, param_name), tensor, param_name)
    else:
        module.quant_method.load_weight(module, tensor)
    return param_name, shard_id


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", quant_method=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.quant_method = quant_method
        _make_weight(self, vocab_size, hidden_size, dtype, device)

    def load_weight(self, param_name: str, tensor, shard_id=None):
        return _load(self, param_name, tensor, shard_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embed(input_ids)
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, V] in float32 (sampling and logprobs want fp32)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tied_to: VocabEmbedding | None = None, quant_method=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tied_to is not None
        if self.tied:
            # The embedding's storage, whatever it is: its Parameter, or its packed method.
            self.quant_method = tied_to.quant_method
            if hasattr(self.quant_method, "serves_head"):  # it must now keep a fast matmul form
                self.quant_method.serves_head = True
            self.weight = tied_to.weight
        else:
            self.quant_method = quant_method
            _make_weight(self, vocab_size, hidden_size, dtype, device)

    def load_weight(self, param_name: str, tensor, shard_id=None):
        return _load(self, param_name, tensor, shard_id)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.logits(hidden).float()
        # GEMM in the model dtype (as HF does), upcast after.
        return F.linear(hidden, self.weight).float()
