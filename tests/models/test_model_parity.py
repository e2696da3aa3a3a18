"""ember models vs Hugging Face transformers on tiny random models, fp32, paged KV cache.

Logits must agree to 1e-4 of their scale; greedy tokens must be identical to HF generate
through every attention path (fresh prefill, chunk over cached prefix, batched decode, mixed
steps). Prompt seeds are chosen so HF's top-1/top-2 logit gap stays >= 3e-3 over each
32-token run (our fp32 error is ~1e-5), so a mismatch means a bug, not a near-tie.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny_models import (
    ARCHS,
    PagedDriver,
    Seq,
    build_hf_model,
    hf_greedy,
    load_ember_model,
    one_thread,
    random_prompt,
    save_hf_model,
)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

PROMPTS = {7: 701, 11: 1100, 5: 500, 9: 901, 14: 1400}  # length -> seed
NEW_TOKENS = 32


def prompt(length: int) -> list[int]:
    return random_prompt(length, PROMPTS.get(length, length))


class Pair:
    """One HF model, its saved folder, the ember model loaded from it, cached HF generations."""

    def __init__(self, arch: str, folder: str):
        self.arch, self.folder = arch, folder
        self.hf = build_hf_model(arch)
        save_hf_model(self.hf, folder)
        self.ember = load_ember_model(folder)
        self._greedy: dict[int, list[int]] = {}

    def hf_tokens(self, length: int) -> list[int]:
        if length not in self._greedy:
            self._greedy[length] = hf_greedy(self.hf, prompt(length), NEW_TOKENS)
        return self._greedy[length]

    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    return Pair(request.param, str(tmp_path_factory.mktemp(request.param)))


def assert_close(ours: torch.Tensor, ref: torch.Tensor):
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"max |dlogit| {err:.3g} vs max |logit| {ref.abs().max():.3g}"


@pytest.mark.parametrize("length", [1, 7, 33])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_logits_match_hf(pair, length, block_size):
    ids = random_prompt(length, 42 + length)
    ref = pair.hf_logits(ids)
    ours = PagedDriver(pair.ember, block_size=block_size).step([(Seq(ids, 0), length)])[0]
    assert_close(ours[-1], ref[-1])
    assert_close(ours, ref)


def test_greedy_matches_hf_generate(pair):
    s = Seq(prompt(7), NEW_TOKENS)
    PagedDriver(pair.ember).generate([s])
    assert s.generated == pair.hf_tokens(7)


def test_chunked_prefill_matches_hf(pair):
    """Prompt in chunks of 3 (q_len 3 over ctx_len > 0): logits of every chunk and the greedy tail."""
    ids = prompt(11)
    ref = pair.hf_logits(ids)
    drv = PagedDriver(pair.ember, block_size=4)
    s = Seq(ids, 0)
    chunks = []
    while s.num_computed < len(ids):
        chunks.append(drv.step([(s, min(3, len(ids) - s.num_computed))])[0])
    assert_close(torch.cat(chunks), ref)

    s = Seq(ids, NEW_TOKENS)
    PagedDriver(pair.ember, block_size=4).generate([s], chunk=3)
    assert s.generated == pair.hf_tokens(11)


def test_batched_prefill_and_decode_match_hf(pair):
    """Three prompts prefilled together in one varlen step, then all-decode steps of 3 sequences."""
    seqs = [Seq(prompt(n), NEW_TOKENS) for n in (5, 9, 14)]
    steps = PagedDriver(pair.ember, block_size=4).generate(seqs)
    assert steps == NEW_TOKENS  # one prefill step + 31 batched decode steps
    for s in seqs:
        assert s.generated == pair.hf_tokens(len(s.prompt)), f"prompt length {len(s.prompt)}"


def test_staggered_chunked_batch_matches_hf(pair):
    """Sequences arrive one step apart and prefill in chunks of 3 while others decode: steps mix
    decodes, chunks over cached prefixes and fresh prefills, like continuous batching."""
    seqs = [Seq(prompt(n), NEW_TOKENS, arrival=i) for i, n in enumerate((14, 5, 9))]
    PagedDriver(pair.ember, block_size=4, seed=1).generate(seqs, chunk=3)
    for s in seqs:
        assert s.generated == pair.hf_tokens(len(s.prompt)), f"prompt length {len(s.prompt)}"


def test_bf16_model_is_as_close_to_fp32_as_hf_bf16(pair):
    """bf16 weights and activations through prefill, a chunk and decodes: the error vs HF fp32 stays
    within HF's own bf16 error (plus slack), so no path silently loses precision."""
    ids = random_prompt(33, 5)
    ref = pair.hf_logits(ids)
    hf_bf16 = build_hf_model(pair.arch).to(torch.bfloat16)
    with torch.inference_mode():
        hf_err = (hf_bf16(torch.tensor([ids])).logits[0].float() - ref).abs().max().item()
    model = load_ember_model(pair.folder, dtype=torch.bfloat16)
    drv, s = PagedDriver(model, block_size=16), Seq(ids, 0)
    ours = torch.cat([drv.step([(s, n)])[0] for n in (20, 3) + (1,) * 10])
    err = (ours - ref).abs().max().item()
    assert err <= max(1.5 * hf_err, 0.02 * ref.abs().max().item()), f"ours {err:.3g} vs HF bf16 {hf_err:.3g}"
