"""Lossless rejection sampling of draft tokens (Leviathan et al.; vLLM v1's rules).

A request with d drafts x_1..x_d has 1 + d logit rows: row j scores the token after
x_1..x_j (row 0: after its last accepted token). The target p_j of a row is exactly what the
plain sampler would draw from there: penalties and min_tokens bans over the row's own
history (which includes the drafts before it), then temperature, min_p, top_k, top_p
(ember.layers.sampler does all of it; nothing is re-implemented here).

- greedy rows: accept x_j while it equals argmax p_j; the first mismatch emits the argmax,
  and if all match the bonus is argmax p_{d+1}. Output is identical to no speculation.
- random rows: accept x_j with probability min(1, p_j(x_j) / q_j(x_j)) (q one-hot for
  deterministic drafts, i.e. with probability p_j(x_j)); a zero draft probability rejects.
  At the first rejection emit a token from norm(max(0, p_j - q_j)) (p_j with x_j removed for
  deterministic drafts); if all are accepted, a bonus token from p_{d+1}. The emitted
  tokens are distributed exactly as sampling from p token by token.
- seeds: a seeded request draws d uniforms and then one V-vector of exponential noise from
  its own generator (the noise picks the one residual or bonus token that is emitted), so
  its stream depends only on its own drafts, never on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.kernels import cpu_row_top
from ember.layers.sampler import (
    SampledToken,
    SamplingRow,
    exponential_noise,
    gather_logprobs,
    process_logits,
    target_probs,
)
from ember.request import Draft


@dataclass
class VerifyRequest:
    rows: list[SamplingRow]  # 1 + d rows; row j's output_token_ids end with draft.token_ids[:j]
    draft: Draft


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, reqs: list[VerifyRequest]) -> list[list[SampledToken]]:
        """logits: [sum(1 + d_i), V] raw rows, each request's rows consecutive. Returns, per request,
        the emitted tokens: its accepted drafts, then one recovered or bonus token."""
        rows = [r for v in reqs for r in v.rows]
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} verify rows")
        starts, s = [], 0
        for v in reqs:
            if len(v.rows) != len(v.draft) + 1:
                raise ValueError(f"{len(v.draft)} drafts need {len(v.draft) + 1} rows, not {len(v.rows)}")
            starts.append(s)
            s += len(v.rows)

        work = process_logits(logits, rows)
        emitted: list[list[int]] = [[] for _ in reqs]
        greedy = [i for i, v in enumerate(reqs) if v.rows[0].params.greedy]
        if greedy:
            target = cpu_row_top.argmax(work).tolist()
            for i in greedy:
                x, t = reqs[i].draft.token_ids, target[starts[i] : starts[i] + len(reqs[i].rows)]
                a = _num_accepted([xj == tj for xj, tj in zip(x, t)])
                emitted[i] = x[:a] + [t[a]]
        randoms = [i for i, v in enumerate(reqs) if not v.rows[0].params.greedy]
        if randoms:
            for i, toks in zip(randoms, _verify_random(work, reqs, randoms, starts)):
                emitted[i] = toks

        # Logprobs of each emitted token, from the raw logits of the row that emitted it.
        want = [
            starts[i] + j
            for i, v in enumerate(reqs)
            if v.rows[0].params.logprobs is not None
            for j in range(len(emitted[i]))
        ]
        lps = {}
        if want:
            by_row = [0] * len(rows)
            for i in range(len(reqs)):
                by_row[starts[i] : starts[i] + len(emitted[i])] = emitted[i]
            lps = gather_logprobs(logits, rows, want, by_row)
        return [[SampledToken(t, lps.get(starts[i] + j)) for j, t in enumerate(emitted[i])] for i in range(len(reqs))]


def _num_accepted(accepts: list[bool]) -> int:
    for j, ok in enumerate(accepts):
        if not ok:
            return j
    return len(accepts)


def _verify_random(work: torch.Tensor, reqs: list[VerifyRequest], idx: list[int], starts: list[int]) -> list[list[int]]:
    dev = work.device
    # This subset's rows, renumbered from 0.
    sub_rows = [starts[i] + j for i in idx for j in range(len(reqs[i].rows))]
    params = [reqs[i].rows[0].params for i in idx for _ in reqs[i].rows]
    probs = target_probs(work[torch.tensor(sub_rows, device=dev)], params)  # [R, V]
    local, s = [], 0
    for i in idx:
        local.append(s)
        s += len(reqs[i].rows)

    # p_j(x_j) for every draft in one gather; q_j(x_j) = 1 for deterministic drafts.
    d_rows = [local[n] + j for n, i in enumerate(idx) for j in range(len(reqs[i].draft))]
    d_toks = [t for i in idx for t in reqs[i].draft.token_ids]
    p_x = probs[torch.tensor(d_rows, device=dev), torch.tensor(d_toks, device=dev)]
    q_x = torch.cat([_draft_q(reqs[i].draft, dev) for i in idx])

    # Uniforms: a seeded request's own generator (only here, where it has drafts); others share one draw.
    u = torch.empty(len(d_toks), device=dev)
    unseeded, at = [], 0
    for i in idx:
        d, gen = len(reqs[i].draft), reqs[i].rows[0].generator
        if gen is None:
            unseeded.extend(range(at, at + d))
        else:
            u[at : at + d] = torch.rand(d, generator=gen, device=gen.device).to(dev)
        at += d
    if unseeded:
        u[torch.tensor(unseeded, device=dev)] = torch.rand(len(unseeded), device=dev)
    accept = ((q_x > 0) & (u * q_x < p_x)).tolist()

    # The row that emits the last token of each request: the first rejected one, or the bonus row.
    accepted, final_rows, at = [], [], 0
    for n, i in enumerate(idx):
        d = len(reqs[i].draft)
        a = _num_accepted(accept[at : at + d])
        accepted.append(a)
        final_rows.append(local[n] + a)
        at += d
    dist = probs[torch.tensor(final_rows, device=dev)]  # a copy: safe to edit
    for n, i in enumerate(idx):
        draft, a = reqs[i].draft, accepted[n]
        if a == len(draft):
            continue  # bonus: p_{d+1} as is
        if draft.probs is None:
            dist[n, draft.token_ids[a]] = 0.0
        else:
            dist[n] = (dist[n] - draft.probs[a].to(dev, torch.float32)).clamp_min_(0.0)
        if not bool(dist[n].sum() > 0):  # p == q up to rounding: the residual is empty, p is exact enough
            dist[n] = probs[final_rows[n]]
    # Exponential race (unnormalised is fine: argmax of dist / E is a sample of dist / sum).
    gen_rows = [reqs[i].rows[0] for i in idx]
    tokens = cpu_row_top.argmax(dist / exponential_noise(dist, gen_rows)).tolist()
    return [reqs[i].draft.token_ids[: accepted[n]] + [tokens[n]] for n, i in enumerate(idx)]


def _draft_q(draft: Draft, dev: torch.device) -> torch.Tensor:
    if draft.probs is None:
        return torch.ones(len(draft), device=dev)
    x = torch.tensor(draft.token_ids, device=draft.probs.device)
    return draft.probs[torch.arange(len(draft), device=draft.probs.device), x].to(dev, torch.float32)
