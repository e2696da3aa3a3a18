"""qwen4_exp against transformers over configs the tests do not use (issue 54's hidden parity check, run
here): for each config a tiny random model built by transformers, three prompts (400 tokens with EOS
tokens inside and at the start, so QSA drops blocks; 23 tokens, dense; 97 tokens ending in EOS), prefilled
whole and in 13-token chunks, batched; greedy tokens must equal transformers' and the first token's top-5
logprobs be within 1e-4. Prints one line per config and exits 1 if any differs.

    python benchmarks/qwen4exp_parity_sweep.py            # every config
    python benchmarks/qwen4exp_parity_sweep.py 3 7        # configs 3 and 7
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ember import LLM, SamplingParams  # noqa: E402
from tests.models.tiny_models import hf_greedy  # noqa: E402
from tests.models.tiny_qwen4 import build_qwen4, prompt, save_qwen4  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
CONFIGS = [
    dict(),
    dict(hc_count=2, hc_lowrank=8),
    dict(hc_count=3, hc_lowrank=24, hidden_size=48, head_dim=16, num_attention_heads=6, num_key_value_heads=3),
    dict(ngram_size=4, heads_per_ngram=1, ple_conv_kernel_size=2, ple_embed_dim=48),
    dict(ngram_size=2, heads_per_ngram=4, ple_conv_kernel_size=3, ple_embed_dim=32),
    dict(ple_embed_dim=96, heads_per_ngram=3),
    dict(indexer_n_heads=3, indexer_head_dim=8, indexer_budget=24, indexer_compress_ratio=8),
    dict(indexer_budget=16, indexer_compress_ratio=2),
    dict(indexer_budget=128, indexer_compress_ratio=16),
    dict(num_experts=16, num_experts_per_tok=3, norm_topk_prob=False),
    dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=24, shared_expert_intermediate_size=8),
    dict(eos_token_id=[1, 7]),
    dict(tie_word_embeddings=True),
    dict(
        num_hidden_layers=5,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        ple_layer_ids=[2, 5],
    ),
    dict(
        num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"], ple_layer_ids=[1]
    ),
    dict(layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"]),
    dict(linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=8, linear_value_head_dim=24),
    dict(hidden_size=40, head_dim=24, num_attention_heads=5, num_key_value_heads=1, hc_lowrank=5, ple_embed_dim=40),
    dict(rope_parameters=ROPE | {"mrope_section": [4, 2, 2], "mrope_interleaved": True}),
    dict(linear_conv_kernel_dim=2, make_ngram_vocab_size_divisible_by=1, ngram_vocab_size_base=37),
]


def check(i: int, overrides: dict) -> list:
    hf = build_qwen4(seed=i, **overrides)
    path = save_qwen4(hf, tempfile.mkdtemp(prefix=f"qwen4-sweep-{i}-"))
    prompts = [prompt(400, 10 + i, eos_at=(0, 30, 31, 100)), prompt(23, 20 + i), prompt(97, 30 + i, eos_at=(96,))]
    refs = [hf_greedy(hf, p, 6) for p in prompts]
    bad = []
    for chunk in (512, 13):
        llm = LLM(path, dtype="float32", executor="eager", max_model_len=512, kv_cache_memory=0.05, max_num_seqs=4,
                  max_num_batched_tokens=chunk)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, ref, out in zip(prompts, refs, outs):
            out = out.outputs[0]
            with torch.inference_mode():
                theirs = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), -1)
            diff = max(abs(lp.logprob - theirs[t].item()) for t, lp in out.logprobs[0].items())
            if out.token_ids != ref or diff > 1e-4:
                bad.append((chunk, len(p), out.token_ids, ref, f"{diff:.1e}"))
    return bad


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    failed = 0
    for i in [int(a) for a in argv] or range(len(CONFIGS)):
        bad = check(i, CONFIGS[i])
        failed += bool(bad)
        print(f"{i:2d} {CONFIGS[i]}: {'identical' if not bad else f'DIFFERS {bad}'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
