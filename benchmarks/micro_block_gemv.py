"""Micro-benchmark of the block GEMV over a GGUF file's own blocks (ember.kernels.cpu_block_gemv).

A 4096 x 4096 weight of each type (random valid blocks: random bytes, finite float16 scales) against
M = 1 and M = 16 rows of float32 x, THREADS threads (default 2): milliseconds (median of REPS alternating
passes) and the weight's bytes per second, the figure a decode step's GEMV is bound by. For context, the
same rows against the tiled GEMV's Q4_K (TiledPart, the dense layers' path) and a float32 GEMV (torch's,
64 MiB of weight: what this machine's memory delivers to a GEMV). Under a minute on 2 cores.

    PYTHONPATH=. .venv/bin/python benchmarks/micro_block_gemv.py            # THREADS=2 REPS=15
"""

import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from ember.kernels import cpu_block_gemv as bg

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
REPS = int(os.environ.get("REPS", 15))
N = K = 4096
TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.IQ4_NL, T.IQ4_XS, T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS,
         T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M, T.Q4_0]  # fmt: skip
# where each type keeps its float16 scales (byte offsets in a block); IQ1_M's scale is spread over its
# scale words' top nibbles and stays as random bytes give it (finite where its exponent bits allow)
F16_AT = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q6_K: (208,), T.IQ1_M: ()}


def random_blocks(qtype: T, rows: int, cols: int, rng) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in F16_AT.get(qtype, (0, 2) if qtype in (T.Q4_K, T.Q5_K, T.Q4_1, T.Q5_1) else (0,)):
        d = (rng.standard_normal(b.shape[:2]) * 1e-3).astype(np.float16)
        b[:, :, at : at + 2] = d.view(np.uint8).reshape(*b.shape[:2], 2)
    return b.reshape(rows, -1)


def median_ms(f) -> float:
    f()
    times = []
    for _ in range(REPS):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def tiled_q4k(raw: np.ndarray):
    from ember.quant.gguf_blocks import GGUFTensor
    from ember.quant.gguf_quant import pack_shards

    (part,) = pack_shards([GGUFTensor(T.Q4_K, raw, (N, K))], torch.float32, "cpu")
    return part


def main() -> None:
    assert bg.available(), "the block kernel did not build"
    rng = np.random.default_rng(0)
    print(f"{N}x{K}, {torch.get_num_threads()} threads, float32 x; ms (GB/s of weight read)")
    print(f"{'type':10s} {'B/weight':>8s} {'M=1':>16s} {'M=16':>16s}")
    for qtype in dict.fromkeys(TYPES):
        if not bg.supports(qtype):
            continue
        raw = random_blocks(qtype, N, K, rng)
        w = torch.from_numpy(raw)
        cells = []
        for M in (1, 16):
            x = torch.randn(M, K)
            ms = median_ms(lambda: bg.gemm(x, w, qtype))
            cells.append(f"{ms:7.3f} ({raw.nbytes / ms / 1e6:5.1f})")
        print(f"{qtype.name:10s} {raw.nbytes / N / K:8.3f} {cells[0]:>16s} {cells[1]:>16s}")
        if qtype == T.Q4_K:
            part = tiled_q4k(raw)
            cells = []
            for M in (1, 16):
                x = torch.randn(M, K)
                ms = median_ms(lambda: part.linear(x))
                cells.append(f"{ms:7.3f} ({raw.nbytes / ms / 1e6:5.1f})")
            print(f"{'Q4_K tiled':10s} {'':8s} {cells[0]:>16s} {cells[1]:>16s}")
    dense = torch.randn(N, K)
    cells = []
    for M in (1, 16):
        x = torch.randn(M, K)
        ms = median_ms(lambda: F.linear(x, dense))
        cells.append(f"{ms:7.3f} ({dense.numel() * 4 / ms / 1e6:5.1f})")
    print(f"{'F32 dense':10s} {4.0:8.3f} {cells[0]:>16s} {cells[1]:>16s}")


def experts(qtypes: tuple, E: int, H: int, I: int, rng, kernels=None):
    """A GGUFExperts layer of random blocks (gate, up, down types), loaded as the loader hands 3-D tensors out."""
    from ember.kernels.cpu_kernels import CpuKernels
    from ember.quant.gguf_blocks import GGUFTensor
    from ember.quant.gguf_quant import GGUFExperts

    layer = GGUFExperts(E, H, I, torch.float32, kernels=kernels or CpuKernels())
    for kind, qtype, (rows, cols) in zip(("gate", "up", "down"), qtypes, ((I, H), (I, H), (H, I))):
        stacked = GGUFTensor(qtype, random_blocks(qtype, E * rows, cols, rng), (E * rows, cols))
        for e in range(E):
            layer.load_weight(f"{e}.{kind}_proj.weight", stacked.narrow(0, e * rows, rows))
    layer.pack()
    return layer


def moe_rows() -> None:
    """One MoE layer (64 experts of H 2048, I 768, top-8): block_moe over the stacked blocks against the
    grouped path over per-expert parts (what Q4_K experts take: TiledPart / TiledQ6KPart, one Python call per
    chosen expert), for 1 and 16 tokens; GB/s of the chosen experts' bytes."""
    E, H, I, k = 64, 2048, 768, 8
    rng = np.random.default_rng(1)
    print(f"MoE layer: {E} experts, H {H}, I {I}, top-{k}; ms (GB/s of the chosen experts' blocks)")
    for qtypes in ((T.Q4_K, T.Q4_K, T.Q6_K), (T.Q2_K, T.Q2_K, T.Q3_K)):
        layer = experts(qtypes, E, H, I, rng)
        grouped = None
        if layer.block is None:  # Q4_K / Q6_K: the tiled parts; the same blocks through block_moe beside them
            grouped = layer
            blocks = [torch.from_numpy(random_blocks(q, E * r, c, rng)).view(E, r, -1)
                      for q, (r, c) in zip(qtypes, ((I, H), (I, H), (H, I)))]  # fmt: skip
        else:
            blocks = list(layer.block)
        per_expert = sum(b[0].numel() for b in blocks)
        cells = []
        for T_ in (1, 16):
            x = torch.randn(T_, H)
            ids = torch.stack([torch.randperm(E)[:k] for _ in range(T_)])
            wts = torch.rand(T_, k)
            chosen = len(set(ids.flatten().tolist())) * per_expert
            ms = median_ms(lambda: bg.moe(x, ids, wts, *blocks, qtypes))
            cells.append(f"{ms:7.3f} ({chosen / ms / 1e6:5.1f})")
            if grouped is not None:
                ms = median_ms(lambda: grouped(x, ids, wts))
                cells.append(f"grouped {ms:7.3f} ({chosen / ms / 1e6:5.1f})")
        print("  " + "/".join(q.name for q in qtypes) + ": T=1 " + "  ".join(cells[: len(cells) // 2]))
        print("  " + " " * len("/".join(q.name for q in qtypes)) + "  T=16 " + "  ".join(cells[len(cells) // 2 :]))


if __name__ == "__main__":
    main()
    moe_rows()
