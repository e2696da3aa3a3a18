"""A "side" of `ember bench compare | hybrid | matrix | restart`: one engine under test, behind one small interface.

decode(prompt_ids, n) -> arrival time of each of n greedy tokens (EOS ignored)
ttft(prompt_ids)      -> seconds to the first token
batch(prompts, n)     -> (seconds, generated tokens) for all prompts, n tokens each
description           -> what ran (a dict for the report); weight_bytes (ember only)

ember is wrapped in ember.py; the peers (bench/peers/: llama.cpp, transformers) already have this
shape. A side is built from a factory path "module:callable" plus keyword arguments, so the same
recipe builds it in this process (local.py) or in a worker process (worker.py), and a test can swap
a peer for a fake by path. Nothing heavy is imported at module level: worker processes import these
modules before they know which engine they will build.
"""
