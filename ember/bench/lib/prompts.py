"""Benchmark prompts: seeded random ordinary tokens, the same for every side and new every run (so no
prefix cache helps), and held-out chat requests, built from text `ember train-mtp` never trains on.
"""

from __future__ import annotations

import os
import random

WARMUP_SEED = 10_000  # warmup prompts never repeat a measured run's prompts
PROMPT_SEED = 4242  # held-out prompt sets: seed + run index (the MTP training uses seeds 0..2)
# held-out chat prompts for decode: rounds -1.. take seeds from here on (ember bench spec's runs use 0..)
DECODE_PROMPT_RUN = 100


class PromptMaker:
    """Seeded random token prompts drawn from the ordinary vocabulary (special tokens left out,
    so no BOS/EOS/chat markers land mid-prompt). The same seed gives the same prompts, so ember
    and the peer see identical inputs; a new seed per run keeps the prefix cache from helping."""

    def __init__(self, vocab_size: int, special_ids: set[int], base_seed: int = 0):
        self.pool = [t for t in range(vocab_size) if t not in special_ids]
        self.base_seed = base_seed

    def make(self, n: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(self.base_seed * 1_000_000_007 + seed)
        return [rng.choices(self.pool, k=length) for _ in range(n)]


def prompt_maker(llm, base_seed: int = 0) -> PromptMaker:
    tok = llm.get_tokenizer()
    vocab = min(tok.vocab_size, llm.engine.parts.loaded.model_config.vocab_size)
    return PromptMaker(vocab, set(tok.all_special_ids), base_seed)


def prompt_maker_of(side, base_seed: int) -> PromptMaker:
    """The prompts of a side that may live in another process: it tells its vocabulary (sides/)."""
    vocab, special = side.prompt_vocab
    return PromptMaker(vocab, set(special), base_seed)


def prompt_seed(run: int, attempt: int, salt: int = 0) -> int:
    """A seed per (run, attempt, salt): warmup (run -1) and every redo get prompts of their own."""
    return (WARMUP_SEED if run < 0 else run) + 100_000 * attempt + 7919 * salt


def held_out_prompts(tokenizer, n: int, run: int) -> list[list[int]]:
    """n chat requests from pydoc_split("eval") (the half MTP training never reads), through the model's chat
    template."""
    from ember.train.calibration import pydoc_split
    from ember.train.mtp_data import build_prompts

    texts = pydoc_split("eval")
    return [p.ids for p in build_prompts(tokenizer, texts, n, PROMPT_SEED + run, temperature=0.0) if p.kind == "chat"][
        :n
    ] or [p.ids for p in build_prompts(tokenizer, texts, n, PROMPT_SEED + run)]


def chat_prompts(model: str):
    """round -> a held-out chat request (held_out_prompts), new each round; the driver's own tokenizer."""
    tok, _ = load_tokenizer(model)
    return lambda r: held_out_prompts(tok, 4, DECODE_PROMPT_RUN + r)[0]


def load_tokenizer(path: str | None):
    """(tokenizer, model vocab size) of a model folder or .gguf file, without loading weights."""
    from ember.config.model_config import ModelConfig
    from ember.loader.model_loader import resolve_model_path
    from ember.loader.tokenizer import Tokenizer

    p = resolve_model_path(path)
    if os.path.isfile(p):
        from ember.loader.gguf import GGUFCheckpoint

        ckpt = GGUFCheckpoint(p)
        return ckpt.tokenizer(), ModelConfig.from_dict(ckpt.config).vocab_size
    tok = Tokenizer.from_folder(p)
    return tok, ModelConfig.from_folder(p).vocab_size


def ordinary_tokens(tokenizer, vocab_size: int) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [t for t in range(min(tokenizer.vocab_size, vocab_size)) if t not in special]
