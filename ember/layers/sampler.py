"""The batched sampler: one call per forward turns [B, V] logits into one token per row.

Order (vLLM's): logprobs from the raw logits; penalties; logit_bias; min_tokens bans; greedy rows take
the argmax; the others are divided by temperature, then min_p, top_k, top_p, then sampled
with an exponential race (argmax of probs / q, q ~ Exp(1)), which equals sampling from probs
and lets each seeded row draw only from its own generator.
Every stage runs only for the rows that need it, vectorised over those rows, and is skipped
entirely when no row does: this runs every decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.kernels import cpu_row_top
from ember.outputs import Logprob, PositionLogprobs
from ember.sampling import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One row of the logits batch and what the sampler needs to know about its request."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (before this step)
    generator: torch.Generator | None = None  # the request's own, when params.seed is set
    # The model's eos ids. Masked, with params.stop_token_ids, while the row has produced
    # fewer than params.min_tokens tokens; the engine leaves eos out when ignore_eos is set.
    banned_token_ids: list[int] | None = None


@dataclass
class SampledToken:
    token_id: int
    logprobs: PositionLogprobs | None = None  # None unless params.logprobs is not None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator; keep it for the request's life so steps continue it."""
    g = torch.Generator(device=device)
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # any Python int maps into torch's seed range
    return g


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")

        penalised, banned, randoms, want_lp = _plan(rows)
        if not (penalised or banned or randoms or want_lp):  # the common all-greedy decode
            return [SampledToken(t) for t in cpu_row_top.argmax(logits).tolist()]

        work = _process(logits, rows, penalised, banned)
        tokens = self._choose(work, rows, randoms)
        lps = gather_logprobs(logits, rows, want_lp, tokens) if want_lp else {}
        return [SampledToken(t, lps.get(i)) for i, t in enumerate(tokens)]

    @staticmethod
    def _choose(work: torch.Tensor, rows: list[SamplingRow], randoms: list[int]) -> list[int]:
        B = work.shape[0]
        if not randoms:
            return cpu_row_top.argmax(work).tolist()
        if len(randoms) == B:
            return _sample(work, [rows[i] for i in randoms]).tolist()
        tokens = cpu_row_top.argmax(work)  # greedy rows; random rows are overwritten below
        idx = torch.tensor(randoms, device=work.device)
        tokens[idx] = _sample(work[idx], [rows[i] for i in randoms])
        return tokens.tolist()


def _plan(rows: list[SamplingRow]) -> tuple[list[int], list[int], list[int], list[int]]:
    """One pass of Python over the rows decides which stages have work to do (a biased row counts as
    penalised: both edit its logits before anything picks)."""
    penalised, banned, randoms, want_lp = [], [], [], []
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.logit_bias:
            penalised.append(i)
        if p.min_tokens and len(row.output_token_ids) < p.min_tokens and (row.banned_token_ids or p.stop_token_ids):
            banned.append(i)
        if not p.greedy:
            randoms.append(i)
        if p.logprobs is not None:
            want_lp.append(i)
    return penalised, banned, randoms, want_lp


def _process(logits: torch.Tensor, rows: list[SamplingRow], penalised: list[int], banned: list[int]) -> torch.Tensor:
    # Work in float32 on a private copy only when some stage writes in place.
    work = logits.to(torch.float32, copy=bool(penalised or banned))
    if penalised:
        _apply_penalties(work, rows, penalised)
        _apply_logit_bias(work, rows, penalised)
    if banned:
        _ban_tokens(work, rows, banned)
    return work


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalties and min_tokens bans (each row's history is its own), in float32: what greedy
    rows take the argmax of and what temperature and the filters start from. Leaves logits alone."""
    penalised, banned, _, _ = _plan(rows)
    return _process(logits, rows, penalised, banned)


def target_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a random row samples from: softmax of the tempered, filtered logits."""
    return torch.softmax(apply_filters(x, params), dim=-1)


def _row_tensor(values: list, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)


def _counts(id_lists: list[list[int]], V: int, device: torch.device) -> torch.Tensor:
    """[R, V] occurrence counts; one bincount over ids shifted by row * V.

    Ids must be < V (the engine rejects out-of-vocabulary prompt ids), or they would count
    for the next row."""
    flat: list[int] = []
    for r, ids in enumerate(id_lists):
        off = r * V
        flat.extend(t + off for t in ids)
    flat_t = torch.tensor(flat, dtype=torch.long, device=device)
    return torch.bincount(flat_t, minlength=len(id_lists) * V).view(len(id_lists), V)


def _apply_penalties(work: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """Repetition over prompt+output; frequency and presence over output only (vLLM)."""
    idx = [
        i
        for i in idx
        if (
            rows[i].params.repetition_penalty != 1.0
            or rows[i].params.presence_penalty != 0.0
            or rows[i].params.frequency_penalty != 0.0
        )
    ]
    if not idx:
        return
    V = work.shape[1]
    sel = [rows[i] for i in idx]
    whole = len(idx) == work.shape[0]
    idx_t = None if whole else torch.tensor(idx, device=work.device)
    x = work if whole else work[idx_t]

    out_counts = _counts([r.output_token_ids for r in sel], V, work.device)
    if any(r.params.repetition_penalty != 1.0 for r in sel):
        rep = _row_tensor([r.params.repetition_penalty for r in sel], work)
        seen = out_counts > 0
        seen |= _counts([r.prompt_token_ids for r in sel], V, work.device) > 0
        # Dividing a positive logit and multiplying a negative one both lower it (rep > 1).
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if any(r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in sel):
        freq = _row_tensor([r.params.frequency_penalty for r in sel], work)
        pres = _row_tensor([r.params.presence_penalty for r in sel], work)
        x = x - freq * out_counts - pres * (out_counts > 0)

    if whole:
        work.copy_(x)
    else:
        work[idx_t] = x


def _apply_logit_bias(work: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    V = work.shape[1]
    r_ids, t_ids, vals = [], [], []
    for i in idx:
        for t, b in (rows[i].params.logit_bias or {}).items():
            if 0 <= t < V:  # the engine refuses ids outside the vocabulary
                r_ids.append(i)
                t_ids.append(t)
                vals.append(b)
    if r_ids:
        dev = work.device
        work.index_put_(
            (torch.tensor(r_ids, device=dev), torch.tensor(t_ids, device=dev)),
            torch.tensor(vals, dtype=work.dtype, device=dev),
            accumulate=True,
        )


def _ban_tokens(work: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    V = work.shape[1]
    r_ids, t_ids = [], []
    for i in idx:
        row = rows[i]
        for t in set(row.params.stop_token_ids).union(row.banned_token_ids or ()):
            if 0 <= t < V:  # ids past a (padded) vocab cannot be sampled anyway
                r_ids.append(i)
                t_ids.append(t)
    if r_ids:
        work[torch.tensor(r_ids, device=work.device), torch.tensor(t_ids, device=work.device)] = _NEG_INF


def _sample(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature and filters, then an exponential race. x is not modified."""
    probs = target_probs(x, [r.params for r in rows])
    q = exponential_noise(probs, rows)
    return cpu_row_top.argmax(probs / q)


def apply_filters(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p on [R, V] logits; dropped tokens become -inf.

    Returns a new tensor (x is left alone)."""
    V = x.shape[1]
    x = x / _row_tensor([p.temperature for p in params], x)  # a new tensor: in place from here

    if any(p.min_p > 0.0 for p in params):
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); no softmax needed.
        min_p = _row_tensor([p.min_p for p in params], x)
        x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + min_p.log(), _NEG_INF)

    ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    top_ps = [p.top_p for p in params]
    if any(tp < 1.0 for tp in top_ps):
        return _top_k_top_p(x, ks, top_ps)
    if any(ks):
        _top_k_only(x, ks)
    return x


# top_p rows without top_k look for their nucleus among this many top logits first; a full
# sort of the vocabulary (tens of ms on CPU for a batch) runs only if they hold too little mass.
TOP_P_CANDIDATES = 1024


def _top_k_top_p(x: torch.Tensor, ks: list[int], top_ps: list[float]) -> torch.Tensor:
    V = x.shape[1]
    dev = x.device
    p_on = [tp < 1.0 for tp in top_ps]
    needs_tail = any(p and not k for p, k in zip(p_on, ks))  # nucleus may reach past top-k
    m = min(V, max(max(ks), TOP_P_CANDIDATES if needs_tail else 1))
    if m == V:
        return _top_k_top_p_sorted(x, ks, top_ps)
    vals, ids = x.topk(m, dim=-1)

    k_on = torch.tensor([k > 0 for k in ks], device=dev).unsqueeze(1)
    if any(ks):
        k_t = torch.tensor([k or m for k in ks], device=dev).unsqueeze(1)
        vals.masked_fill_(torch.arange(m, device=dev) >= k_t, _NEG_INF)
    # top_p mass is measured over what top_k kept, or over the whole row when top_k is off.
    lse = vals.logsumexp(dim=-1, keepdim=True)
    if needs_tail:
        lse = torch.where(k_on, lse, x.logsumexp(dim=-1, keepdim=True))
    probs = (vals - lse).exp()
    cum = probs.cumsum(dim=-1)
    p_t = _row_tensor([tp if tp < 1.0 else 2.0 for tp in top_ps], x)
    if needs_tail:
        p_rows = torch.tensor(p_on, device=dev).unsqueeze(1)
        short = p_rows & ~k_on & (cum[:, -1:] < p_t)
        if bool(short.any()):
            return _top_k_top_p_sorted(x, ks, top_ps)
    vals.masked_fill_(cum - probs >= p_t, _NEG_INF)  # see _top_k_top_p_sorted for the rule

    filtered = torch.full_like(x, _NEG_INF).scatter_(-1, ids, vals)
    untouched = [not p and not k for p, k in zip(p_on, ks)]
    if any(untouched):
        keep = torch.tensor(untouched, device=dev).unsqueeze(1)
        filtered = torch.where(keep, x, filtered)
    return filtered


def _top_k_top_p_sorted(x: torch.Tensor, ks: list[int], top_ps: list[float]) -> torch.Tensor:
    V = x.shape[1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    if any(ks):
        k = torch.tensor([k or V for k in ks], device=x.device).unsqueeze(1)
        sorted_x.masked_fill_(torch.arange(V, device=x.device) >= k, _NEG_INF)
    # Keep a token while the mass strictly before it is < top_p: the smallest set reaching
    # top_p, and always the top token. top_p == 1 rows get an unreachable bar so float
    # rounding in the cumsum cannot drop their tail.
    p = _row_tensor([tp if tp < 1.0 else 2.0 for tp in top_ps], x)
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_x.masked_fill_(mass_before >= p, _NEG_INF)
    return x.scatter_(-1, order, sorted_x)


def _top_k_only(x: torch.Tensor, ks: list[int]) -> None:
    """Top-k without a full sort: mask below each row's k-th largest value (ties all kept)."""
    kmax = max(ks)
    top = x.topk(kmax, dim=-1).values
    kth_pos = torch.tensor([max(k, 1) - 1 for k in ks], device=x.device).unsqueeze(1)
    kth = top.gather(1, kth_pos)
    off = torch.tensor([k == 0 for k in ks], device=x.device).unsqueeze(1)
    kth.masked_fill_(off, _NEG_INF)
    x.masked_fill_(x < kth, _NEG_INF)


def exponential_noise(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Exp(1) noise, as -log(U): on CPU torch's exponential_ is ~6x slower than uniform_.

    A seeded row draws its V values from its own generator only, so its tokens do not
    depend on the rest of the batch."""
    u = torch.empty_like(probs)
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if not seeded:
        u.uniform_()
    else:
        V = probs.shape[1]
        for i in seeded:
            u[i] = torch.empty(V, device=probs.device).uniform_(generator=rows[i].generator)
        others = [i for i, r in enumerate(rows) if r.generator is None]
        if others:
            u[torch.tensor(others, device=probs.device)] = torch.empty(len(others), V, device=probs.device).uniform_()
    q = u.log_().neg_()
    # A zero draw would turn prob 0 into 0/0 = nan, which argmax prefers; keep it positive.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def gather_logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], idx: list[int], tokens: list[int]
) -> dict[int, PositionLogprobs]:
    """Sampled token plus top-N from log_softmax of the raw logits; rank = 1 + #strictly greater."""
    idx_t = torch.tensor(idx, device=logits.device)
    found = token_logprobs(logits[idx_t], [tokens[i] for i in idx], [rows[i].params.logprobs for i in idx])
    return dict(zip(idx, found))


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[PositionLogprobs]:
    """Per row of [R, V] logits: the given token's logprob and rank, plus the row's top tops[r], from
    log_softmax of the raw logits (also the prompt logprobs: row p scores prompt token p + 1)."""
    device = logits.device
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(tokens, device=device).unsqueeze(1)
    chosen_lp = lp.gather(1, chosen)
    chosen_rank = (lp > chosen_lp).sum(dim=-1) + 1

    n_max = max(tops)
    top_lp = top_id = top_rank = None
    if n_max > 0:
        top_v, top_i = lp.topk(n_max, dim=-1)
        # Anything strictly greater than a top-N value is itself in the top-N: in the descending list, a
        # value's rank is 1 + the index of its first equal (searchsorted on the ascending negation).
        neg = (-top_v).contiguous()
        top_rank = torch.searchsorted(neg, neg, right=False) + 1
        top_lp, top_id, top_rank = top_v.tolist(), top_i.tolist(), top_rank.tolist()

    chosen_lp, chosen_rank = chosen_lp.squeeze(1).tolist(), chosen_rank.tolist()
    out: list[PositionLogprobs] = []
    for j, (token, n) in enumerate(zip(tokens, tops)):
        d: PositionLogprobs = {token: Logprob(chosen_lp[j], chosen_rank[j])}
        for k in range(n):
            d.setdefault(top_id[j][k], Logprob(top_lp[j][k], top_rank[j][k]))
        out.append(d)
    return out
