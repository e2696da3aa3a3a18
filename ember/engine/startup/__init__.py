"""Rank 0's engine start-up (start.py): device, weights, limits, KV pool, built once into EngineParts."""

from ember.engine.startup.start import EngineParts, start_engine

__all__ = ["EngineParts", "start_engine"]
