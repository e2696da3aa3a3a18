"""ModelRunner: turns a SchedulerOutput into one varlen forward, then samples.

Inputs are flattened over all scheduled requests: input_ids, positions and slot_mapping per
token; query_start_loc, seq_lens and block_tables per request. Logits are computed only at
the last token of requests whose step reaches their end (a mid-prompt chunk samples nothing),
and at every draft token a request verifies: its 1 + d rows go to the rejection sampler.
The per-layer KV caches are allocated here, zeroed, in kv_dtype (the model's dtype, or fp8:
the Attention layers quantize into them); ember.engine.planner sizes them.

A drafter that reads the target's hidden states (MTP: reads_step "hidden") gets keep_hidden:
the last layer then runs for every row (no RowSelection: a prefill chunk's rows all feed the MTP
layer) and the step's final-normed hidden states, positions and slots are kept (StepRows) until
the engine takes them for the drafter (take_last_step); keep_rows keeps the same without the
hidden states, for a draft model that only needs to know which rows the step computed. Its own
KV layers come from allocate_kv: same block ids, same slot_mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.config.model_config import ModelConfig
from ember.engine.executor.base import EagerExecutor, StepExecutor
from ember.engine.scheduler import SchedulerOutput
from ember.kernels.metadata import AttentionMetadata, RecurrentMetadata, RowSelection, select_rows
from ember.layers.sampler import SampledToken, Sampler, SamplingRow, make_generator, token_logprobs
from ember.request import Request
from ember.spec.proposer import StepRows
from ember.spec.rejection import RejectionSampler, VerifyRequest


@dataclass
class StepBatch:
    """One step's inputs, flattened over its requests (ModelRunner.prepare), and what execute needs
    of them after the forward."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: list[int]  # flat rows whose logits are sampled (1 + d per sampling request)
    sampling_requests: list[Request]  # requests whose step reaches their end (a mid-prompt chunk samples nothing)
    select: RowSelection | None  # the last layer restricted to logit_rows; None: every row
    entries: list[tuple[Request, int, int, int]]  # (request, first row, first position, rows)
    tables: list[list[int]]  # the block table of each request, padded
    prompt_rows: list[tuple[Request, int, int]]  # (request, flat row, prompt position) scoring token p + 1


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        num_kv_heads: int | None = None,
        generators: dict[str, torch.Generator] | None = None,
        state_slots: int = 0,
    ):
        """num_kv_heads: this rank's kv heads under tensor parallelism (default: the model's);
        generators: the per-request seeded generators (shared with a drafter that samples);
        state_slots: a hybrid model's recurrent-state slots (live + snapshots; ember.engine.state_slots)."""
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype
        # One cache per layer: paged KV for an attention layer, a RecurrentState for a hybrid's
        # linear-attention layer.
        self.state_slots = state_slots if model_config.is_hybrid else 0
        states = (
            model.make_recurrent_states(state_slots, device)
            if model_config.is_hybrid
            else [None] * model_config.num_layers
        )
        self.recurrent_states = [st for st in states if st is not None]
        self.kv_caches = [
            st
            if st is not None
            else torch.zeros(
                2,
                num_blocks,
                block_size,
                num_kv_heads or model_config.num_kv_heads,
                model_config.head_dim,
                dtype=kv_dtype,
                device=device,
            )
            for st in states
        ]
        self.extra_kv_caches: list[torch.Tensor] = []  # a drafter's own layers (MTP), same block ids
        self.sampler = Sampler()
        self.rejection = RejectionSampler()
        self.generators: dict[str, torch.Generator] = {} if generators is None else generators
        self.keep_hidden = False  # a drafter reads every row's hidden state (see StepRows)
        self.keep_rows = False  # a drafter reads the step's layout only (a draft model): last_step without hidden
        self.last_step: StepRows | None = None
        # How the forward runs (eager, compiled, CUDA graph); the engine may swap in another.
        self.executor: StepExecutor = EagerExecutor(model, self.kv_caches)

    def allocate_kv(self, num_heads: int, head_dim: int, extra_blocks: int = 0) -> torch.Tensor:
        """One more zeroed KV layer in the pool's layout: block b is the main layers' block b (a
        drafter's layer shares the block tables); extra_blocks more at the end are the caller's
        own scratch, never handed out by the block manager."""
        cache = torch.zeros(
            2,
            self.num_blocks + extra_blocks,
            self.block_size,
            num_heads,
            head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.extra_kv_caches.append(cache)
        return cache

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logit_rows: list[int] = []  # flat indices of the tokens whose logits are sampled (1 + d per sampling request)
        sampling_reqs: list[Request] = []  # requests whose step reaches their end (a mid-prompt chunk samples nothing)
        logit_seqs: list[int] = []  # the sequence (batch index) of each logit row
        entries: list[tuple[Request, int, int, int]] = []  # (request, first row, first position, rows)
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, flat row, prompt position) scoring token p + 1
        rec = RecurrentMetadata([], [], [], []) if self.recurrent_states else None
        for req, n in out.scheduled:
            start = req.num_computed_tokens
            end = start + n
            draft = out.drafts.get(req.request_id)
            d = len(draft) if draft is not None else 0
            entries.append((req, query_start[-1], start, n))
            input_ids.extend(req.token_ids[start : end - d])
            if req.prompt_logprobs is not None:
                last = min(end, req.num_prompt_tokens - 1)  # the last prompt row scores the first output token
                prompt_rows.extend(
                    (req, query_start[-1] + p - start, p)
                    for p in range(start, last)
                    if p + 1 >= len(req.prompt_logprobs)
                )  # a recompute adds nothing twice
            if d:
                input_ids.extend(draft.token_ids)  # positions num_tokens.. : K/V written, kept only if accepted
            positions.extend(range(start, end))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            if rec is not None:
                rec.slots.append(req.state_slot)
                rec.has_state.append(start > 0)
                rec.num_drafts.append(d)
                rec.snapshots.append([(p - start, slot) for p, slot in req.state_plan])
            if end - d == req.num_tokens:
                logit_rows.extend(range(query_start[-1] - 1 - d, query_start[-1]))
                logit_seqs.extend([len(seq_lens) - 1] * (1 + d))
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
            recurrent=rec,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        # The last layer's work restricted to the logit rows, each as a one-token query over its
        # prefix; not when a drafter needs every row's hidden state.
        restrict = len(logit_rows) < len(input_ids) and not self.keep_hidden and not prompt_rows
        select = select_rows(meta, tables, positions, logit_rows, logit_seqs, dev) if restrict else None
        return StepBatch(ids, pos, meta, logit_rows, sampling_reqs, select, entries, tables, prompt_rows)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, banned_token_ids: dict[str, list[int]] | None = None, masks=None
    ) -> dict[str, list[SampledToken]]:
        """Run one step. Returns, for every request whose step reached its end, the tokens it
        emits: one sampled token, or its accepted drafts then one more (len - 1 = accepted).
        masks: the step's grammar bitmasks (ember.structured.masks.StepMasks), applied to the
        logits before anything samples."""
        batch = self.prepare(out)
        logit_rows, sampling_reqs = batch.logit_rows, batch.sampling_requests
        if out.state_copies:  # prefix-cache restores, before the forward reads the slots
            self.model.copy_states(self.recurrent_states, out.state_copies)
        hidden = self.executor.run(batch.input_ids, batch.positions, batch.meta, batch.select)
        keep = self.keep_hidden or self.keep_rows
        self.last_step = (
            StepRows(hidden if self.keep_hidden else None, batch.entries, batch.meta.slot_mapping, batch.tables)
            if keep
            else None
        )
        if batch.prompt_rows:
            self._score_prompt(hidden, batch.prompt_rows)
        if not logit_rows:
            return {}
        logits = self.model.compute_logits(hidden if batch.select is not None else hidden[logit_rows])
        if masks is not None:
            masks.apply(logits, self._logit_layout(out, sampling_reqs))
        if not out.drafts:
            rows = [self._row(req, banned_token_ids) for req in sampling_reqs]
            return {req.request_id: [tok] for req, tok in zip(sampling_reqs, self.sampler(logits, rows))}

        plain: list[tuple[Request, int]] = []  # (request, its logit row)
        verify: list[tuple[Request, list[int]]] = []  # (request, its 1 + d logit rows)
        r = 0
        for req in sampling_reqs:
            draft = out.drafts.get(req.request_id)
            if draft is None:
                plain.append((req, r))
                r += 1
            else:
                verify.append((req, list(range(r, r + 1 + len(draft)))))
                r += 1 + len(draft)
        result: dict[str, list[SampledToken]] = {}
        if plain:
            rows = [self._row(req, banned_token_ids) for req, _ in plain]
            sampled = self.sampler(logits[torch.tensor([i for _, i in plain], device=logits.device)], rows)
            result.update((req.request_id, [tok]) for (req, _), tok in zip(plain, sampled))
        if verify:
            items = []
            for req, _ in verify:
                draft = out.drafts[req.request_id]
                items.append(
                    VerifyRequest(
                        [self._row(req, banned_token_ids, draft.token_ids[:j]) for j in range(1 + len(draft))], draft
                    )
                )
            v_rows = torch.tensor([i for _, rs in verify for i in rs], device=logits.device)
            emitted = self.rejection(logits[v_rows], items)
            result.update((req.request_id, toks) for (req, _), toks in zip(verify, emitted))
            if self.recurrent_states:  # each verify's state moves to its last accepted token
                self.model.commit_states(
                    self.recurrent_states, {req.state_slot: len(toks) - 1 for (req, _), toks in zip(verify, emitted)}
                )
        return result

    def _score_prompt(self, hidden: torch.Tensor, rows: list[tuple[Request, int, int]]) -> None:
        """Prompt logprobs of this step's prompt rows, appended to their requests (row p scores token p + 1)."""
        logits = self.model.compute_logits(hidden[torch.tensor([r for _, r, _ in rows], device=hidden.device)])
        tops = [req.sampling_params.prompt_logprobs for req, _, _ in rows]  # -1 was resolved at admission
        found = token_logprobs(logits, [req.token_ids[p + 1] for req, _, p in rows], tops)
        for (req, _, _), lps in zip(rows, found):
            req.prompt_logprobs.append(lps)

    @staticmethod
    def _logit_layout(out: SchedulerOutput, sampling_reqs: list[Request]) -> list[tuple[str, int]]:
        """(request id, its first logit row): one row per sampling request, 1 + d for a verify."""
        layout, r = [], 0
        for req in sampling_reqs:
            layout.append((req.request_id, r))
            draft = out.drafts.get(req.request_id)
            r += 1 + (len(draft) if draft is not None else 0)
        return layout

    def _row(self, req: Request, banned: dict[str, list[int]] | None, drafts: list[int] = ()) -> SamplingRow:
        """drafts: the draft tokens before this verify row, part of its history (penalties, min_tokens)."""
        params = req.sampling_params
        gen = None
        if params.seed is not None and not params.greedy:
            gen = self.generators.get(req.request_id)
            if gen is None:
                gen = self.generators[req.request_id] = make_generator(params.seed)
        return SamplingRow(
            params=params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids + list(drafts) if drafts else req.output_token_ids,
            generator=gen,
            banned_token_ids=banned.get(req.request_id) if banned else None,
        )

    def take_last_step(self) -> StepRows | None:
        """What the last step kept for the drafter (once: the hidden states are not kept past it)."""
        step, self.last_step = self.last_step, None
        return step

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
