"""`ember quantize MODEL --method awq|rtn --bits 4 --group-size G --zero-point --calib pydoc|FILE
--num-samples N --seq-len L --out DIR`: an AutoAWQ-compatible int4 folder from full-precision weights.

The job itself, and what each method does, is ember.train.quantize.
"""

from __future__ import annotations

import argparse

from ember.train import quantize as job
from ember.train.quantize import GPTQ_DEFAULT, METHODS, quantize


def cmd_quantize(args) -> None:
    quantize(
        args.model,
        args.out,
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        zero_point=args.zero_point,
        calib=args.calib,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        clip=args.clip,
        gptq=args.gptq,
    )
    print(args.out)


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quantize",
        help="quantize a model to an AutoAWQ int4 folder (AWQ search or round-to-nearest)",
        description=job.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="HF model folder or .gguf file (default: the embedded model)")
    p.add_argument("--out", required=True, help="folder to write (must be new or empty)")
    p.add_argument(
        "--method", choices=METHODS, default="awq", help="awq: activation-aware search; rtn: round-to-nearest"
    )
    p.add_argument("--bits", type=int, default=4, help="weight bits (only 4)")
    p.add_argument(
        "--group-size", type=int, default=128, help="input channels per scale/zero (must divide every in_features)"
    )
    p.add_argument(
        "--zero-point",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="asymmetric quantization with zero points (required)",
    )
    p.add_argument(
        "--calib", default="pydoc", help="'pydoc' (the calibration half of pydoc_data.topics) or a UTF-8 text file"
    )
    p.add_argument("--num-samples", type=int, default=128, help="calibration blocks")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration block")
    p.add_argument(
        "--clip",
        choices=("asym", "sym"),
        default="asym",
        help="AWQ clipping search: asym (default) searches each group's lower and upper clip separately "
        "and snaps the integer zero point; sym is AutoAWQ's (one |w| bound for both ends)",
    )
    p.add_argument(
        "--gptq",
        action=argparse.BooleanOptionalAction,
        default=GPTQ_DEFAULT,
        help="AWQ: choose the int4 codes on each group's grid by GPTQ's error-compensating rounding "
        "(calibration inputs' X^T X) instead of round-to-nearest; same checkpoint format",
    )
    p.set_defaults(func=cmd_quantize)
    return p
