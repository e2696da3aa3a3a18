"""Training data for `ember train-mtp`: the model's own generations on offline prompts, and the
frozen model's final-normed hidden states over them.

Prompts come from CPython's help topics (ember.train.calibration.pydoc_split: the "calib" half
for training, the "eval" half held out; training snippets that repeat a paragraph of the "eval"
half -- the topics overlap -- are dropped). Each topic is cut into snippets (paragraphs merged up to
~600 characters, each with the title of its section) and turned into:
- chat requests through the model's chat template ("Explain ...", "Summarize ...", "Give an
  example of ...", questions about the section title, ...), and
- raw-text continuations (a snippet as a plain prompt; the model goes on writing).
ember itself generates the continuations (ember.LLM, batched), greedy for some prompts and at
temperature 0.7 / 0.8 for the others, so the MTP head sees both kinds of text.

Then the frozen model runs once over each prompt + generation (one prefill) and its final-normed
hidden state h_i at every position is kept (what LlamaForCausalLM.forward returns: the input of
the LM head and of an MTP layer). The teacher's next-token distribution at position i is
head(h_i); the trainer computes it on the fly over the draft vocabulary instead of storing
[T, V] logits.
"""

from __future__ import annotations

import logging
import random
import re
import time
from dataclasses import dataclass, field

import torch

from ember.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

CHAT_TEMPLATES = (
    "Explain the following passage from the Python documentation in simple terms:\n\n{snippet}",
    "Summarize this in a few sentences:\n\n{snippet}",
    "Give an example of Python code that illustrates this:\n\n{snippet}",
    "What does this mean, and when would I use it?\n\n{snippet}",
    "Rewrite this as a short bulleted list of the key points:\n\n{snippet}",
    "Explain {title} in Python to a beginner.",
    "Give an example of {title} in Python and explain what it does.",
    "What are common mistakes people make with {title} in Python?",
    "Write a short tutorial about {title} in Python.",
    "Answer briefly: what is {title} in Python, and why is it useful?",
)
RAW_SHARE = 0.25  # fraction of prompts that are raw-text continuations (no chat template)
SAMPLED_SHARE = 0.4  # fraction generated at temperature 0.7 / 0.8 (the rest greedy)
SAMPLE_TEMPERATURES = (0.7, 0.8)
_HEADER_RULE = re.compile(r"^[*=\-~^\"]{3,}\s*$")


@dataclass
class Snippet:
    title: str
    text: str


@dataclass
class Prompt:
    kind: str  # "chat" | "raw"
    ids: list[int]
    temperature: float
    seed: int


@dataclass
class Sequence:
    """One prompt + its generation; hidden [T, H] (the model's dtype) once the teacher has run."""

    ids: torch.Tensor  # int64 [T]
    prompt_len: int
    temperature: float
    kind: str
    hidden: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.numel())


@dataclass
class MTPData:
    train: list[Sequence]
    eval_greedy: list[Sequence]  # held-out prompts, temperature 0 (acceptance at position 1, 2, 3)
    eval_sampled: list[Sequence]  # held-out prompts, temperature 0.8 (expected acceptance of greedy drafts)
    info: dict = field(default_factory=dict)

    def state(self) -> dict:
        def pack(seqs):
            return [
                {
                    "ids": s.ids,
                    "prompt_len": s.prompt_len,
                    "temperature": s.temperature,
                    "kind": s.kind,
                    "hidden": s.hidden,
                }
                for s in seqs
            ]

        return {
            "train": pack(self.train),
            "eval_greedy": pack(self.eval_greedy),
            "eval_sampled": pack(self.eval_sampled),
            "info": self.info,
        }

    @classmethod
    def from_state(cls, st: dict) -> "MTPData":
        def unpack(items):
            return [Sequence(d["ids"], d["prompt_len"], d["temperature"], d["kind"], d.get("hidden")) for d in items]

        return cls(unpack(st["train"]), unpack(st["eval_greedy"]), unpack(st["eval_sampled"]), st.get("info", {}))


# ---- prompts ----------------------------------------------------------------------------------


def snippets(texts: list[str], max_chars: int = 600, min_chars: int = 120) -> list[Snippet]:
    """Paragraphs of each topic merged up to max_chars, each tagged with its section title."""
    out: list[Snippet] = []
    for text in texts:
        lines = text.strip("\n").split("\n")
        title = lines[0].strip() if lines else ""
        paras: list[tuple[str, str]] = []
        buf: list[str] = []
        section = title
        for k, line in enumerate(lines):
            nxt = lines[k + 1] if k + 1 < len(lines) else ""
            if _HEADER_RULE.match(nxt) and line.strip():  # a section header (the rule is on the next line)
                if buf:
                    paras.append((section, "\n".join(buf).strip()))
                    buf = []
                section = line.strip()
                continue
            if _HEADER_RULE.match(line):
                continue
            if not line.strip():
                if buf:
                    paras.append((section, "\n".join(buf).strip()))
                    buf = []
                continue
            buf.append(line)
        if buf:
            paras.append((section, "\n".join(buf).strip()))
        cur_title, cur = None, ""
        for sec, para in paras:
            if cur and (sec != cur_title or len(cur) + len(para) + 2 > max_chars):
                if len(cur) >= min_chars:
                    out.append(Snippet(cur_title, cur[:max_chars]))
                cur = ""
            cur_title = sec
            cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= min_chars:
            out.append(Snippet(cur_title, cur[:max_chars]))
    return out


def _squash(text: str) -> str:
    return " ".join(text.split())


def disjoint_snippets(texts: list[str], others: list[str], min_chars: int = 60) -> list[Snippet]:
    """snippets(texts) without those sharing a paragraph (>= min_chars) with any of `others`.

    The pydoc topics overlap: "exceptions" repeats paragraphs of "try", "specialnames" those of the
    numeric-method topics, ... (77 of the 351 held-out snippets appear verbatim in the calibration
    half). Training prompts drop those, so every prompt built from the held-out half is new."""
    hay = "\n".join(_squash(t) for t in others)
    out = []
    for snip in snippets(texts):
        paras = [_squash(p) for p in snip.text.split("\n\n")]
        if not any(len(p) >= min_chars and p in hay for p in paras):
            out.append(snip)
    return out


def build_prompts(
    tokenizer,
    texts: list[str],
    num_prompts: int,
    seed: int,
    greedy_only: bool = False,
    temperature: float | None = None,
    exclude: list[str] | None = None,
) -> list[Prompt]:
    """num_prompts prompts (token ids) from the texts: chat requests through the chat template and raw
    continuations, each with the temperature it is generated at. Deterministic for a seed.
    exclude: texts whose paragraphs the prompts must not contain (see disjoint_snippets)."""
    rng = random.Random(seed)
    snips = disjoint_snippets(texts, exclude) if exclude else snippets(texts)
    if not snips:
        raise ValueError("no text to build prompts from")
    order = list(range(len(snips)))
    rng.shuffle(order)
    has_template = True
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    except Exception:  # noqa: BLE001 - a model without a chat template gets raw prompts only
        has_template = False
    prompts = []
    for n in range(num_prompts):
        snip = snips[order[n % len(snips)]]
        raw = not has_template or rng.random() < RAW_SHARE
        if raw:
            ids = tokenizer.encode(snip.text)
        else:
            template = CHAT_TEMPLATES[rng.randrange(len(CHAT_TEMPLATES))]
            content = template.format(snippet=snip.text, title=snip.title)
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
            )
        if temperature is not None:
            temp = temperature
        elif greedy_only or rng.random() >= SAMPLED_SHARE:
            temp = 0.0
        else:
            temp = SAMPLE_TEMPERATURES[rng.randrange(len(SAMPLE_TEMPERATURES))]
        prompts.append(Prompt("raw" if raw else "chat", list(ids), temp, seed * 1_000_003 + n))
    return prompts


def generate(llm, prompts: list[Prompt], max_new_tokens: int, progress: bool = True) -> list[Sequence]:
    """Continuations by ember itself (one batched LLM.generate call); keeps the token ids."""
    from ember.sampling import SamplingParams

    params = [
        SamplingParams(temperature=p.temperature, max_tokens=max_new_tokens, seed=p.seed if p.temperature > 0 else None)
        for p in prompts
    ]
    outs = llm.generate([{"prompt_token_ids": p.ids} for p in prompts], params, use_tqdm=progress)
    seqs = []
    for p, out in zip(prompts, outs):
        gen = list(out.outputs[0].token_ids)
        seqs.append(Sequence(torch.tensor(p.ids + gen, dtype=torch.int64), len(p.ids), p.temperature, p.kind))
    return seqs


# ---- the frozen model's hidden states ---------------------------------------------------------------


def prefill_meta(lengths: list[int], device=None) -> AttentionMetadata:
    """Fresh prefills of several sequences in one step: sequence b in block b of size max(lengths)."""
    L, B = max(lengths), len(lengths)
    slots = torch.cat([torch.arange(n) + b * L for b, n in enumerate(lengths)])
    qsl = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=torch.arange(B, dtype=torch.int32, device=device)[:, None],
        block_size=L,
        query_lens_cpu=list(lengths),
        seq_lens_cpu=list(lengths),
        max_query_len=L,
        max_seq_len=L,
        all_slots_valid=True,
    )


@torch.no_grad()
def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length, shortest first, so that (count x longest) <= batch_tokens per group."""
    batches, cur = [], []
    for k in sorted(range(len(lengths)), key=lambda k: lengths[k]):  # stable: equal lengths keep index order
        if cur and (len(cur) + 1) * lengths[k] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(k)
    if cur:
        batches.append(cur)
    return batches


@torch.inference_mode()
def teacher_hidden_engine(engine, seqs: list[Sequence], progress: bool = True, desc: str = "teacher forward") -> None:
    """teacher_hidden for a model with recurrent state (a hybrid): each sequence prefilled whole through the
    engine's runner, its KV blocks and state slot borrowed and given back, its hidden rows kept (for
    qwen4_exp the 4-stream residual its MTP layer reads)."""
    from tqdm import tqdm

    from ember.engine.scheduler import SchedulerOutput
    from ember.errors import ConfigError
    from ember.request import Request

    runner, kv = engine.parts.runner, engine.parts.kv
    for k, seq in enumerate(tqdm(seqs, desc=desc, unit="seq", disable=not progress, dynamic_ncols=True)):
        req = Request(f"teacher-{k}", seq.ids.tolist(), sampling_params=None)
        if not kv.allocate_slots(req, len(seq)):
            raise ConfigError(f"the KV cache cannot hold a {len(seq)}-token sequence; raise --kv-cache-memory")
        try:
            batch = runner.prepare(SchedulerOutput(scheduled=[(req, len(seq))]))
            hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)
            seq.hidden = hidden.detach().cpu().clone()
        finally:
            kv.free(req)


def teacher_hidden(
    main, seqs: list[Sequence], batch_tokens: int = 4096, progress: bool = True, desc: str = "teacher forward"
) -> None:
    """Fill seq.hidden with the frozen model's final-normed hidden states [T, H] (one prefill each,
    a few sequences per step)."""
    from tqdm import tqdm

    cfg = main.cfg
    batches = length_batches([len(s) for s in seqs], batch_tokens)
    attn = main.model.layers[0].self_attn.attn
    with tqdm(total=sum(len(s) for s in seqs), desc=desc, unit="tok", disable=not progress, dynamic_ncols=True) as bar:
        for batch in batches:
            lengths = [len(seqs[k]) for k in batch]
            L = max(lengths)
            ids = torch.cat([seqs[k].ids for k in batch]).to(main.device)
            pos = torch.cat([torch.arange(n) for n in lengths]).to(main.device)
            caches = [
                torch.zeros(2, len(batch), L, attn.num_kv_heads, attn.head_dim, dtype=main.dtype, device=main.device)
                for _ in range(cfg.num_layers)
            ]
            h = main(ids, pos, caches, prefill_meta(lengths, main.device))
            for k, part in zip(batch, h.split(lengths)):
                seqs[k].hidden = part.detach().cpu().clone()
            bar.update(sum(lengths))


# ---- draft vocabulary ----------------------------------------------------------------------------------


def draft_vocabulary(seqs: list[Sequence], vocab_size: int, size: int) -> tuple[torch.Tensor, dict]:
    """The `size` token ids the draft may propose, most frequent first (FR-Spec / EAGLE-3): ranked by
    count among generated tokens, then among prompt tokens, then by id (BPE ids grow as merges get
    rarer). Returns (int64 [size], stats)."""
    size = min(size, vocab_size)
    gen = torch.zeros(vocab_size, dtype=torch.int64)
    prm = torch.zeros(vocab_size, dtype=torch.int64)
    for s in seqs:
        gen += torch.bincount(s.ids[s.prompt_len :], minlength=vocab_size)[:vocab_size]
        prm += torch.bincount(s.ids[: s.prompt_len], minlength=vocab_size)[:vocab_size]
    order = torch.arange(vocab_size)  # lower id first, then (stable sorts) by prompt count, by generated count
    order = order[prm[order].argsort(descending=True, stable=True)]
    order = order[gen[order].argsort(descending=True, stable=True)]
    ids = order[:size]
    total = int(gen.sum())
    stats = {
        "distinct_generated": int((gen > 0).sum()),
        "generated_tokens": total,
        "train_coverage": float(gen[ids].sum()) / max(total, 1),
    }
    return ids.sort().values, stats


def coverage(seqs: list[Sequence], draft_vocab: torch.Tensor, vocab_size: int) -> float:
    """Share of the generated tokens of seqs that are in draft_vocab."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[draft_vocab] = True
    hit = tot = 0
    for s in seqs:
        g = s.ids[s.prompt_len :]
        hit += int(inside[g].sum())
        tot += g.numel()
    return hit / max(tot, 1)


def make_data(
    llm,
    main,
    tokenizer,
    num_prompts: int,
    max_new_tokens: int,
    seed: int,
    eval_prompts: int,
    progress: bool = True,
    teacher_batch_tokens: int = 4096,
) -> MTPData:
    """Prompts -> generations (llm) -> hidden states (main). Held-out sets from pydoc_split("eval")."""
    from ember.train.calibration import pydoc_split

    t0 = time.perf_counter()
    eval_texts = pydoc_split("eval")
    train_p = build_prompts(tokenizer, pydoc_split("calib"), num_prompts, seed, exclude=eval_texts)
    eval_g = build_prompts(tokenizer, eval_texts, eval_prompts, seed + 1, temperature=0.0)
    eval_s = build_prompts(tokenizer, eval_texts, eval_prompts, seed + 2, temperature=0.8)
    everything = generate(llm, train_p + eval_g + eval_s, max_new_tokens, progress)
    t1 = time.perf_counter()
    train, eg, es = (
        everything[:num_prompts],
        everything[num_prompts : num_prompts + eval_prompts],
        everything[num_prompts + eval_prompts :],
    )
    if main.cfg.is_hybrid:  # recurrent states: through the engine's own step, a sequence at a time
        teacher_hidden_engine(llm.engine, everything, progress)
    else:
        teacher_hidden(main, everything, teacher_batch_tokens, progress)
    t2 = time.perf_counter()
    info = {
        "generation_seconds": t1 - t0,
        "teacher_seconds": t2 - t1,
        "train_sequences": len(train),
        "train_tokens": sum(len(s) for s in train),
        "train_generated_tokens": sum(len(s) - s.prompt_len for s in train),
        "train_greedy_sequences": sum(s.temperature == 0 for s in train),
        "train_raw_sequences": sum(s.kind == "raw" for s in train),
        "eval_generated_tokens": sum(len(s) - s.prompt_len for s in eg),
    }
    log.info(
        "train-mtp data: %d sequences, %d tokens (%d generated) in %.0f s; teacher forward %.0f s",
        info["train_sequences"],
        info["train_tokens"],
        info["train_generated_tokens"],
        t1 - t0,
        t2 - t1,
    )
    return MTPData(train, eg, es, info)
