"""Draft-model proposer: a small model with the target's tokenizer drafts k tokens; the target verifies.

Flags, as vLLM's: --speculative-model DIR --num-speculative-tokens k (a folder that is not MTP
weights), or --speculative-config '{"method": "draft", "model": DIR, "num_speculative_tokens": k}'.
The draft is loaded by ember's own loader (any supported architecture, HF folder or GGUF, the
target's dtype and device) and runs ember's own model code. Refused with a ConfigError: a draft
whose vocab_size or tokenizer (token -> id map, special tokens) differs from the target's, a
folder of MTP weights given as method "draft", a context shorter than max_model_len (a missing
folder is refused in ember.config.speculative).

KV. One cache per draft layer in the runner's pool (ModelRunner.allocate_kv with the draft's kv
heads and head_dim): the same block ids and tables as the target, so a request's blocks hold both
models' K/V and freeing, preemption and aborts need nothing of their own. The engine sizes the pool
with kv_bytes_per_token (the draft's layers on top of the target's, per token).

What the request's own blocks hold: only the draft's K/V of final tokens.
- The fill (after_step): for every request of the step (finished ones too: their blocks are not
  reused before the next schedule, and the prefix cache may name them), the draft runs the
  positions from the step's first one up to the target's verified count (a prefill chunk; the
  token before the drafts, the accepted drafts), writing the slots the target wrote. For a request
  that decodes next it also runs the last token (position N - 1: sampled, hence final, not yet
  computed by the target); that row's logits give draft 1. Its slot is in the request's own block
  (a block holding a position >= num_computed_tokens is never shared: the prefix cache names only
  computed blocks), or in a scratch block while the scheduler has not allocated that block yet;
  the next fill rewrites it in the real block. Starting every fill at the step's first position,
  not at a count of the draft's own, repeats one row per verify and keeps no per-request state:
  after a preemption, a prefix-cache hit or a scratch-written last token the draft just follows
  the target.
- The chain (propose): draft j (1 .. k-1) runs at position N - 1 + j to give draft j + 1. These
  tokens are unverified, so their K/V goes to scratch blocks past the pool (never handed out by the
  block manager), as mtp_proposer's chain: the chain's table is the request's blocks before the
  block of position N, then its scratch blocks, the first a copy of that block when it also holds
  earlier positions. Nothing the target or a later fill reads is touched; nothing is allocated.

Sampling. Greedy requests draft the argmax (q one-hot: output identical to no speculation).
Sampled requests draw each draft from q = the request's temperature / min_p / top_k / top_p applied
to the draft's logits (ember.layers.sampler.target_probs; penalties are left out: any q is exact),
with the request's own seeded generator when it has one (the runner's, which its verify continues:
a seeded stream depends on the request alone), and pass Draft(ids, probs=q): the rejection sampler
accepts with min(1, p/q), so emitted tokens follow the target's distribution exactly.

Prefix caching is exact: the draft's K/V at position i depends on tokens 0..i only, and every
position of a named block was filled in the step that computed it.
Cost: k draft forwards per step (the fill, then k - 1 chain steps), eager, batched over requests.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Sequence

import torch

from ember.errors import ConfigError
from ember.kernels import cpu_row_top
from ember.kernels.metadata import AttentionMetadata, select_rows
from ember.layers.attention import is_fp8
from ember.layers.sampler import make_generator, target_probs
from ember.request import Draft, Request, RequestStatus
from ember.spec.proposer import KVSlots, Proposer, ProposerContext, StepRows

if TYPE_CHECKING:
    from ember.config.speculative import SpeculativeConfig
    from ember.loader.tokenizer import Tokenizer

logger = logging.getLogger("ember")


def tokenizer_difference(target: Tokenizer, draft: Tokenizer) -> str | None:
    """How the draft's tokenizer differs from the target's (None: the same ids for the same text).
    Only the token -> id map and the special tokens count: the engine tokenizes with the target's
    tokenizer, so the draft's BOS/EOS settings (config.json fallbacks) never reach it."""
    tv = target.hf_tokenizer.get_vocab(with_added_tokens=True)
    dv = draft.hf_tokenizer.get_vocab(with_added_tokens=True)
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])[:3]
        return f"the vocabularies differ ({len(tv)} vs {len(dv)} tokens; e.g. {diff})"

    def specials(tok: Tokenizer) -> dict[int, str]:
        return {i: t.content for i, t in tok.hf_tokenizer.get_added_tokens_decoder().items() if t.special}

    if specials(target) != specials(draft):
        return f"the special tokens differ ({specials(target)} vs {specials(draft)})"
    return None


class DraftModelProposer(Proposer):
    reads_step = "rows"  # the fill reruns the rows the target computed, from their tokens

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext):
        from ember.config.speculative import is_mtp_folder
        from ember.loader.model_loader import load_model

        if is_mtp_folder(spec.model):
            raise ConfigError(
                f"{spec.model!r} holds MTP weights, not a draft model; use method 'mtp' "
                "(or give --speculative-model without a method)"
            )
        target = ctx.target
        path = os.path.expanduser(spec.model)
        # A folder without tokenizer files borrows the target's (only vocab_size can be checked then).
        own_tok = os.path.isfile(path) or os.path.isfile(os.path.join(path, "tokenizer.json"))
        borrowed = None if own_tok else ctx.tokenizer or (target.path if os.path.isdir(target.path) else None)
        if not own_tok and borrowed is None:
            raise ConfigError(
                f"the draft model folder {spec.model!r} has no tokenizer.json and the target is a GGUF "
                "file; copy the target's tokenizer files into the draft folder, or pass --tokenizer DIR"
            )
        tmc = target.model_config
        if os.path.isdir(path):  # refuse a vocabulary mismatch before loading any weights
            from ember.config.model_config import ModelConfig

            self._check_vocab(spec.model, ModelConfig.from_folder(path).vocab_size, tmc.vocab_size)
        t0 = time.perf_counter()
        from ember.distributed.parallel_state import sharding

        # Under tensor parallelism the draft runs whole on rank 0 (draft tensor-parallel size 1, as
        # vLLM's default): built outside the engine's sharding, its layers never call a collective.
        with sharding(0, 1):
            self.loaded = loaded = load_model(
                spec.model, borrowed, ctx.dtype, ctx.device, ctx.attention_backend, "auto", ctx.kernels
            )
        mc = loaded.model_config
        self._check_vocab(spec.model, mc.vocab_size, tmc.vocab_size)
        if own_tok:
            diff = tokenizer_difference(target.tokenizer, loaded.tokenizer)
            if diff is not None:
                raise ConfigError(
                    f"the draft model {spec.model!r} has another tokenizer than the target: {diff}; "
                    "give a draft model that uses the target's tokenizer"
                )
        else:
            logger.warning("draft model %s has no tokenizer.json: only its vocab_size was checked", spec.model)
        if mc.is_hybrid:
            raise ConfigError(
                f"the draft model {spec.model!r} is a hybrid ({mc.architecture}): a draft keeps paged KV "
                "only, not recurrent state; use a dense draft of the same vocabulary (e.g. a small "
                'Qwen3), or --speculative-config \'{"method": "mtp"}\' for the model\'s own MTP layer'
            )
        if mc.max_position_embeddings < ctx.max_model_len:
            raise ConfigError(
                f"the draft model {spec.model!r} has a context of {mc.max_position_embeddings} tokens, "
                f"less than max_model_len {ctx.max_model_len}; pass --max-model-len "
                f"{mc.max_position_embeddings} or a draft with a longer context"
            )
        self.model = loaded.model
        self.model_config = mc
        self.device = ctx.device
        self.num_speculative_tokens = spec.num_speculative_tokens or 1
        self.k_max = self.num_speculative_tokens
        self.max_num_seqs = ctx.max_num_seqs
        self.block_size = ctx.block_size
        self.generators = ctx.generators  # the sampler's per-request seeded generators
        # CPU decode is bandwidth bound: a draft token costs its weight bytes over the target's.
        self.draft_token_cost = float(min(1.0, max(0.01, loaded.weight_bytes / max(1, target.weight_bytes))))
        self.caches: list[torch.Tensor] = []
        # request id -> (N = num_tokens at the fill, scratch slot, scratch holds position N - 1, logits [1, V])
        self.starts: dict[str, tuple[int, int, bool, torch.Tensor]] = {}
        logger.info(
            "draft model: %s, %d layers, %.1f MB, loaded from %s in %.1fs, draft cost %.2f of a decode step",
            mc.architecture,
            mc.num_layers,
            loaded.weight_bytes / 1e6,
            loaded.path,
            time.perf_counter() - t0,
            self.draft_token_cost,
        )

    @staticmethod
    def _check_vocab(name: str, draft: int, target: int) -> None:
        if draft != target:
            raise ConfigError(
                f"the draft model {name!r} has vocab_size {draft} but the target has {target}; "
                "give a draft model trained with the target's tokenizer (same vocabulary)"
            )

    # -- sizing and setup ---------------------------------------------------------------------
    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """The draft layers' KV bytes per token: 2 x L x Hkv x D x elem (ember.engine.planner's formula)."""
        mc = self.model_config
        return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem_bytes

    def scratch_blocks_per_request(self) -> int:
        """Position N - 1 (one block) and the chain's N .. N + k - 2 from any offset in a block."""
        return 2 + (self.block_size - 1 + self.k_max) // self.block_size

    def attach(self, slots: KVSlots) -> None:
        """The draft layers' caches in the pool (+ scratch blocks for position N - 1 and the chains)."""
        self.scratch_base = slots.num_blocks
        self.scratch_per_req = self.scratch_blocks_per_request()
        mc = self.model_config
        extra = self.max_num_seqs * self.scratch_per_req
        self.caches = [slots.allocate(mc.num_kv_heads, mc.head_dim, extra) for _ in range(mc.num_layers)]

    def _scratch(self, slot: int) -> list[int]:
        first = self.scratch_base + slot * self.scratch_per_req
        return list(range(first, first + self.scratch_per_req))

    def _meta(
        self, slots: list[int], qlens: list[int], seq_lens: list[int], tables: list[list[int]]
    ) -> AttentionMetadata:
        dev = self.device
        width = max(len(t) for t in tables)
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            block_size=self.block_size,
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            all_slots_valid=True,
        )

    # -- the fill -----------------------------------------------------------------------------
    @torch.inference_mode()
    def after_step(self, step: StepRows | None, drafting: set[str] | None = None) -> None:
        """Run the draft over the step's verified rows (+ the last token of requests that decode
        next: their draft-1 logits); see the module docstring."""
        self.starts.clear()
        if step is None:
            return
        bs = self.block_size
        ids, positions, slots, qlens, seq_lens, tables = [], [], [], [], [], []
        sel_rows, sel_seqs, sel = [], [], []  # logit rows; (request, slot, scratch used) per logit row
        for b, (req, _, start, n) in enumerate(step.entries):
            verified = min(req.num_computed_tokens, req.num_tokens)  # rejected drafts sit past it
            decodes = req.status == RequestStatus.RUNNING and verified == req.num_tokens - 1
            table = list(req.block_ids) if decodes else step.tables[b]
            end = verified + 1 if decodes else verified
            if end <= start:
                continue
            r0 = len(ids)
            ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, verified))
            used = False
            if decodes:
                p = end - 1
                if p // bs >= len(table):  # its block is not allocated yet: scratch stands in for it
                    table = table + [self._scratch(b)[0]]
                    used = True
                slots.append(table[p // bs] * bs + p % bs)
                sel_rows.append(r0 + end - start - 1)
                sel_seqs.append(len(qlens))
                sel.append((req, b, used))
            qlens.append(end - start)
            seq_lens.append(end)
            tables.append(table)
        if not ids:
            return
        dev = self.device
        meta = self._meta(slots, qlens, seq_lens, tables)
        width = meta.block_tables.shape[1]
        select = select_rows(meta, [t + [0] * (width - len(t)) for t in tables], positions, sel_rows, sel_seqs, dev)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.caches,
            meta,
            select,
        )
        if not sel:
            return
        logits = self.model.compute_logits(hidden)
        for i, (req, slot, used) in enumerate(sel):
            self.starts[req.request_id] = (req.num_tokens, slot, used, logits[i : i + 1])

    # -- drafting -----------------------------------------------------------------------------
    def _generator(self, req: Request) -> torch.Generator | None:
        """The request's own generator when it is seeded: the runner's, which its verify continues."""
        params = req.sampling_params
        if params.seed is None:
            return None
        gens = self.generators
        if req.request_id not in gens:
            gens[req.request_id] = make_generator(params.seed)
        return gens[req.request_id]

    def _pick(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per row: the argmax for a greedy request, else a draw from q (returned)."""
        toks = cpu_row_top.argmax(logits).tolist()
        probs: list[torch.Tensor | None] = [None] * len(reqs)
        rnd = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        if not rnd:
            return toks, probs
        q = target_probs(
            logits[torch.tensor(rnd, device=logits.device)].float(), [reqs[i].sampling_params for i in rnd]
        )
        shared = []
        for j, i in enumerate(rnd):
            probs[i] = q[j]
            gen = self._generator(reqs[i])
            if gen is None:
                shared.append(j)
            else:
                toks[i] = int(torch.multinomial(q[j].to(gen.device), 1, generator=gen))
        if shared:
            drawn = torch.multinomial(q[torch.tensor(shared, device=q.device)], 1).view(-1).tolist()
            for j, t in zip(shared, drawn):
                toks[rnd[j]] = t
        return toks, probs

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[Draft | None]:
        out: list[Draft | None] = [None] * len(requests)
        live = []  # (index into requests, request, k, N, scratch slot, scratch holds N - 1)
        logits = []
        for i, (req, k) in enumerate(zip(requests, max_tokens)):
            start = self.starts.get(req.request_id)
            if start is None or start[0] != req.num_tokens:
                continue  # not in the last step's fill (e.g. left out by the budget): no guess
            live.append((i, req, min(k, self.k_max), start[0], start[1], start[2]))
            logits.append(start[3])
        self.starts.clear()  # single use: the next fill brings new ones
        if not live:
            return out
        toks, probs = self._pick(torch.cat(logits), [req for _, req, *_ in live])
        drafts = [[t] for t in toks]
        qs = [[p] for p in probs]
        if max(k for _, _, k, *_ in live) > 1:
            self._chain(live, toks, drafts, qs)
        for (i, _, k, *_), d, q in zip(live, drafts, qs):
            out[i] = Draft(d[:k], None if q[0] is None else torch.stack(q[:k]))
        return out

    def _chain_table(self, req: Request, N: int, slot: int, used: bool, copies: list[tuple[int, int]]) -> list[int]:
        """The chain's block table: the request's blocks before position N's, then scratch."""
        bs = self.block_size
        scratch = self._scratch(slot)
        ext = list(req.block_ids) + ([scratch[0]] if used else [])  # as the fill saw it
        taken = 1 if used else 0
        b1 = N // bs
        table = ext[:b1]
        if b1 < len(ext) and N % bs:  # that block also holds positions < N
            if used and b1 == len(ext) - 1:
                table.append(ext[b1])  # already scratch
            else:
                copies.append((ext[b1], scratch[taken]))
                table.append(scratch[taken])
                taken += 1
        return table + scratch[taken:]

    def _chain(self, live, toks: list[int], drafts: list[list[int]], qs: list[list]) -> None:
        """Drafts 2 .. k: one row per request at positions N, N + 1, ... in scratch blocks."""
        bs, dev = self.block_size, self.device
        copies: list[tuple[int, int]] = []
        tables = [self._chain_table(req, N, slot, used, copies) for _, req, _, N, slot, used in live]
        if copies:
            src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=dev)
            dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=dev)
            for cache in self.caches:
                c = cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
                c.index_copy_(1, dst, c.index_select(1, src))
        idx = list(range(len(live)))
        cur = list(toks)
        for j in range(1, max(k for _, _, k, *_ in live)):
            idx = [i for i in idx if live[i][2] > j]
            pos = [live[i][3] - 1 + j for i in idx]
            tabs = [tables[i] for i in idx]
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tabs, pos)]
            meta = self._meta(slots, [1] * len(idx), [p + 1 for p in pos], tabs)
            hidden = self.model(
                torch.tensor([cur[i] for i in idx], dtype=torch.int64, device=dev),
                torch.tensor(pos, dtype=torch.int64, device=dev),
                self.caches,
                meta,
            )
            new, probs = self._pick(self.model.compute_logits(hidden), [live[i][1] for i in idx])
            for i, t, p in zip(idx, new, probs):
                cur[i] = t
                drafts[i].append(t)
                qs[i].append(p)
