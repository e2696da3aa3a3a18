"""`ember train-mtp [MODEL] --out DIR`: distil an MTP layer (a speculative-decoding draft head) for a
model that has none, from the model's own generations on offline prompts (CPython's help topics).

Writes DIR/config.json, DIR/model.safetensors (the MTP layer, DeepSeek-V3 layout, with a reduced
draft vocabulary) and DIR/README.md (command, data, time, held-out acceptance per draft position);
`--speculative-model DIR` loads it. Generated data and training state go to DIR/checkpoint (or
--checkpoint-dir): an interrupted run continues with --resume, and a run with the same data
settings reuses the generated data.
"""

from __future__ import annotations

import argparse
import shlex


def cmd_train_mtp(args) -> None:
    from ember.train.mtp import TrainConfig, train_mtp

    cfg = TrainConfig(
        model=args.model,
        out=args.out,
        checkpoint_dir=args.checkpoint_dir,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        eval_prompts=args.eval_prompts,
        epochs=args.epochs,
        lr=args.lr,
        draft_vocab_size=args.draft_vocab_size,
        depth=args.depth,
        batch_tokens=args.batch_tokens,
        seed=args.seed,
        train_dtype=args.train_dtype,
        threads=args.threads,
        gen_batch=args.gen_batch,
        save_every=args.save_every,
        resume=args.resume,
        max_steps=args.max_steps,
    )
    report = train_mtp(cfg, command=command_line(args))
    acc = ", ".join(f"{a:.3f}" for a in report["acceptance"])
    print(
        f"{args.out}: held-out greedy acceptance per draft position {acc}; "
        f"training {report['train_seconds'] / 60:.1f} min"
    )


def command_line(args) -> str:
    """The canonical command for these arguments: the model if given, then every option not at its default."""
    parser = args._train_mtp_parser
    words = ["ember", "train-mtp"] + ([args.model] if args.model else [])
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "model"):
            continue
        value = getattr(args, action.dest, None)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        words += [flag] if action.nargs == 0 else [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def add_train_mtp_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-mtp",
        help="distil an MTP draft layer for a model that has none",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="HF model folder or .gguf file (default: the embedded model)")
    p.add_argument("--out", required=True, help="folder to write (config.json, model.safetensors, README.md)")
    p.add_argument("--checkpoint-dir", default=None, help="generated data and training state (default: OUT/checkpoint)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint's saved step")
    p.add_argument("--num-prompts", type=int, default=1280, help="training prompts (each generated once)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt")
    p.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts for the acceptance report")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (cosine decay to 10%%)")
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=6144,
        help="tokens the draft may propose (most frequent first); 0 = the whole vocabulary",
    )
    p.add_argument(
        "--depth", type=int, default=1, help="draft steps trained (later ones recurse on the layer's output)"
    )
    p.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--train-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="compute dtype (autocast; weights and optimizer stay float32)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--gen-batch", type=int, default=32, help="sequences generated at once")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at each epoch end)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps (resumable)")
    p.set_defaults(func=cmd_train_mtp, _train_mtp_parser=p)
    return p
