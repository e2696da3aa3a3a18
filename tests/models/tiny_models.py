"""Tiny random HF models (built offline from configs) and a paged-KV driver for ember models.

The driver plays the scheduler's part in miniature: it hands out blocks, builds the varlen
AttentionMetadata for each step and runs greedy decoding, so tests reach every attention path
(fresh prefill, chunk over a cached prefix, batched decode, mixed steps).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

import pytest
import torch

from ember.config.model_config import ModelConfig
from ember.kernels.metadata import AttentionMetadata
from ember.kernels.torch_attention import TorchAttentionBackend
from ember.loader.weights import iter_safetensors
from ember.models.registry import get_model_class

VOCAB = 1000

HF_CONFIGS = {
    # GQA 3:1, untied, llama3 rope scaling.
    "llama": dict(
        cls="LlamaForCausalLM",
        init_std=(0.2, 0.2),
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    # q/k/v bias, tied embeddings.
    "qwen2": dict(
        cls="Qwen2ForCausalLM",
        init_std=(0.2, 0.2),
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # head_dim 32 != 64 / 4, yarn.
    "qwen3": dict(
        cls="Qwen3ForCausalLM",
        init_std=(0.2, 0.2),
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # 8 experts top-2, renormalised; layer 1 is dense.
    "qwen3_moe": dict(
        cls="Qwen3MoeForCausalLM",
        init_std=(0.5, 0.08),
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
ARCHS = list(HF_CONFIGS)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and with busy cores OpenMP's spin-waits
    make small SDPA calls ~100x slower (measured: this suite 114 s with 2 threads under load,
    4 s with 1). Import it into a test module and mark the module with usefixtures."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def build_hf_model(arch: str, seed: int = 0):
    """A random fp32 HF model; every parameter is randomised (biases and norm weights too).

    init_std (embedding/head, other weights) is picked per model so greedy text does not
    collapse to one repeated token and top-1/top-2 logit gaps stay far above fp32 noise."""
    import transformers

    spec = dict(HF_CONFIGS[arch])
    cls = getattr(transformers, spec.pop("cls"))
    embed_std, weight_std = spec.pop("init_std")
    config = cls.config_class(**spec)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, embed_std)
            else:
                p.normal_(0.0, weight_std)
    return model


def save_hf_model(model, path: str, **kwargs) -> str:
    model.save_pretrained(path, **kwargs)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    # transformers 5 writes Qwen3-MoE's expert count as "num_local_experts"; released Qwen3-MoE
    # checkpoints say "num_experts", which is what ember's ModelConfig reads.
    if "num_local_experts" in cfg and "num_experts" not in cfg:
        cfg["num_experts"] = cfg["num_local_experts"]
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    return path


def load_ember_model(path: str, dtype=torch.float32):
    cfg = ModelConfig.from_folder(path)
    model = get_model_class(cfg.architecture)(
        cfg, dtype=dtype, device=torch.device("cpu"), attn_backend=TorchAttentionBackend()
    )
    model.load_weights(iter_safetensors(path, progress=False))
    return model.eval()


@dataclass
class Seq:
    prompt: list[int]
    max_new: int
    arrival: int = 0  # first step it may run in
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new


class PagedDriver:
    """Owns per-layer paged caches and a shuffled block pool; runs varlen steps on an ember model."""

    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, seed: int = 0):
        cfg = model.cfg
        self.model, self.block_size = model, block_size
        g = torch.Generator().manual_seed(seed)
        # Finite garbage, not zeros: unused cache slots must be masked, never trusted.
        self.kv_caches = [
            torch.randn(2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, generator=g).to(model.dtype)
            for _ in range(cfg.num_layers)
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous block tables

    def _slots(self, seq: Seq, start: int, n: int) -> list[int]:
        bs = self.block_size
        while len(seq.blocks) * bs < start + n:
            seq.blocks.append(self.free.pop())
        return [seq.blocks[p // bs] * bs + p % bs for p in range(start, start + n)]

    @torch.inference_mode()
    def step(self, work: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """work: (seq, q_len) pairs -- q_len new tokens from seq.num_computed on. Returns each seq's
        logits [q_len, V] and advances num_computed."""
        ids, pos, slots, qlens, seq_lens = [], [], [], [], []
        for seq, n in work:
            start = seq.num_computed
            ids += seq.tokens[start : start + n]
            pos += list(range(start, start + n))
            slots += self._slots(seq, start, n)
            qlens.append(n)
            seq_lens.append(start + n)
        max_blocks = max(len(s.blocks) for s, _ in work)
        tables = [s.blocks + [0] * (max_blocks - len(s.blocks)) for s, _ in work]
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            block_size=self.block_size,
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), self.kv_caches, meta
        )
        logits = self.model.compute_logits(hidden)
        for seq, n in work:
            seq.num_computed += n
        return list(logits.split(qlens))

    def generate(self, seqs: list[Seq], chunk: int = 10**9) -> int:
        """Greedy-decode every seq to max_new tokens, prefilling prompts in chunks of `chunk` tokens,
        all running seqs in one step. Returns the number of steps."""
        step = 0
        while not all(s.done for s in seqs):
            work = []
            for s in seqs:
                if s.done or s.arrival > step:
                    continue
                todo = len(s.tokens) - s.num_computed
                work.append((s, min(todo, chunk)))
            if work:
                for (s, n), logits in zip(work, self.step(work)):
                    if s.num_computed == len(s.tokens):  # prompt (or last token) fully in: sample
                        s.tokens.append(int(logits[-1].argmax()))
            step += 1
        return step


def hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=g).tolist()
