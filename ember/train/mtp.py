"""`ember train-mtp [MODEL] --out DIR`: distil an MTP layer for a model that has none.

Data (ember.train.mtp_data): the model's own generations on offline prompts (pydoc_data help
topics, chat requests and raw continuations; greedy and temperature 0.7 / 0.8), and the frozen
model's final-normed hidden states h_i over prompt + generation.

The MTP layer (ember.models.mtp, DeepSeek-V3 layout, one layer) at position i takes
(h_i, Embed(t_{i+1})) and predicts t_{i+2}. It is trained against the model's own distribution at
position i + 1, softmax(head(h_{i+1})) restricted to the draft vocabulary (KL), plus a hard
cross-entropy on the actual token t_{i+2}. With --depth D > 1 the same layer is also trained as
the engine uses it for drafts 2..D (training-time test, as EAGLE-3): step s re-enters the layer
with the g of step s - 1, the next token and position + s, attending to step 0's keys up to its
start and to its own chain (MTPModule.forward_dense), and predicts t_{i+s+2}.

Init: the block is a copy of the model's last decoder layer, the final norm the model's, the head
the model's LM-head rows of the draft vocabulary, enorm / hnorm ones, eh_proj [I, I] (x = e + h).

Reduced draft vocabulary: the --draft-vocab-size most frequent generated tokens of the training
data (FR-Spec / EAGLE-3); the MTP's own head has only those rows and the folder stores the ids
(`shared_head.draft_vocab`). 0 keeps a full-vocabulary head.

Held-out evaluation (pydoc_split("eval") prompts, never trained on): greedy generations; at each
decode position the MTP drafts 3 tokens recursively; acceptance at position k is the share of
positions where drafts 1..k all equal the model's greedy tokens (what greedy speculative decoding
accepts), and the conditional rate given k - 1 accepted. At temperature 0.8 (sampled held-out
generations) the expected acceptance of the greedy draft 1 is the target's probability of it.

Output: DIR/config.json (architectures <Stem>MTP, num_nextn_predict_layers 1, draft_vocab_size),
DIR/model.safetensors (MTP tensors only, DeepSeek names model.layers.{num_hidden_layers}.*, bf16),
DIR/README.md (command, data, times, held-out acceptance). Resumable: DIR/checkpoint (or
--checkpoint-dir) holds the generated data (data.pt) and the training state (state.pt: weights,
AdamW state, step), saved every --save-every steps and at the end of each epoch.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ember.errors import ConfigError
from ember.models.mtp import MTPModule
from ember.spec.mtp_weights import export_deepseek_tensors, load_mtp, main_head_rows
from ember.train.mtp_data import MTPData, Sequence, coverage, draft_vocabulary, length_batches, make_data

log = logging.getLogger(__name__)

# main-config keys copied into the MTP folder's config.json (the block's shape; all equal the model's)
BLOCK_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "vocab_size",
)
DATA_KEYS = ("model", "num_prompts", "max_new_tokens", "eval_prompts", "seed")


@dataclass
class TrainConfig:
    model: str | None = None
    out: str = "mtp"
    checkpoint_dir: str | None = None  # default: OUT/checkpoint
    num_prompts: int = 1280
    max_new_tokens: int = 256
    eval_prompts: int = 48
    epochs: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup: float = 0.03  # fraction of the steps
    draft_vocab_size: int = 6144  # 0 = full vocabulary head
    depth: int = 1  # draft steps trained (1 = step 0 only)
    depth_weights: tuple[float, ...] = (1.0, 0.5, 0.3, 0.2)
    kl_weight: float = 1.0
    ce_weight: float = 0.3
    batch_tokens: int = 2048
    seed: int = 0
    train_dtype: str = "bfloat16"  # autocast compute dtype on top of float32 master weights ("float32" = none)
    threads: int | None = None
    gen_batch: int = 32  # sequences generated at once
    save_every: int = 50
    resume: bool = False
    max_steps: int | None = None  # stop early (tests, time limits); the checkpoint is saved
    progress: bool = True
    engine_knobs: dict = field(default_factory=dict)  # extra ember.LLM keywords for generation

    @property
    def ckpt_dir(self) -> str:
        return self.checkpoint_dir or os.path.join(self.out, "checkpoint")

    def data_fingerprint(self, model_path: str) -> dict:
        d = {k: getattr(self, k) for k in DATA_KEYS}
        d["model"] = os.path.realpath(model_path)
        return d


# ---- model setup ---------------------------------------------------------------------------------


@torch.no_grad()
def dense_weight(linear, dtype: torch.dtype, device) -> torch.Tensor:
    """A linear layer's [out, in] weight, dense, whatever its quant method (applied to the identity)."""
    from ember.layers.linear import DenseMethod

    if isinstance(linear.quant_method, DenseMethod):
        return linear.weight.detach()
    eye = torch.eye(linear.in_features, dtype=dtype, device=device)
    return linear.quant_method.apply(linear, eye, None).T.contiguous()


@torch.no_grad()
def init_from_main(mtp: MTPModule, main) -> None:
    """Block <- the model's last decoder layer (dequantized); final norm <- the model's; head <- the LM
    head's rows of the draft vocabulary; enorm / hnorm <- 1; eh_proj <- [I, I] (x = e + h)."""
    layer, src = mtp.layers[0], main.model.layers[-1]
    blk = layer.block
    pairs = [(blk.self_attn.qkv_proj, src.self_attn.qkv_proj), (blk.self_attn.o_proj, src.self_attn.o_proj)]
    if hasattr(blk.mlp, "gate_up_proj") and hasattr(src.mlp, "gate_up_proj"):
        pairs += [(blk.mlp.gate_up_proj, src.mlp.gate_up_proj), (blk.mlp.down_proj, src.mlp.down_proj)]
    for dst, s in pairs:
        dst.weight.copy_(dense_weight(s, main.dtype, main.device))
        if dst.bias is not None and s.bias is not None:
            dst.bias.copy_(s.bias)
    for name in ("input_layernorm", "post_attention_layernorm"):
        getattr(blk, name).weight.copy_(getattr(src, name).weight)
    if blk.self_attn.qk_norm:
        blk.self_attn.q_norm.weight.copy_(src.self_attn.q_norm.weight)
        blk.self_attn.k_norm.weight.copy_(src.self_attn.k_norm.weight)
    layer.enorm.weight.fill_(1.0)
    layer.hnorm.weight.fill_(1.0)
    H = mtp.cfg.hidden_size
    eye = torch.eye(H, dtype=layer.eh_proj.weight.dtype)
    layer.eh_proj.weight.copy_(torch.cat([eye, eye], dim=1))
    layer.final_norm.weight.copy_(main.model.norm.weight)
    ids = layer.draft_vocab if layer.draft_vocab is not None else torch.arange(main.cfg.vocab_size)
    layer.head.weight.copy_(main_head_rows(mtp, ids))


def build_mtp(main, draft_vocab: torch.Tensor | None) -> MTPModule:
    """A one-layer DeepSeek-layout MTP module for main with its own head (reduced when draft_vocab)."""
    mtp = MTPModule(
        main, 1, "deepseek", own_heads=[True], draft_vocab_sizes=[len(draft_vocab)] if draft_vocab is not None else None
    )
    if draft_vocab is not None:
        mtp.layers[0].draft_vocab = draft_vocab.to(torch.int64)
    return mtp


# ---- batches and losses -----------------------------------------------------------------------------


def make_batches(seqs: list[Sequence], batch_tokens: int, seed: int) -> list[list[int]]:
    """Sequences grouped by length so that (count x longest) <= batch_tokens; batch order shuffled by seed."""
    batches = length_batches([len(s) for s in seqs], batch_tokens)
    random.Random(seed).shuffle(batches)
    return batches


def pad_batch(seqs: list[Sequence], extra: int):
    """ids [B, L + extra] (0-padded), hidden [B, L + extra, H] float32, lengths [B]."""
    L = max(len(s) for s in seqs) + extra
    H = seqs[0].hidden.shape[-1]
    ids = torch.zeros(len(seqs), L, dtype=torch.int64)
    hid = torch.zeros(len(seqs), L, H, dtype=torch.float32)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s.ids
        hid[b, : len(s)] = s.hidden.float()
    return ids, hid, torch.tensor([len(s) for s in seqs])


def chain_forward(mtp: MTPModule, ids: torch.Tensor, hid: torch.Tensor, depth: int):
    """Draft steps 0..depth-1 over padded sequences (rows i = 0..R-1, R = L - depth - 1): step s at
    row i takes t_{i+s+1} at position i + s with hidden h_i (s = 0) or step s-1's g. Yields (s, g)."""
    B, Ltot = ids.shape
    R = Ltot - depth - 1
    pos = torch.arange(R).expand(B, R)
    hidden, prior = hid[:, :R], None
    for s in range(depth):
        g, kv = mtp.forward_dense(ids[:, s + 1 : s + 1 + R], pos + s, hidden, step=s, prior_kv=prior)
        prior = (kv[0], kv[1], []) if s == 0 else (prior[0], prior[1], prior[2] + [kv])
        yield s, g
        hidden = g


class MTPTrainer:
    def __init__(self, main, data: MTPData, cfg: TrainConfig, draft_vocab: torch.Tensor | None = None):
        self.main, self.data, self.cfg = main, data, cfg
        vocab = main.cfg.vocab_size
        self.vocab_stats = {}
        # a model whose MTP layer is its own kind (qwen4_exp: build_mtp) trains that layer, scored by the model's
        # own head over the whole vocabulary (its checkpoint format has no head or draft vocabulary of its own)
        self.own_kind = hasattr(main, "build_mtp")
        if self.own_kind and draft_vocab is not None:
            raise ConfigError("--resume: this model's MTP layer has no reduced draft vocabulary; start anew")
        if self.own_kind and 0 < cfg.draft_vocab_size < vocab:
            log.info("%s's MTP layer scores with the model's LM head: the full vocabulary", main.cfg.architecture)
        elif 0 < cfg.draft_vocab_size < vocab:
            ranked, self.vocab_stats = draft_vocabulary(data.train, vocab, cfg.draft_vocab_size)
            if draft_vocab is None:
                draft_vocab = ranked
            elif not torch.equal(draft_vocab, ranked):
                raise ConfigError(
                    "--resume: the checkpoint's draft vocabulary differs from the one this data gives; "
                    "resume with the same data (checkpoint dir) or start anew"
                )
        elif draft_vocab is not None:
            raise ConfigError(
                "--resume: the checkpoint has a reduced draft vocabulary but --draft-vocab-size asks for none"
            )
        self.draft_vocab = draft_vocab
        torch.manual_seed(cfg.seed)
        if self.own_kind:
            self.mtp = main.build_mtp(1)
            self.mtp.init_from_main(main)
        else:
            self.mtp = build_mtp(main, draft_vocab)
            init_from_main(self.mtp, main)
        self.mtp.float()
        self.params = [p for p in self.mtp.parameters()]
        for p in self.params:
            p.requires_grad_(True)
        ids = draft_vocab if draft_vocab is not None else torch.arange(vocab)
        # frozen: the model's head on the draft vocabulary (an own-kind MTP: the model's compute_logits instead)
        self.teacher_rows = None if self.own_kind else main_head_rows(self.mtp, ids).float()
        self.col_of = torch.full((vocab,), -1, dtype=torch.int64)
        self.col_of[ids] = torch.arange(len(ids))
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.step = 0
        self.epoch, self.batch_in_epoch = 0, 0
        self.train_seconds = 0.0
        self.history: list[dict] = []

    # -- schedule
    def steps_per_epoch(self) -> int:
        return len(make_batches(self.data.train, self.cfg.batch_tokens, self.cfg.seed))

    def total_steps(self) -> int:
        return self.steps_per_epoch() * self.cfg.epochs

    def lr_at(self, step: int) -> float:
        total = max(self.total_steps(), 1)
        warm = max(1, int(self.cfg.warmup * total))
        if step < warm:
            return self.cfg.lr * (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, total - warm))
        return self.cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    # -- loss
    def batch_loss(self, seqs: list[Sequence], depth: int | None = None):
        cfg = self.cfg
        depth = depth or cfg.depth
        ids, hid, lens = pad_batch(seqs, depth + 1)
        R = ids.shape[1] - depth - 1
        rows = torch.arange(R)
        total = torch.zeros(())
        stats = {}
        amp = cfg.train_dtype == "bfloat16"
        for s, g in chain_forward(self.mtp, ids, hid, depth):
            valid = rows[None] + s + 2 < lens[:, None]
            gv = g[valid]
            th = hid[:, s + 1 : s + 1 + R][valid]
            target = ids[:, s + 2 : s + 2 + R][valid]
            with torch.no_grad(), torch.autocast("cpu", enabled=False):  # the teacher in float32
                tlog = torch.log_softmax(self.teacher_logits(th), dim=-1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                slogits = self.mtp.compute_draft_logits(gv)[0] if self.own_kind else self.mtp.layers[0].head(gv)
            slog = torch.log_softmax(slogits.float(), dim=-1)
            kl = (tlog.exp() * (tlog - slog)).sum(-1).mean()
            col = self.col_of[target]
            inside = col >= 0
            ce = F.cross_entropy(slog[inside], col[inside]) if inside.any() else slog.sum() * 0
            w = cfg.depth_weights[s] if s < len(cfg.depth_weights) else cfg.depth_weights[-1]
            total = total + w * (cfg.kl_weight * kl + cfg.ce_weight * ce)
            with torch.no_grad():
                agree = (slog.argmax(-1) == tlog.argmax(-1)).float().mean().item()
            stats[f"kl{s}"], stats[f"agree{s}"] = kl.item(), agree
        stats["loss"] = total.item()
        return total, stats

    def teacher_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The frozen model's logits (float32) over the draft vocabulary at these hidden states."""
        if self.own_kind:
            return self.main.compute_logits(hidden.to(self.main.dtype)).float()
        return hidden @ self.teacher_rows.T

    def train(self, progress: bool | None = None, on_step=None) -> list[dict]:
        from tqdm import tqdm

        cfg = self.cfg
        progress = cfg.progress if progress is None else progress
        total = self.total_steps()
        stop = min(total, cfg.max_steps) if cfg.max_steps is not None else total
        amp = cfg.train_dtype == "bfloat16"
        self.mtp.train()
        bar = tqdm(
            total=stop,
            initial=min(self.step, stop),
            desc="train-mtp",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )
        try:
            while self.step < stop:
                batches = make_batches(self.data.train, cfg.batch_tokens, cfg.seed * 1000 + self.epoch)
                while self.batch_in_epoch < len(batches) and self.step < stop:
                    t0 = time.perf_counter()
                    seqs = [self.data.train[k] for k in batches[self.batch_in_epoch]]
                    for group in self.opt.param_groups:
                        group["lr"] = self.lr_at(self.step)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                        loss, stats = self.batch_loss(seqs)
                    self.opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                    self.opt.step()
                    self.step += 1
                    self.batch_in_epoch += 1
                    self.train_seconds += time.perf_counter() - t0
                    stats.update(step=self.step, epoch=self.epoch, lr=self.lr_at(self.step - 1))
                    self.history.append(stats)
                    bar.update(1)
                    bar.set_postfix(loss=f"{stats['loss']:.3f}", agree0=f"{stats['agree0']:.2f}")
                    if on_step is not None:
                        on_step(self)
                    if cfg.save_every and self.step % cfg.save_every == 0:
                        self.save_checkpoint()
                if self.batch_in_epoch >= len(batches):
                    self.epoch += 1
                    self.batch_in_epoch = 0
                    self.save_checkpoint()
        finally:
            bar.close()
        self.save_checkpoint()
        self.mtp.eval()
        return self.history

    # -- checkpoint
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "train_seconds": self.train_seconds,
            "history": self.history,
            "mtp": {k: v.detach().clone() for k, v in self.mtp.state_dict().items()},
            "optimizer": self.opt.state_dict(),
            "draft_vocab": self.draft_vocab,
            "settings": {k: v for k, v in asdict(self.cfg).items() if k not in ("engine_knobs",)},
        }

    def save_checkpoint(self) -> str:
        os.makedirs(self.cfg.ckpt_dir, exist_ok=True)
        path = os.path.join(self.cfg.ckpt_dir, "state.pt")
        torch.save(self.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)
        return path

    def load_checkpoint(self, path: str | None = None) -> None:
        path = path or os.path.join(self.cfg.ckpt_dir, "state.pt")
        st = torch.load(path, map_location="cpu", weights_only=False)
        saved = st["settings"]
        for key in ("draft_vocab_size", "batch_tokens", "seed", "depth"):
            if saved.get(key) != getattr(self.cfg, key):
                raise ConfigError(
                    f"--resume: {path} was trained with {key.replace('_', '-')} {saved.get(key)}, not "
                    f"{getattr(self.cfg, key)}; resume with the same setting or start a new checkpoint dir"
                )
        self.mtp.load_state_dict(st["mtp"])
        self.opt.load_state_dict(st["optimizer"])
        self.step, self.epoch, self.batch_in_epoch = st["step"], st["epoch"], st["batch_in_epoch"]
        self.train_seconds, self.history = st["train_seconds"], st["history"]
        log.info("resumed %s at step %d (epoch %d, batch %d)", path, self.step, self.epoch, self.batch_in_epoch)

    # -- evaluation
    @torch.no_grad()
    def evaluate(self, depth: int = 3, batch_tokens: int | None = None) -> dict:
        return evaluate_mtp(
            self.mtp, self.main, self.data, depth, batch_tokens or self.cfg.batch_tokens, self.draft_vocab
        )


@torch.no_grad()
def evaluate_mtp(
    mtp: MTPModule,
    main,
    data: MTPData,
    depth: int = 3,
    batch_tokens: int = 4096,
    draft_vocab: torch.Tensor | None = None,
) -> dict:
    """Held-out acceptance of greedy drafts (see the module docstring)."""
    was_training = mtp.training
    mtp.eval()
    hits = torch.zeros(depth)
    rows_total = 0
    cond_den = torch.zeros(depth)
    teacher_consistency = [0, 0]
    for batch in make_batches(data.eval_greedy, batch_tokens, 0):
        seqs = [data.eval_greedy[k] for k in batch]
        ids, hid, lens = pad_batch(seqs, depth + 1)
        R = ids.shape[1] - depth - 1
        # the model's greedy token after each position, from its own head (exactly what verification picks)
        greedy = torch.stack([main.compute_logits(hid[b].to(main.dtype)).argmax(-1) for b in range(len(seqs))])
        start = torch.tensor([s.prompt_len - 1 for s in seqs])
        i = torch.arange(R)[None]
        rows = (i >= start[:, None]) & (i + depth + 1 < lens[:, None])  # decode positions with `depth` targets
        match_all = rows.clone()
        for s, g in chain_forward(mtp, ids, hid, depth):
            drafts = mtp.propose_greedy(g.reshape(-1, g.shape[-1]).to(student_dtype(mtp)), s).view(g.shape[:2])
            ok = drafts == greedy[:, s + 1 : s + 1 + R]
            cond_den[s] += match_all.sum()
            match_all = match_all & ok
            hits[s] += match_all.sum()
        rows_total += int(rows.sum())
        gen_rows = rows & (i + 2 < lens[:, None])
        teacher_consistency[0] += int(((greedy[:, 1 : 1 + R] == ids[:, 2 : 2 + R]) & gen_rows).sum())
        teacher_consistency[1] += int(gen_rows.sum())
    acc = (hits / max(rows_total, 1)).tolist()
    cond = (hits / cond_den.clamp_min(1)).tolist()
    # temperature 0.8: expected acceptance of greedy draft 1 = the target's probability of it
    exp_acc, n_s = 0.0, 0
    for batch in make_batches(data.eval_sampled, batch_tokens, 0):
        seqs = [data.eval_sampled[k] for k in batch]
        ids, hid, lens = pad_batch(seqs, 2)
        R = ids.shape[1] - 2
        for s, g in chain_forward(mtp, ids, hid, 1):
            drafts = mtp.propose_greedy(g.reshape(-1, g.shape[-1]).to(student_dtype(mtp)), 0).view(g.shape[:2])
        for b, seq in enumerate(seqs):
            i0, i1 = seq.prompt_len - 1, len(seq) - 2  # rows with a generated next token
            if i1 <= i0:
                continue
            logits = main.compute_logits(hid[b, i0 + 1 : i1 + 1].to(main.dtype))
            p = torch.softmax(logits / 0.8, dim=-1)
            exp_acc += float(p.gather(1, drafts[b, i0:i1, None]).sum())
            n_s += i1 - i0
    if was_training:
        mtp.train()
    out = {
        "acceptance": acc,
        "conditional": cond,
        "positions": rows_total,
        "mean_accepted": {k: float(sum(acc[:k])) for k in range(1, depth + 1)},
        "teacher_consistency": teacher_consistency[0] / max(teacher_consistency[1], 1),
        "t08_pos1_expected_acceptance": exp_acc / max(n_s, 1),
        "t08_positions": n_s,
    }
    if draft_vocab is not None:
        out["heldout_vocab_coverage"] = coverage(data.eval_greedy, draft_vocab, main.cfg.vocab_size)
    return out


# ---- output folder --------------------------------------------------------------------------------------


def student_dtype(mtp) -> torch.dtype:
    """The MTP layer's weights' dtype (float32 master weights while training, the model's once served)."""
    return next(mtp.parameters()).dtype


def mtp_config(main_cfg, draft_vocab_size: int | None) -> dict:
    raw = main_cfg.raw
    cfg = {"architectures": [main_cfg.architecture.removesuffix("ForCausalLM") + "MTP"]}
    cfg.update({k: raw[k] for k in BLOCK_KEYS if k in raw})
    cfg["vocab_size"], cfg["hidden_size"] = main_cfg.vocab_size, main_cfg.hidden_size
    cfg["num_hidden_layers"] = main_cfg.num_layers  # the MTP layer is model.layers.{num_hidden_layers}
    cfg["num_nextn_predict_layers"] = 1
    if draft_vocab_size:
        cfg["draft_vocab_size"] = draft_vocab_size
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def write_mtp_folder(mtp: MTPModule, main_cfg, out: str, readme: str | None = None) -> str:
    """config.json + model.safetensors (bf16, DeepSeek names) (+ README.md): what load_mtp reads."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    own_kind = hasattr(mtp, "export_tensors")  # its model's own checkpoint names and config (qwen4_exp's mtp.*)
    exported = mtp.export_tensors() if own_kind else export_deepseek_tensors(mtp, main_cfg.num_layers)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in exported.items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    dv = mtp.layers[0].draft_vocab
    if own_kind:  # the model's config, naming its own architecture and the layer count
        config = dict(main_cfg.raw, architectures=[main_cfg.architecture], mtp_num_hidden_layers=mtp.num_layers)
    else:
        config = mtp_config(main_cfg, None if dv is None else int(dv.numel()))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config | {"torch_dtype": "bfloat16"}, f, indent=2)
        f.write("\n")
    if readme is not None:
        with open(os.path.join(out, "README.md"), "w") as f:
            f.write(readme)
    return out


def _fmt_time(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def render_readme(
    cfg: TrainConfig,
    main_cfg,
    model_name: str,
    command: str,
    data_info: dict,
    vocab_stats: dict,
    report: dict,
    train_seconds: float,
    steps: int,
    size_bytes: int,
    threads: int,
) -> str:
    """The README.md written beside the MTP weights: what they are, how they were made, how well they draft."""
    dv = cfg.draft_vocab_size if 0 < cfg.draft_vocab_size < main_cfg.vocab_size else None
    sections = [
        _readme_intro(main_cfg, model_name, dv, vocab_stats, report, size_bytes),
        _readme_command(command, threads, steps),
        _readme_data(cfg, data_info),
        _readme_time(data_info, train_seconds),
        _readme_acceptance(cfg, report),
    ]
    return "\n\n".join(sections) + "\n"


def _draft_vocab_line(main_cfg, dv: int | None, vocab_stats: dict, report: dict) -> str:
    if not dv:
        return "none (full-vocabulary head)"
    return (
        f"{dv} token ids (`shared_head.draft_vocab`), the most frequent among the generated training tokens "
        f"(FR-Spec / EAGLE-3 style): {vocab_stats.get('train_coverage', 0):.1%} of the generated training "
        f"tokens and {report.get('heldout_vocab_coverage', 0):.1%} of the held-out greedy tokens are inside "
        f"it; the head is {dv} x {main_cfg.hidden_size} instead of {main_cfg.vocab_size} x "
        f"{main_cfg.hidden_size}"
    )


def _readme_intro(main_cfg, model_name: str, dv: int | None, vocab_stats: dict, report: dict, size_bytes: int) -> str:
    vocab_line = _draft_vocab_line(main_cfg, dv, vocab_stats, report)
    return f"""# MTP layer for {model_name}

A multi-token-prediction (MTP) layer distilled by `ember train-mtp` for a model that has none:
one decoder block of the model's shape in the DeepSeek-V3 layout
(`model.layers.{main_cfg.num_layers}.{{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head}}` + the block,
`config.json` architectures `{mtp_config(main_cfg, dv)["architectures"][0]}`, `num_nextn_predict_layers: 1`),
bf16, {size_bytes / 1e6:.1f} MB. Load it with `--speculative-model {{this folder}}` (method `mtp`) or
`ember.spec.mtp_weights.load_mtp(model, model_path, speculative_model=FOLDER)`.

Reduced draft vocabulary: {vocab_line}. The draft proposes only these tokens; the target model
verifies every draft, so output stays exactly the model's."""


def _readme_command(command: str, threads: int, steps: int) -> str:
    return f"""## Command

```
{command}
```

({threads} torch thread(s); {steps} optimizer steps.)"""


def _readme_data(cfg: TrainConfig, data_info: dict) -> str:
    return f"""## Data

The model's own generations (ember, batched) on prompts from the calibration half of CPython's
help topics (`ember.train.calibration.pydoc_split("calib")`): {data_info.get("train_sequences")} prompts,
chat requests through the model's chat template ("Explain ...", "Summarize ...", "Give an example
of ...", questions about the section title) and {data_info.get("train_raw_sequences")} raw-text continuations;
{data_info.get("train_greedy_sequences")} generated greedily, the others at temperature 0.7 / 0.8;
at most {cfg.max_new_tokens} new tokens each: {data_info.get("train_tokens")} tokens in all,
{data_info.get("train_generated_tokens")} generated. Targets: the frozen model's final-normed hidden
states and its next-token distribution (KL, weight {cfg.kl_weight}) plus the actual token
(cross-entropy, weight {cfg.ce_weight}); draft steps 1..{cfg.depth} trained (step weights
{list(cfg.depth_weights[: cfg.depth])}), the later ones recursing on the layer's own output.
AdamW, lr {cfg.lr}, cosine, {cfg.epochs} epoch(s), ~{cfg.batch_tokens} tokens per batch, float32
weights with {cfg.train_dtype} autocast, seed {cfg.seed}."""


def _readme_time(data_info: dict, train_seconds: float) -> str:
    return f"""## Time on this machine

- generation: {_fmt_time(data_info.get("generation_seconds", 0))} ({data_info.get("generation_threads", "?")} torch thread(s),
  {data_info.get("gen_batch", "?")} sequences at a time)
- teacher forward (hidden states): {_fmt_time(data_info.get("teacher_seconds", 0))}
- training: {_fmt_time(train_seconds)}"""


def _readme_acceptance(cfg: TrainConfig, report: dict) -> str:
    acc, cond = report["acceptance"], report["conditional"]
    rows = "\n".join(f"| {k + 1} | {acc[k]:.3f} | {cond[k]:.3f} |" for k in range(len(acc)))
    mal = ", ".join(f"k={k}: {1 + v:.2f}" for k, v in report["mean_accepted"].items())
    return f"""## Held-out acceptance

{cfg.eval_prompts} prompts built the same way from the held-out half (`pydoc_split("eval")`, never
trained on), generated greedily by the model: {report["positions"]} decode positions. At each, the
MTP drafts 3 tokens recursively (draft k+1 re-enters the layer with draft k and the layer's own
output); acceptance at position k = share of positions where drafts 1..k all equal the model's
greedy tokens (greedy speculative decoding accepts exactly those); conditional = given 1..k-1
accepted.

| position | acceptance | conditional |
|---|---|---|
{rows}

Mean tokens per verify step at temperature 0 (accepted drafts + 1): {mal}.
Temperature 0.8 ({cfg.eval_prompts} sampled held-out generations, {report["t08_positions"]} positions): the
expected acceptance of the greedy draft 1 (the target's probability of it) is
{report["t08_pos1_expected_acceptance"]:.3f}."""


# ---- the command -----------------------------------------------------------------------------------------


def _load_or_make_data(cfg: TrainConfig, model_path: str):
    """(data, main model, tokenizer): data.pt from the checkpoint dir when it was made with the same
    settings, else generated now (and saved there)."""
    from ember import LLM
    from ember.engine.startup.device import resolve_dtype
    from ember.loader.model_loader import load_model

    path = os.path.join(cfg.ckpt_dir, "data.pt")
    fp = cfg.data_fingerprint(model_path)
    if os.path.exists(path):
        st = torch.load(path, map_location="cpu", weights_only=False)
        if st.get("fingerprint") == fp:
            log.info("reusing the generated data in %s", path)
            dtype = resolve_dtype(cfg.engine_knobs.get("dtype", "auto"), torch.device("cpu"))
            loaded = load_model(
                model_path, None, dtype, torch.device("cpu"), "auto", cfg.engine_knobs.get("quantization", "auto")
            )
            return MTPData.from_state(st["data"]), loaded.model, loaded.tokenizer
        log.info("%s was made with other settings (%s); generating again", path, st.get("fingerprint"))
    knobs = {"max_num_seqs": cfg.gen_batch, "seed": cfg.seed, **cfg.engine_knobs}
    if cfg.threads:
        knobs.setdefault("num_threads", cfg.threads)
    llm = LLM(model_path, **knobs)
    loaded = llm.engine.parts.loaded
    data = make_data(
        llm,
        loaded.model,
        llm.tokenizer,
        cfg.num_prompts,
        cfg.max_new_tokens,
        cfg.seed,
        cfg.eval_prompts,
        progress=cfg.progress,
    )
    data.info.update(generation_threads=torch.get_num_threads(), gen_batch=cfg.gen_batch)
    main, tokenizer = loaded.model, llm.tokenizer
    del llm, loaded
    gc.collect()  # the engine's KV pool
    os.makedirs(cfg.ckpt_dir, exist_ok=True)
    torch.save({"fingerprint": fp, "data": data.state()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    return data, main, tokenizer


def train_mtp(cfg: TrainConfig, command: str | None = None) -> dict:
    """Generate (or reuse) data, train (or resume), evaluate, write cfg.out. Returns the report."""
    from ember.loader.model_loader import resolve_model_path

    if cfg.epochs < 1 or cfg.lr <= 0 or cfg.num_prompts < 1 or cfg.max_new_tokens < 1 or cfg.depth < 1:
        raise ConfigError("--epochs, --lr, --num-prompts, --max-new-tokens and --depth must be positive")
    if cfg.draft_vocab_size < 0:
        raise ConfigError("--draft-vocab-size must be >= 0 (0 = a full-vocabulary head)")
    if cfg.train_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--train-dtype {cfg.train_dtype!r} is not float32 or bfloat16")
    model_path = resolve_model_path(cfg.model)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    state = os.path.join(cfg.ckpt_dir, "state.pt")
    if cfg.resume and not os.path.exists(state):
        raise ConfigError(f"--resume: no checkpoint at {state}; run without --resume to start")
    data, main, _ = _load_or_make_data(cfg, model_path)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    draft_vocab = None
    if cfg.resume:
        draft_vocab = torch.load(state, map_location="cpu", weights_only=False)["draft_vocab"]
    trainer = MTPTrainer(main, data, cfg, draft_vocab)
    if cfg.resume:
        trainer.load_checkpoint(state)
    trainer.train()
    write_mtp_folder(trainer.mtp, main.cfg, cfg.out)
    # evaluate what was written, as the engine loads it (the model's dtype, bf16 weights)
    t0 = time.perf_counter()
    served = load_mtp(main, model_path, cfg.out, progress=False)
    report = evaluate_mtp(served, main, data, 3, cfg.batch_tokens, served.layers[0].draft_vocab)
    report["eval_seconds"] = time.perf_counter() - t0
    report["float32_master_acceptance"] = trainer.evaluate()["acceptance"]
    report.update(
        train_seconds=trainer.train_seconds,
        steps=trainer.step,
        data=data.info,
        draft_vocab=trainer.vocab_stats,
        dtype=str(main.dtype).removeprefix("torch."),
    )
    size = os.path.getsize(os.path.join(cfg.out, "model.safetensors"))
    model_name = os.path.basename(model_path)
    command = command or "ember train-mtp " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    readme = render_readme(
        cfg,
        main.cfg,
        model_name,
        command,
        data.info,
        trainer.vocab_stats,
        report,
        trainer.train_seconds,
        trainer.step,
        size,
        torch.get_num_threads(),
    )
    with open(os.path.join(cfg.out, "README.md"), "w") as f:
        f.write(readme)
    with open(os.path.join(cfg.ckpt_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    log.info(
        "held-out acceptance per position %s (conditional %s); wrote %s",
        [round(a, 3) for a in report["acceptance"]],
        [round(c, 3) for c in report["conditional"]],
        cfg.out,
    )
    return report
