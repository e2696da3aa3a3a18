"""QSA's selection in index form (QSAIndexer.select_blocks, BlockSelection) against its mask form
(QSAIndexer.select, the reference), a whole step at once: decodes and a prefill chunk of sequences of
different lengths, ending mid-block and mid-page, budgets below and above their visible blocks, scored in
one row tile or many (tiles that mix sequences); and selected_attention (the kernels' dispatch) against
masked_attention under the reference mask, with the C++ kernel and without it."""

from __future__ import annotations

import random

import pytest
import torch

from ember.config.model_config import IndexerConfig, RopeConfig
from ember.kernels import cpu_qsa_attention
from ember.kernels.metadata import AttentionMetadata
from ember.layers import qsa
from ember.layers.qsa import QSAIndexer, masked_attention, selected_attention, sequence_slots
from ember.layers.rotary import RotaryEmbedding

D_INDEX, HEADS, BLOCK_SIZE, NUM_BLOCKS = 16, 2, 16, 48
Q_LENS, SEQ_LENS = [1, 29, 1, 1], [203, 150, 38, 3]  # a prefill chunk from index 121 on; a sequence with no block


def step(budget: int, seed: int = 0):
    """(indexer with random norms and a random raw-key pool, its queries [T, heads, d], the step's metadata,
    cos_sin of sequence indices) for Q_LENS / SEQ_LENS over shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    ix = QSAIndexer(IndexerConfig(HEADS, D_INDEX, budget, 4), 8, 1e-6, torch.float32, "cpu")
    ix.k_layernorm.weight.copy_(torch.randn(D_INDEX, generator=g) * 0.1)
    ix.keys = torch.randn(NUM_BLOCKS * BLOCK_SIZE, D_INDEX, generator=g)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in SEQ_LENS]
    width = max(map(len, tables)) + 1
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(Q_LENS), dtype=torch.int64),
        query_start_loc=torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=BLOCK_SIZE,
        query_lens_cpu=Q_LENS,
        seq_lens_cpu=SEQ_LENS,
        max_query_len=max(Q_LENS),
        max_seq_len=max(SEQ_LENS),
    )
    rotary = RotaryEmbedding(D_INDEX, RopeConfig(), 512)
    cos_sin = rotary.get_cos_sin(torch.arange(max(SEQ_LENS)))
    return ix, torch.randn(sum(Q_LENS), HEADS, D_INDEX, generator=g), meta, cos_sin


def reference_masks(ix, q, meta, cos_sin):
    """select's mask of each sequence's rows (rows of sequence b: [q_len, seq_len])."""
    out, s = [], 0
    for b, (n, N) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        raw = ix.keys[sequence_slots(meta, b, N)]
        out.append(ix.select(q[s : s + n], raw, N - n, (cos_sin[0][:N], cos_sin[1][:N])))
        s += n
    return out


@pytest.mark.parametrize("tile", [qsa.TILE_ELEMENTS, 50 * 16 * 3])  # one tile; tiles of 3 rows (mixed sequences)
@pytest.mark.parametrize("budget", [20, 64, 400])  # 5 blocks; 16; more than any row sees
def test_index_form_is_the_mask_form(budget, tile, monkeypatch):
    monkeypatch.setattr(qsa, "TILE_ELEMENTS", tile)
    ix, q, meta, cos_sin = step(budget)
    sel = ix.select_blocks(q, meta, cos_sin)
    assert sel.blocks.shape == (sum(Q_LENS), min(budget // 4, max(SEQ_LENS) // 4))
    s = 0
    for n, N, want in zip(Q_LENS, SEQ_LENS, reference_masks(ix, q, meta, cos_sin)):
        assert torch.equal(sel.mask(N)[s : s + n], want)
        s += n
    valid = sel.blocks[sel.blocks >= 0]
    assert valid.numel() and (sel.blocks[:, 1:] >= 0).le(sel.blocks[:, :-1] >= 0).all()  # ids first, pads after
    kept = sel.mask(max(SEQ_LENS)).sum(1)
    assert kept.max() <= budget + 3 and sel.tail_start.tolist()[-1] == 0  # the 3-token sequence: its tail only


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_selected_attention_is_masked_attention(kernel, kv_dtype):
    """The step's attention in one call (the C++ kernel, or the gathered torch form) against masked_attention
    under each sequence's reference mask; GQA 3 query heads a kv head."""
    ix, iq, meta, cos_sin = step(24, seed=1)
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 32, generator=g).to(kv_dtype)
    q = torch.randn(sum(Q_LENS), 6, 32, generator=g).to(kv_dtype)
    sel = ix.select_blocks(iq, meta, cos_sin)
    assert cpu_qsa_attention.supports(q, cache)
    got = selected_attention(q, cache, meta.block_tables, sel, 0.17, kernel)
    keys, values = (cache[i].reshape(-1, 2, 32) for i in (0, 1))
    s = 0
    for b, (n, N, mask) in enumerate(zip(Q_LENS, SEQ_LENS, reference_masks(ix, iq, meta, cos_sin))):
        slots = sequence_slots(meta, b, N)
        want = masked_attention(q[s : s + n], keys[slots], values[slots], mask, 0.17)
        tol = dict(rtol=1.6e-2, atol=1e-2) if kv_dtype == torch.bfloat16 else dict(rtol=0, atol=1e-5)
        torch.testing.assert_close(got[s : s + n].float(), want.float(), **tol)
        s += n


def test_ties_at_the_cut_are_the_references():
    """Zero scores (all heads' dot products negative: the ReLU) tie often. Where tied blocks straddle the k-th
    place, the kept ones are those torch.topk keeps over the row's visible blocks alone (the reference's one
    topk per query), whatever the row's padding; invisible blocks never count, however they score."""
    scores = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0, 9.0], [0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 9.0]])
    nc = torch.tensor([6, 4])
    got = qsa.top_blocks(scores, nc, 3)
    for row, n in zip(range(2), nc.tolist()):
        want = sorted(scores[row, :n].topk(3).indices.tolist())
        assert got[row].tolist() == want
    assert {1, 3} <= set(got[0].tolist())  # the two positive blocks, and one of the tied zeros
    assert qsa.top_blocks(scores, torch.tensor([2, 0]), 3).tolist() == [[0, 1, -1], [-1, -1, -1]]
    padded = torch.cat([scores, torch.zeros(2, 40)], dim=1)  # the batch's longer rows: the same choice
    assert torch.equal(qsa.top_blocks(padded, nc, 3), got)
