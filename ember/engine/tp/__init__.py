"""Tensor parallelism's processes: the group rank 0 drives (group.py), the workers (worker.py), the
model mirrored to them (mirror.py), and what TP refuses (config.py)."""
