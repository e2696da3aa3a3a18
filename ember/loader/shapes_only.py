"""A model loaded for its shapes only: every weight's pages are given back to the kernel once loaded.

A package worker (ember.engine.startup.package_worker) starts the engine its parent serves so that it
traces the same graph: the same modules, quant parts, dtypes, shapes and strides. Export and inductor's
lowering read none of the weights' values (they are the graph's inputs; a package binds the serving
model's own tensors when it loads, ember.engine.executor.aot_package), yet a worker that loaded them
held a second copy of the model beside its parent: 1,436 of its 2,414 MiB for the hybrid bench's bf16
file (benchmarks/startup.md). So a worker loads as the engine does, and hands each tensor's whole pages
back (madvise MADV_DONTNEED) as soon as the load is done writing it:

- a checkpoint tensor as it is handed to the model (a staging copy: the model copies or packs it);
- a module without a repack hook (a dense layer, a norm, an embedding) when the load moves on from its
  layer: a checkpoint lists a layer's tensors together (a layer met again later is given back again);
- a module with one (quant.process_weights_after_loading) right after its hook;
- everything the model holds, once more at the end (a tied head, a copy taken after the load).

The tensors then read as zeros (anonymous pages) or as their file's bytes (a map's pages), and a read
maps the kernel's shared zero page, not new memory: the worker's check-run of a package costs nothing
either. So the load computes on zeros, which is only sound because no value decides a graph's structure:
a quant method packs by type and shape, never by value (tests/engine/test_compile_cache.py checks that a
package a guest worker built from such a model serves the eager engine's tokens;
tests/engine/test_package_worker_weights.py that the model is built the same). Graphs that
fold the weights into their code (freezing) are never built from such a model
(ember.engine.startup.weights.builds_packages_only).
"""

from __future__ import annotations

import ctypes
import mmap
import re
from collections.abc import Iterable, Iterator

import torch

_LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")  # "model.layers.12.mlp.up_proj.weight" -> "model.layers.12"
_MADV_DONTNEED = 4  # Linux
_madvise = None


def release_tensor_pages(t: torch.Tensor) -> int:
    """Give back the whole pages inside t's bytes (never a page it shares with other data); returns the
    bytes given back. t then reads zeros there (its file's bytes, for a view of a file map)."""
    global _madvise
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse or t.numel() == 0:
        return 0
    if any(s < 0 for s in t.stride()):
        return 0
    start = t.data_ptr()
    end = start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo:
        return 0
    if _madvise is None:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return hi - lo if _madvise(lo, hi - lo, _MADV_DONTNEED) == 0 else 0


def tensors_held(module: torch.nn.Module, depth: int = 3) -> Iterator[torch.Tensor]:
    """The tensors `module` itself holds (not its child modules'): its parameters and buffers, and those in
    plain objects, lists, tuples and dicts among its attributes (a quant method's packed parts)."""
    yield from (t for t in module._parameters.values() if t is not None)
    yield from (t for t in module._buffers.values() if t is not None)
    seen: set[int] = set()

    def visit(value, left: int) -> Iterator[torch.Tensor]:
        if id(value) in seen or isinstance(value, (torch.nn.Module, type)):
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield value
        elif left == 0:
            return
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from visit(item, left - 1)
        elif isinstance(value, dict):
            for item in value.values():
                yield from visit(item, left - 1)
        elif hasattr(value, "__dict__"):
            for item in vars(value).values():
                yield from visit(item, left - 1)

    for name, value in vars(module).items():
        if not name.startswith("_"):
            yield from visit(value, depth)


def release_module_pages(module: torch.nn.Module) -> int:
    """release_tensor_pages over every tensor of `module` and its children; returns the bytes given back."""
    return sum(release_tensor_pages(t) for m in module.modules() for t in tensors_held(m))


class ShapesOnlyLoad:
    """Gives back a model's pages as its load goes (the module docstring says when): stream() wraps the
    checkpoint's (name, tensor) pairs, after_hook follows each repack hook, finish() ends the load."""

    def __init__(self, net: torch.nn.Module):
        self.net = net
        self.layers: dict[str | None, list[torch.nn.Module]] = {}  # layer path (None: outside layers) -> modules
        for path, module in net.named_modules():
            if getattr(getattr(module, "quant_method", None), "process_weights_after_loading", None) is None:
                m = _LAYER.match(path + ".")
                self.layers.setdefault(m[1] if m else None, []).append(module)

    def stream(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        current = object()
        for name, tensor in weights:
            m = _LAYER.match(name)
            if (m[1] if m else None) != current:
                self._release_layer(current)
                current = m[1] if m else None
            release_tensor_pages(tensor)  # a packed GGUF tensor is a view of the file's map: left to the pack
            yield name, tensor
        self._release_layer(current)

    def _release_layer(self, layer) -> None:
        for module in self.layers.get(layer, ()):
            for t in tensors_held(module):
                release_tensor_pages(t)

    @staticmethod
    def after_hook(module: torch.nn.Module) -> None:
        for t in tensors_held(module):
            release_tensor_pages(t)

    def finish(self) -> int:
        return release_module_pages(self.net)
