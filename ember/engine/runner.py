"""ModelRunner: turns a SchedulerOutput into one varlen forward, then samples.

Inputs are flattened over all scheduled requests: input_ids, positions and slot_mapping per
token; query_start_loc, seq_lens and block_tables per request. Logits are computed only at
the last token of requests whose step reaches their end (a mid-prompt chunk samples nothing).
The per-layer KV caches are allocated here, zeroed, in kv_dtype (the model's dtype, or fp8:
the Attention layers quantize into them); ember.planner sizes them.
"""
from __future__ import annotations

import torch

from ember.engine.request import Request
from ember.engine.scheduler import SchedulerOutput
from ember.kernels.metadata import AttentionMetadata, RowSelection
from ember.layers.sampler import SampledToken, Sampler, SamplingRow, make_generator
from ember.model_config import ModelConfig


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, device: torch.device):
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim,
                        dtype=kv_dtype, device=device)
            for _ in range(model_config.num_layers)
        ]
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.select: RowSelection | None = None  # set by prepare() for the step it prepares

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Request]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logit_rows: list[int] = []  # flat index of the token whose logits are sampled, per sampling request
        sampling_reqs: list[Request] = []  # requests whose step reaches their end (a mid-prompt chunk samples nothing)
        logit_seqs: list[int] = []  # the sequence (batch index) of each logit row
        for req, n in out.scheduled:
            start = req.num_computed_tokens
            end = start + n
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            if end == req.num_tokens:
                logit_rows.append(query_start[-1] - 1)
                logit_seqs.append(len(seq_lens) - 1)
                sampling_reqs.append(req)
        max_blocks = max(len(req.block_ids) for req, _ in out.scheduled)
        tables = [req.block_ids + [0] * (max_blocks - len(req.block_ids)) for req, _ in out.scheduled]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            block_size=bs,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            all_slots_valid=True,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        self.select = self._selection(meta, tables, positions, logit_rows, logit_seqs) if len(logit_rows) < len(input_ids) else None
        return ids, pos, meta, logit_rows, sampling_reqs

    def _selection(self, meta: AttentionMetadata, tables: list[list[int]], positions: list[int], rows: list[int],
                   seqs: list[int]) -> RowSelection:
        """The last layer's work restricted to the logit rows, each as a one-token query over its prefix."""
        dev = self.device
        if not rows:
            return RowSelection(torch.empty(0, dtype=torch.int64, device=dev), None)
        # Each row attends to the keys up to its own position (a verify step's draft rows sit
        # inside their sequence; a last token's position + 1 is its sequence's length).
        seq_lens = [positions[r] + 1 for r in rows]
        row_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping[row_t],
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([tables[b] for b in seqs], dtype=torch.int32, device=dev),
            block_size=meta.block_size, query_lens_cpu=[1] * len(rows), seq_lens_cpu=seq_lens,
            max_query_len=1, max_seq_len=max(seq_lens), all_slots_valid=True)
        return RowSelection(row_t, sub)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, banned_token_ids: dict[str, list[int]] | None = None
                ) -> dict[str, SampledToken]:
        """Run one step. Returns the sampled token of every request whose step reached its end."""
        ids, pos, meta, logit_rows, sampling_reqs = self.prepare(out)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.select)
        if not logit_rows:
            return {}
        logits = self.model.compute_logits(hidden if self.select is not None else hidden[logit_rows])
        rows = [self._row(req, banned_token_ids) for req in sampling_reqs]
        sampled = self.sampler(logits, rows)
        return {req.request_id: tok for req, tok in zip(sampling_reqs, sampled)}

    def _row(self, req: Request, banned: dict[str, list[int]] | None) -> SamplingRow:
        params = req.sampling_params
        gen = None
        if params.seed is not None and not params.greedy:
            gen = self.generators.get(req.request_id)
            if gen is None:
                gen = self.generators[req.request_id] = make_generator(params.seed)
        return SamplingRow(
            params=params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            generator=gen,
            banned_token_ids=banned.get(req.request_id) if banned else None,
        )

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
