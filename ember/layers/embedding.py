"""Token embedding and LM head. A tied head shares the embedding's Parameter (one copy in memory).

A quant_method (GGUF: ember.quant.gguf_quant.GGUFEmbeddingMethod) replaces the dense `weight`
by packed data: then `weight` is an empty placeholder, the lookup is `method.embed(ids)` and the
head `method.logits(hidden)`. A tied head takes the embedding's method, and with it its data.

Tensor parallelism (vocab-parallel): rank r holds rows [r * Vp, (r + 1) * Vp) of the table,
Vp = ceil(V / tp), the last rank's tail padded with zero rows. The embedding looks up its own
ids, zeroes the others and all-reduces; the head computes its Vp logit columns and all-gathers
them (then drops the padding). Dense weights only: packed GGUF tables are refused under TP
(ember.engine.tp.config), a GGUF model runs dequantized there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.linear import copy_checked, dense_linear, get_tp_rank_size


def _param(vocab_size, hidden_size, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False)


def _make_weight(module: nn.Module, vocab_size, hidden_size, dtype, device) -> None:
    module.tp_rank, module.tp_size = get_tp_rank_size()
    if module.quant_method is None:
        rows = -(-vocab_size // module.tp_size)  # this rank's rows (all of them without TP)
        module.vocab_start = module.tp_rank * rows
        module.weight = _param(rows, hidden_size, dtype, device)
    elif module.tp_size > 1:
        raise ValueError("a packed (GGUF) embedding cannot be vocab-sharded; dequantize it under tensor parallelism")
    else:
        module.quant_method.create_weights(module, vocab_size, hidden_size, dtype, device)


def _load(module: nn.Module, param_name: str, tensor, shard_id):
    if module.quant_method is None:
        if module.tp_size > 1 and param_name == "weight":  # this rank's rows, zero-padded at the vocab's end
            param = module.weight
            rows = tensor[module.vocab_start : module.vocab_start + param.shape[0]]
            if tensor.shape[0] != module.vocab_size:
                rows = tensor  # let copy_checked name the mismatch
            elif rows.shape[0] < param.shape[0]:
                rows = torch.cat([rows, rows.new_zeros(param.shape[0] - rows.shape[0], *rows.shape[1:])])
            tensor = rows
        copy_checked(getattr(module, param_name), tensor, param_name)
    else:
        module.quant_method.load_weight(module, tensor)
    return param_name, shard_id


class VocabEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant_method=None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.quant_method = quant_method
        _make_weight(self, vocab_size, hidden_size, dtype, device)

    def load_weight(self, param_name: str, tensor, shard_id=None):
        return _load(self, param_name, tensor, shard_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embed(input_ids)
        if self.tp_size > 1:
            from ember.distributed.comm import all_reduce

            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.weight.shape[0])
            h = F.embedding(local.masked_fill(outside, 0), self.weight)
            return all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, V] in float32 (sampling and logprobs want fp32)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tied_to: VocabEmbedding | None = None,
        quant_method=None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tied_to is not None
        if self.tied:
            # The embedding's storage, whatever it is: its Parameter, or its packed method.
            self.quant_method = tied_to.quant_method
            if hasattr(self.quant_method, "serves_head"):  # it must now keep a fast matmul form
                self.quant_method.serves_head = True
            self.weight = tied_to.weight
            self.tp_rank, self.tp_size = tied_to.tp_rank, tied_to.tp_size
        else:
            self.quant_method = quant_method
            _make_weight(self, vocab_size, hidden_size, dtype, device)

    def load_weight(self, param_name: str, tensor, shard_id=None):
        return _load(self, param_name, tensor, shard_id)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.logits(hidden).float()
        # GEMM in the model dtype (as HF does), upcast after.
        logits = dense_linear(hidden, self.weight).float()
        if self.tp_size > 1:
            from ember.distributed.comm import all_gather

            logits = all_gather(logits, dim=-1)[..., : self.vocab_size]
        return logits
