"""How a step's forward runs: eager (base.py), compiled graphs on CPU (compiled.py, built in the
background by background_compile.py, kept across processes by compile_cache.py and aot_package.py),
CUDA graphs (cuda_graph.py)."""
