"""Batched greedy generation on llama.cpp's own batch API, for the llama.cpp peer's throughput.

llama-cpp-python's Llama.generate() runs one sequence; llama.cpp itself decodes many sequences in
one llama_decode call (llama-server's parallel slots). This drives that API through the
bindings: a context of its own on the peer's loaded model (same threads, flash attention), one
sequence id per prompt over a unified KV cache; prompts prefilled in n_batch-token batches
(logits only at each prompt's last token), then one batch per step holding every sequence's
newest token. Greedy = argmax of the logits, as ember's temperature 0. Only the generation is
timed: a server allocates its context once, up front.
"""

from __future__ import annotations

import time


def parallel_generate(
    llm, prompts: list[list[int]], output_len: int, n_batch: int = 512
) -> tuple[float, list[list[int]]]:
    """(seconds, output_len token ids per prompt) for `llm`, a llama_cpp.Llama."""
    import llama_cpp
    import numpy as np
    from llama_cpp import _internals

    n = len(prompts)
    params = llama_cpp.llama_context_default_params()
    for name, _ in params._fields_:  # the peer's own settings (threads, flash attention, ...), then ours
        setattr(params, name, getattr(llm.context_params, name))
    params.n_ctx = sum(len(p) + output_len for p in prompts) + 256
    params.n_seq_max, params.kv_unified = n, True
    params.n_batch = params.n_ubatch = n_batch
    ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
    batch = llama_cpp.llama_batch_init(max(n_batch, n), 0, 1)
    n_vocab = llm.n_vocab()

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode over (token, position, sequence, wants logits); argmax per logits row."""
        batch.n_tokens = len(entries)
        for j, (tok, pos, seq, want) in enumerate(entries):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, pos, 1, want
            batch.seq_id[j][0] = seq
        rc = llama_cpp.llama_decode(ctx.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (KV cache full?)")
        return [
            int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, j), shape=(n_vocab,))))
            for j, e in enumerate(entries)
            if e[3]
        ]

    try:
        t0 = time.perf_counter()
        outs: list[list[int]] = [[] for _ in prompts]
        pending: list[tuple[int, int, int, bool]] = []
        for seq, prompt in enumerate(prompts):
            for i, tok in enumerate(prompt):
                pending.append((tok, i, seq, i == len(prompt) - 1))
                if len(pending) == n_batch or (seq == n - 1 and i == len(prompt) - 1):
                    owners = [e[2] for e in pending if e[3]]
                    for s, t in zip(owners, decode(pending)):
                        outs[s].append(t)
                    pending = []
        for step in range(1, output_len):
            for s, t in enumerate(decode([(outs[s][-1], len(prompts[s]) + step - 1, s, True) for s in range(n)])):
                outs[s].append(t)
        return time.perf_counter() - t0, outs
    finally:
        llama_cpp.llama_batch_free(batch)
        ctx.close()
