"""MTP proposer: the model's own multi-token-prediction layer(s) draft k tokens (formats.md §4).

Weights come through ember.spec.mtp_weights.load_mtp: the model's own checkpoint (`--enable-mtp`)
or a separate MTP folder (`--speculative-model DIR`, e.g. one written by `ember train-mtp`).

KV. Each MTP layer has its own paged cache in the runner's pool (ModelRunner.allocate_kv): the
same block ids, tables and slot_mapping as the main layers, so the engine sizes the pool with
one more layer per MTP layer (kv_bytes_per_token below; ember.engine.planner counts it the same way).
Position i of that cache holds the MTP's K/V for the row (t_{i+1}, position i, h_i).

After every step (after_step) the MTP runs over the rows the target just computed, the fill:
  row i gets input_ids = t_{i+1}, position i, hidden h_i (the target's final-normed hidden state;
  the runner keeps every row's, see ModelRunner.keep_hidden). So
  - a prefill chunk that ends mid-prompt fills all its rows, its last one with the next prompt token;
  - a step that reaches the request's end fills up to the just-sampled token;
  - a verify fills only the kept positions: the accepted drafts and the token emitted after them
    (a rejected draft's row is never filled; its slot is rewritten when the position is reached).
  Requests that finished in the step are filled too (their freed blocks are not reused before the
  next schedule), so a block the prefix cache names holds the MTP's K/V as well.
  A running request that will not draft next (adaptive k has turned it off between probes, or drafting
  is off at this batch size, or its prompt goes on) puts its rows off: their hidden states wait, up to
  DEFER_ROWS rows, and are filled in one batch before its next fill's rows. At acceptance near zero a
  fill of one row every step was what speculation still cost (a draft layer's weights read each step).
The fill's last row of a request that decodes next gives g_c (c = num_tokens - 2, the position
of its last computed token): draft 1 = argmax of compute_logits(g_c, step 0).

propose() then drafts recursively: step j (1 .. k-1) takes token = draft j, position c + j,
hidden = the g of step j - 1 and runs MTP layer j % num_layers; draft j + 1 = argmax of its logits
(a layer with a reduced draft vocabulary proposes draft_vocab[argmax]) for a greedy request, which
keeps its exact output. A sampled request's draft is drawn from q = softmax(logits / T) and handed
over with q, so the rejection sampler accepts with min(1, p / q) and the output keeps its exact
distribution.

The chain's K/V (positions c + 1 ..) never touch the request's blocks: the MTP caches carry
scratch blocks past the pool's (never handed out by the block manager). The chain's table is
the request's blocks up to position c, then its scratch blocks, the first one a copy of the
request's partly filled block. Real blocks only ever hold verified fills, so the drafts after a
chunked prefill equal those after an unchunked one, and nothing is allocated for drafting.

Known approximations (they change drafts, never output):
- With n > 1 MTP layers, layer j >= 1 is only run by the chain: its cache holds nothing but the
  current chain (vLLM has the same limitation; published checkpoints and `ember train-mtp` use n = 1).
- Prefix cache: position i's MTP K/V depends on t_{i+1}; a request that reuses another's full
  blocks reuses its MTP K/V, and the last position of the last shared block was written with the
  other request's next token. A block cached while its request's rows are put off has no MTP K/V for
  them until that request's next fill.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from ember.kernels import cpu_row_top
from ember.kernels.metadata import AttentionMetadata, select_rows
from ember.request import Draft, Request, RequestStatus
from ember.spec.proposer import ExecutorFactory, KVSlots, Proposer, ProposerContext, StepRows

if TYPE_CHECKING:
    from ember.config.speculative import SpeculativeConfig

logger = logging.getLogger("ember")
# rows a request that does not draft next may put off before its fill runs anyway: one fill of up to this
# many rows reads the layer's weights once; the held hidden states are DEFER_ROWS x hidden_size a request
DEFER_ROWS = 32


class MTPProposer(Proposer):
    reads_step = "hidden"  # the fill runs over every row the target computed, from its hidden state

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext):
        from ember.spec.mtp_weights import load_mtp

        loaded = ctx.target
        t0 = time.perf_counter()
        self.mtp = load_mtp(loaded.model, loaded.path, spec.model)
        self.device = self.mtp.device
        self.packed_bytes_saved = self._pack_draft_weights(ctx)
        self.num_layers = self.mtp.num_layers
        self.num_speculative_tokens = self.num_layers  # vLLM's default when k is not given
        self.k_max = spec.num_speculative_tokens or self.num_layers
        self.max_num_seqs = ctx.max_num_seqs
        self.block_size = ctx.block_size
        self.draft_token_cost = self._draft_token_cost(loaded)
        self.mtp = ctx.mirror(self.mtp)  # under TP its forwards are replayed on the workers' shards
        self.generators = ctx.generators  # the sampler's per-request seeded generators
        self.caches: list[torch.Tensor] = []
        self.fill_executor = None  # a CompiledExecutor / CUDAGraphExecutor of the fill's decode shapes (prepare)
        # request id -> (c, g_c [1, H]): the fill's last row of a request that decodes next
        self.starts: dict[str, tuple[int, torch.Tensor]] = {}
        self.deferred: dict[str, _Deferred] = {}  # request id -> its rows whose fill waits (after_step)
        logger.info(
            "MTP: %d layer(s) (%s layout) from %s in %.1fs, draft cost %.2f of a decode step",
            self.num_layers,
            self.mtp.layout,
            spec.model or loaded.path,
            time.perf_counter() - t0,
            self.draft_token_cost,
        )

    # -- sizing and setup ---------------------------------------------------------------------
    def _pack_draft_weights(self, ctx: ProposerContext) -> int:
        """CPU: the MTP layers' Linears, experts and own head to group-32 8-bit codes (ember.quant.rtn_tiled)
        where the tiled kernel runs in the layers' dtype (bf16, or float32 on AVX2), else in bf16
        to int4 (ember.quant.rtn_int4).
        A draft step reads its weights for one row, so bytes are its cost; drafts may change a little,
        the output cannot (the target verifies). Not under tensor parallelism (the workers replay
        the MTP on their own dense shards)."""
        from ember.quant.rtn_int4 import pack_module_int4
        from ember.quant.rtn_tiled import pack_experts_tiled, pack_module_tiled

        if self.device.type != "cpu" or ctx.tensor_parallel:
            return 0
        # 8-bit tiles where the tiled kernel runs: drafts closer to the dense layer's (rtn_tiled.py). The whole
        # module (qwen4_exp's input fusion and final mixer sit beside its layer; the model's embedding and head
        # are plain attributes, never packed here), a MoE draft layer's experts too (a row reads its top-k's tiles)
        saved, kind = pack_module_tiled(self.mtp, ctx.kernels), "8-bit tiles"
        saved += pack_experts_tiled(self.mtp, ctx.kernels)
        if not saved and self.mtp.dtype == torch.bfloat16:
            saved, kind = pack_module_int4(self.mtp), "int4"
        if saved:
            logger.info("MTP: draft weights packed to %s on CPU (%.1f MB saved)", kind, saved / 1e6)
        return saved

    def _draft_token_cost(self, loaded) -> float:
        """One draft step's weight bytes over the target's (CPU decode is bandwidth bound): an MTP
        layer plus the head it scores with (a reduced draft vocabulary makes that small)."""
        layer = self.mtp.layers[0]
        own = sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))
        if layer.head is None:  # the main LM head
            head = self.mtp._lm_head
            own += sum(p.numel() * p.element_size() for p in head.parameters())
            own += sum(b.numel() * b.element_size() for b in head.buffers())
        return float(min(1.0, max(0.01, own / max(1, loaded.weight_bytes))))

    def kv_shape(self) -> tuple[int, int]:
        """(kv heads, head_dim) of each MTP layer's cache."""
        _, _, _, heads, dim = self.mtp.kv_cache_shape(1, 1)
        return heads, dim

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """KV bytes per token of the MTP layers: 2 x n x Hkv x D x elem (ember.engine.planner's formula), or
        the module's own count (qwen4_exp's layer keeps an indexer key per token too)."""
        if hasattr(self.mtp, "kv_bytes_per_token"):
            return self.mtp.kv_bytes_per_token(elem_bytes)
        heads, dim = self.kv_shape()
        return 2 * self.num_layers * heads * dim * elem_bytes

    def scratch_blocks_per_request(self) -> int:
        """Blocks spanned by a chain: positions c + 1 .. c + k - 1 from any offset in a block."""
        if self.k_max < 2:
            return 0
        return (self.block_size - 1 + self.k_max - 1 - 1) // self.block_size + 1

    def attach(self, slots: KVSlots) -> None:
        """Allocate the MTP layers' caches in the pool (+ scratch blocks for the chains)."""
        heads, dim = self.kv_shape()
        self.scratch_base = slots.num_blocks
        self.scratch_per_req = self.scratch_blocks_per_request()
        extra = self.max_num_seqs * self.scratch_per_req
        self.caches = [slots.allocate(heads, dim, extra) for _ in range(self.num_layers)]

    def prepare(self, make_executor: ExecutorFactory) -> None:
        """With the compiled CPU executor, compile the fill too, at the main executor's sizes and query
        lengths: at batch 1 the fill runs 1 or 1 + k rows after every step, and eagerly it cost
        ~0.8 ms of a ~6 ms MTP step on the default model, half of it module and op dispatch. With
        CUDA graphs, capture it the same way (a layer's worth of kernel launches per draft step)."""
        # a row's hidden state: hidden_size, or the module's own width (qwen4_exp's: the n streams' residual)
        width = getattr(self.mtp, "hidden_width", self.mtp.cfg.hidden_size)
        hidden = ((width,), self.mtp.dtype)
        self.fill_executor = make_executor(_FillStep(self.mtp), self.caches, (hidden,), "MTP fill")

    # -- the fill -----------------------------------------------------------------------------
    @torch.inference_mode()
    def after_step(self, step: StepRows | None, drafting: set[str] | None = None) -> None:
        """Run the MTP over the rows the last step kept (see the module docstring), after the rows put off
        before; remember g_c of every request that decodes next. A running request that propose will not
        be asked about (drafting: adaptive k off between probes, drafting disabled at this batch size, a
        prompt's middle) puts its rows off instead, up to DEFER_ROWS, to be filled in one batch with its
        next filled step: a fill of one row every step cost a draft layer's read of its weights each time."""
        self.starts.clear()
        if step is not None:
            fill = _FillRows()
            for b, (req, row0, start, n) in enumerate(step.entries):
                m = min(n, req.num_tokens - 1 - start)  # rows whose next token is known (and kept)
                if m <= 0:
                    continue
                hidden, slots = step.hidden[row0 : row0 + m], step.slot_mapping[row0 : row0 + m]
                if self._defer(req, start, m, hidden, drafting):
                    continue
                first, hidden, slots = self._with_deferred(req, start, hidden, slots, step.tables[b])
                fill.add(req, first, start + m, hidden, slots, step.tables[b])
            if fill.qlens:
                self._run_fill(fill)
        for rid in [rid for rid, d in self.deferred.items() if d.req.is_finished]:  # aborted: never in a step again
            del self.deferred[rid]

    def _defer(self, req: Request, start: int, m: int, hidden: torch.Tensor, drafting: set[str] | None) -> bool:
        """Put these m rows (positions start ..) off when the request will not draft next; False: fill them now."""
        held = self.deferred.get(req.request_id)
        if held is not None and held.end != start:  # recomputed from an earlier position (preempted): stale
            del self.deferred[req.request_id]
            held = None
        if drafting is None or req.request_id in drafting or req.status != RequestStatus.RUNNING:
            return False  # a finished request is filled now: the prefix cache may name its blocks
        if (held.rows if held is not None else 0) + m > DEFER_ROWS:
            return False
        if held is None:
            held = self.deferred[req.request_id] = _Deferred(req, start)
        held.hidden.append(hidden.clone())  # the runner's buffer is rewritten by the next step
        held.end, held.rows = start + m, held.rows + m
        return True

    def _with_deferred(self, req: Request, start: int, hidden: torch.Tensor, slots: torch.Tensor, table: list[int]):
        """(first position, hidden rows, slots) of the request's fill: its rows put off, then this step's."""
        held = self.deferred.pop(req.request_id, None)
        if held is None:
            return start, hidden, slots
        bs = self.block_size
        early = [table[p // bs] * bs + p % bs for p in range(held.start, start)]
        early_t = torch.tensor(early, dtype=slots.dtype, device=slots.device)
        return held.start, torch.cat([*held.hidden, hidden]), torch.cat([early_t, slots])

    def _run_fill(self, fill: "_FillRows") -> None:
        dev = self.device
        qsl = [0]
        for q in fill.qlens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(fill.slots),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(fill.seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(fill.tables, dtype=torch.int32, device=dev),
            block_size=self.block_size,
            query_lens_cpu=fill.qlens,
            seq_lens_cpu=fill.seq_lens,
            max_query_len=max(fill.qlens),
            max_seq_len=max(fill.seq_lens),
            all_slots_valid=True,
        )
        ids_t = torch.tensor(fill.ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(fill.positions, dtype=torch.int64, device=dev)
        hidden = torch.cat(fill.hidden)
        if self.fill_executor is not None and self.fill_executor.covers(meta):
            # every row through the graph (1 + k at most per sequence), then the rows that draft next
            g = self.fill_executor.run(ids_t, pos_t, meta, None, hidden.to(self.mtp.dtype))
            g = g[torch.tensor(fill.sel_rows, dtype=torch.int64, device=dev)]
        else:
            select = select_rows(meta, fill.tables, fill.positions, fill.sel_rows, fill.sel_seqs, dev)
            g = self.mtp(ids_t, pos_t, hidden, self.caches, meta, step=0, select=select)
        for i, req in enumerate(fill.sel_reqs):
            self.starts[req.request_id] = (req.num_tokens - 2, g[i : i + 1])

    # -- drafting -----------------------------------------------------------------------------
    def _pick(self, g: torch.Tensor, step: int, reqs: list[Request]) -> tuple[torch.Tensor, list]:
        """Draft ids [N] from layer (step % n)'s head, and per row its draft distribution q [V] or None.

        Greedy requests: the argmax (q one-hot, None). Sampled requests: a token drawn from
        q = softmax(draft logits / T) (the request's own seeded generator when it has one), handed
        to the rejection sampler with q, which accepts with min(1, p / q): for a head distilled
        towards the target, sum(min(p, q)) beats p(argmax q), the acceptance of a greedy draft."""
        sampled = [r for r, req in enumerate(reqs) if not req.sampling_params.greedy]
        if not sampled:
            propose = getattr(self.mtp, "propose_greedy", None)
            if propose is not None:
                return propose(g, step), [None] * len(reqs)
        logits, ids = self.mtp.compute_draft_logits(g, step)  # [N, V_draft] (or [N, V], ids None)
        cols = cpu_row_top.argmax(logits)
        qs: list = [None] * len(reqs)
        if sampled:
            vocab = self.mtp._lm_head.vocab_size
            gens = self.generators
            for r in sampled:
                req = reqs[r]
                q = torch.softmax(logits[r].float() / req.sampling_params.temperature, dim=-1)
                gen = gens.get(req.request_id)
                cols[r] = torch.multinomial(q, 1, generator=gen)[0]
                qs[r] = q if ids is None else q.new_zeros(vocab).index_copy_(0, ids, q)
        return (cols if ids is None else ids[cols]), qs

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[Draft | None]:
        out: list[Draft | None] = [None] * len(requests)
        live = []  # (index into requests, request, k, c)
        gs = []
        for i, (req, k) in enumerate(zip(requests, max_tokens)):
            start = self.starts.get(req.request_id)
            if start is None or start[0] != req.num_tokens - 2:
                continue  # not filled by the last step (e.g. left out of it by the budget): no guess
            live.append((i, req, min(k, self.k_max), start[0]))
            gs.append(start[1])
        self.starts.clear()  # single use: the next step's fill brings new ones
        if not live:
            return out
        g = torch.cat(gs)
        toks, qs = self._pick(g, 0, [req for _, req, _, _ in live])
        drafts = [[t] for t in toks.tolist()]
        probs = [[q] for q in qs]
        k_most = max(k for _, _, k, _ in live)
        if k_most > 1:
            self._chain(live, g, toks, drafts, probs, k_most)
        for (i, _, k, _), d, q in zip(live, drafts, probs):
            out[i] = Draft(d[:k], None if q[0] is None else torch.stack(q[:k]))
        return out

    def _chain(
        self, live, g: torch.Tensor, toks: torch.Tensor, drafts: list[list[int]], probs: list[list], k_most: int
    ) -> None:
        """Draft steps 1 .. k-1, one row per request, into scratch blocks (module docstring)."""
        bs, dev = self.block_size, self.device
        chain_tables = []
        used_layers = {self.mtp.layer_for_step(j) for j in range(1, k_most)}
        copies_src, copies_dst = [], []
        for slot, (_, req, k, c) in enumerate(live):
            b0 = (c + 1) // bs  # block of the first chain position
            scratch = [self.scratch_base + slot * self.scratch_per_req + t for t in range(self.scratch_per_req)]
            chain_tables.append(req.block_ids[:b0] + scratch)
            if (c + 1) % bs and k > 1:  # b0 also holds real positions <= c: the chain reads a copy
                copies_src.append(req.block_ids[b0])
                copies_dst.append(scratch[0])
        if copies_src:
            src = torch.tensor(copies_src, dtype=torch.int64, device=dev)
            dst = torch.tensor(copies_dst, dtype=torch.int64, device=dev)
            self.mtp.copy_cache_blocks(self.caches, sorted(used_layers), src, dst)
        width = max(len(t) for t in chain_tables)
        chain_tables = [t + [0] * (width - len(t)) for t in chain_tables]
        idx = list(range(len(live)))
        for j in range(1, k_most):
            keep = [i for i in idx if live[i][2] > j]
            if len(keep) < len(idx):
                sel = torch.tensor([idx.index(i) for i in keep], dtype=torch.int64, device=dev)
                g, toks = g[sel], toks[sel]
                idx = keep
            pos = [live[i][3] + j for i in idx]
            tables = [chain_tables[i] for i in idx]
            slots = [tables[r][p // bs] * bs + p % bs for r, p in enumerate(pos)]
            lens = [p + 1 for p in pos]
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                query_start_loc=torch.arange(len(idx) + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
                block_size=bs,
                query_lens_cpu=[1] * len(idx),
                seq_lens_cpu=lens,
                max_query_len=1,
                max_seq_len=max(lens),
                all_slots_valid=True,
            )
            pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
            if self.fill_executor is not None and self.mtp.layer_for_step(j) == 0 and self.fill_executor.covers(meta):
                # one row per sequence through layer 0: the fill's 1-query graph, on the chain's tables
                g = self.fill_executor.run(toks, pos_t, meta, None, g)
            else:
                g = self.mtp(toks, pos_t, g, self.caches, meta, step=j)
            toks, qs = self._pick(g, j, [live[i][1] for i in idx])
            for i, t, q in zip(idx, toks.tolist(), qs):
                drafts[i].append(t)
                probs[i].append(q)


@dataclass
class _Deferred:
    """A request's rows whose fill waits (positions start .. end - 1): their hidden states, copied."""

    req: Request
    start: int
    end: int = -1
    rows: int = 0
    hidden: list[torch.Tensor] = field(default_factory=list)


class _FillRows:
    """One fill's batch, built a request at a time: positions first .. end - 1 of each."""

    def __init__(self):
        self.ids, self.positions, self.hidden, self.slots = [], [], [], []
        self.qlens, self.seq_lens, self.tables = [], [], []
        self.sel_rows, self.sel_seqs, self.sel_reqs = [], [], []  # the last rows of requests that decode next

    def add(self, req: Request, first: int, end: int, hidden: torch.Tensor, slots: torch.Tensor, table: list[int]):
        self.ids.extend(req.token_ids[first + 1 : end + 1])
        self.positions.extend(range(first, end))
        self.hidden.append(hidden)
        self.slots.append(slots)
        self.qlens.append(end - first)
        self.seq_lens.append(end)
        self.tables.append(table)
        if req.status == RequestStatus.RUNNING and end == req.num_tokens - 1:
            self.sel_rows.append(len(self.positions) - 1)
            self.sel_seqs.append(len(self.qlens) - 1)
            self.sel_reqs.append(req)


class _FillStep(torch.nn.Module):
    """The MTP's step 0 in the main model's call shape (input_ids, positions, kv_caches, meta, select,
    hidden), so that a CompiledExecutor compiles the fill like a decode step."""

    def __init__(self, mtp: torch.nn.Module):
        super().__init__()
        self.mtp = mtp

    def forward(self, input_ids, positions, kv_caches, meta, select=None, hidden=None):
        return self.mtp(input_ids, positions, hidden, kv_caches, meta, step=0, select=select)

    def graph_pools(self, kv_caches: list) -> list[torch.Tensor]:
        """The MTP module's step pools (qwen4_exp's indexer keys; ember.engine.executor.compiled.graph_pools)."""
        make = getattr(self.mtp, "graph_pools", None)
        return [] if make is None else make(kv_caches)
