"""The peer: Hugging Face transformers running the same weights, measured the way ember is.

transformers is not an engine dependency, so it is imported only when a peer is asked for.
A .gguf file is dequantized by transformers on load (to bfloat16 by default), so both sides
run the same numbers; a model folder loads as it is.

How each figure is taken (the method strings below go into the results file):
- decode: `generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)` with a streamer that
  timestamps every new token; the same per-token times ember's step loop gives, so both sides'
  decode figures come from the same formulas (see lib/timing.py) and exclude prefill (TTFT).
- TTFT: one forward over the prompt that builds the KV cache (`use_cache=True`), logits for the
  last position only (`logits_to_keep=1`), then argmax: the least a transformers user pays for
  the first token, with no generate() bookkeeping.
- batched: one `generate` call on all prompts as a single left-padded batch (pad = EOS),
  `min_new_tokens = max_new_tokens` so every row produces exactly output_len tokens.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ember.errors import ConfigError

logger = logging.getLogger("ember.bench")

DECODE_METHOD = (
    "transformers decode: generate(min_new_tokens=max_new_tokens=N, greedy) with a streamer that timestamps each token"
)
TTFT_METHOD = "transformers TTFT: one forward over the prompt (use_cache=True, logits_to_keep=1) + argmax"
BATCH_METHOD = (
    "transformers batched: one generate() over all prompts as a left-padded batch, min_new_tokens=max_new_tokens"
)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "the transformers peer needs transformers: `pip install transformers accelerate`, "
            "or run without a peer with --peer none"
        ) from None
    return transformers


class _TokenClock:
    """A generate() streamer that notes when each new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFPeer:
    def __init__(self, model_path: str, dtype: str = "bfloat16"):
        transformers = _import_transformers()
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()  # generation-config chatter, not results
        t0 = time.perf_counter()
        kw = {"dtype": _DTYPES[dtype]}
        if os.path.isfile(model_path) and model_path.endswith(".gguf"):
            try:
                import accelerate  # noqa: F401  (transformers needs it to load a GGUF file)
            except ImportError:
                raise ConfigError(
                    "transformers needs accelerate to load a GGUF file: `pip install transformers "
                    "accelerate`, or run without a peer with --peer none"
                ) from None
            folder, kw["gguf_file"] = os.path.dirname(os.path.abspath(model_path)), os.path.basename(model_path)
        else:
            folder = model_path
        self.model = AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
        cfg = self.model.config
        eos = (
            self.model.generation_config.eos_token_id
            if self.model.generation_config.eos_token_id is not None
            else cfg.eos_token_id
        )
        self.pad_id = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
        self.description = {
            "name": "transformers",
            "version": transformers.__version__,
            "model": os.path.basename(model_path.rstrip("/"))
            + (" (dequantized by transformers)" if "gguf_file" in kw else ""),
            "dtype": dtype,
            "attention": getattr(cfg, "_attn_implementation", None) or "default",
            "threads": torch.get_num_threads(),
        }
        logger.info(
            "bench: transformers %s loaded %s as %s in %.1fs",
            transformers.__version__,
            model_path,
            dtype,
            time.perf_counter() - t0,
        )

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int, streamer=None) -> torch.Tensor:
        return self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=self.pad_id,
            streamer=streamer,
            temperature=None,
            top_p=None,
            top_k=None,
        )

    def decode(self, prompt: list[int], n: int) -> list[float]:
        """Batch-1 greedy decode of n tokens; the perf_counter time each token arrived."""
        ids = torch.tensor([prompt])
        clock = _TokenClock()
        out = self._generate(ids, torch.ones_like(ids), n, streamer=clock)
        assert out.shape[1] - ids.shape[1] == n == len(clock.times), "transformers stopped early"
        return clock.times

    @torch.inference_mode()
    def ttft(self, prompt: list[int]) -> float:
        """Seconds from a prompt to its first greedy token."""
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1).logits
        int(logits[0, -1].argmax())
        return time.perf_counter() - t0

    def batch(self, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
        """One generate() over all prompts; returns (seconds, generated tokens)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token lines up
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        t0 = time.perf_counter()
        out = self._generate(ids, mask, output_len)
        seconds = time.perf_counter() - t0
        generated = out.shape[1] - width
        assert generated == output_len, f"transformers generated {generated} tokens, wanted {output_len}"
        return seconds, generated * len(prompts)
