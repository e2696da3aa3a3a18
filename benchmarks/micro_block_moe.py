"""One MoE layer of an `ember bench flash` file through `cpu_block_gemv.moe`, at several token counts and
dense_rows thresholds (min of 3 calls after one warm call; random routing, top-10 of 128).

    python benchmarks/micro_block_moe.py q4_k_m 384,2000 0,32

The crossover between block_moe's integer dots and its bf16 GEMMs (docs/tuning.md, "Prefill on AMX").
"""

import os
import sys
import time

import gguf
import torch

from ember.kernels import cpu_block_gemv


def main(kind: str, token_counts: str, thresholds: str) -> None:
    torch.set_num_threads(2)
    assert cpu_block_gemv.available()
    path = os.path.expanduser(f"~/.cache/ember/bench/qwen3.8-flash-shape-random.{kind}.gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = [f"blk.1.ffn_{n}_exps.weight" for n in ("gate", "up", "down")]
    weights = [torch.from_numpy(tensors[n].data) for n in names]
    qtypes = tuple(tensors[n].tensor_type for n in names)
    print(kind, [q.name for q in qtypes])
    torch.manual_seed(0)
    for tokens in (int(t) for t in token_counts.split(",")):
        x = torch.randn(tokens, weights[2].shape[1], dtype=torch.bfloat16)  # H: down's rows
        ids = torch.stack([torch.randperm(128)[:10] for _ in range(tokens)])
        wts = torch.softmax(torch.randn(tokens, 10), -1)
        row = []
        for rows in (int(r) for r in thresholds.split(",")):
            cpu_block_gemv.moe(x, ids, wts, *weights, qtypes, dense_rows=rows)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                cpu_block_gemv.moe(x, ids, wts, *weights, qtypes, dense_rows=rows)
                times.append(time.perf_counter() - start)
            row.append(f"dense_rows {rows}: {min(times) * 1e3:.1f} ms")
        print(f"{tokens} tokens ({tokens * 10 / 128:.0f} slots an expert) | " + "; ".join(row))


if __name__ == "__main__":
    main(*sys.argv[1:4])
