"""The peers ember is measured against, each a side (bench/sides/) in a module of its own: llama.cpp through
llama-cpp-python (llamacpp.py; its batch API, llamacpp_batch.py; its HF -> GGUF converter,
llamacpp_convert.py) and Hugging Face transformers (hf.py).

PEERS maps a --peer name to the factory path that builds it (a test swaps in a fake by path).
"""

PEERS = {"llamacpp": "ember.bench.peers.llamacpp:LlamaCppPeer", "hf": "ember.bench.peers.hf:HFPeer"}
PEER_NAMES = {"llamacpp": "llama.cpp", "hf": "transformers"}
