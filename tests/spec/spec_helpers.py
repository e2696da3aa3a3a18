"""Engines on tiny models for the speculative decoding tests."""

from __future__ import annotations

from ember import LLM, SamplingParams
from ember.config.model_config import ModelConfig
from tests.models.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def ngram(k: int, **kw) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **kw}


def kv_gib(path: str, blocks: int, block_size: int = 4) -> float:
    return blocks * block_size * ModelConfig.from_folder(path).kv_bytes_per_token_per_dtype_byte * 4 / 2**30


def make_llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("num_threads", 1)
    kw.setdefault("kv_cache_memory", kv_gib(path, 512))
    return LLM(path, **kw)


def run(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# Repetition, so prompt lookup finds something to propose.
REPEATED = [random_prompt(n, s) * 3 for s, n in enumerate([4, 7, 2, 10, 5, 3])]


def drafts_after_prefill(llm, prompt):
    """Step until the request holds its first draft; (draft ids, the drafter's cache rows of the prompt
    stacked over its layers [L, 2, P, Hkv, D], steps taken). The request is aborted after."""
    import torch

    eng = llm.engine
    eng.add_request("x", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    req = eng.parents["x"].children[0]
    steps = 0
    while req.draft is None:
        eng.step()
        steps += 1
    bs = eng.config.block_size
    slots = torch.tensor([req.block_ids[p // bs] * bs + p % bs for p in range(len(prompt))])
    kv = torch.stack([c.flatten(1, 2)[:, slots] for c in eng.parts.spec.proposer.caches])
    draft = list(req.draft.token_ids)
    eng.abort_request("x")
    return draft, kv, steps


def run_with_aborts(llm, params_for, prompts) -> None:
    """Requests for every prompt (params_for(i) each), an abort every third step for 40 steps, then
    run the rest to the end: the churn the no-leak tests put a drafter through."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, params_for(i))
    for step in range(40):
        eng.step()
        if step % 3 == 1:
            live = list(eng.parents)
            if live:
                eng.abort_request(live[step % len(live)])
    while eng.has_unfinished_requests():
        eng.step()
