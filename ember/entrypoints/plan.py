"""`ember plan MODEL_OR_CONFIG`: the memory arithmetic of ember.planner as a table (or --json)."""
from __future__ import annotations

import argparse
import json

from ember.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATION_CHOICES


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="memory plan: weights, KV bytes per token, the longest context and concurrency that fit",
                       description="Plan memory for a model without loading it. MODEL: a config.json, a Hugging Face "
                                   "folder (config.json alone is enough), a .gguf file, or nothing for the default model.")
    p.add_argument("model", nargs="?", default=None, help="config.json, model folder or .gguf (default: the embedded model)")
    p.add_argument("--memory", type=float, default=None,
                   help="GiB of device memory (default: the CUDA device's, or available RAM with --device cpu)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                   help="auto = what the checkpoint holds; awq / none plan a what-if for any config")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="per-device figures for N devices")
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="> 0 counts the config's MTP layers")
    p.add_argument("--speculative-model", default=None, metavar="DIR",
                   help="with --num-speculative-tokens: count this separate MTP folder's layers instead")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto = bfloat16 on CUDA (CPU: as the engine picks)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda adds the CUDA reserve (default)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default 64 on CUDA, 16 on CPU")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> None:
    from ember.planner import format_plan, plan

    result = plan(args.model, memory_gib=args.memory, max_model_len=args.max_model_len,
                  kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                  tensor_parallel_size=args.tensor_parallel_size, num_speculative_tokens=args.num_speculative_tokens,
                  dtype=args.dtype, device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
                  speculative_model=args.speculative_model)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
