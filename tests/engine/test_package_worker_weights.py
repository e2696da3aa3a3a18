"""A package worker loads its model for the shapes only (ember.loader.shapes_only): each weight's pages
go back to the kernel as the load is done with them, and the model is built the same. That the packages
built from such a model serve exactly the eager engine's tokens is checked where a guest worker builds
one: tests/engine/test_compile_cache.py (test_ember_compile_fills_the_cache_that_a_later_process_loads)."""

from __future__ import annotations

import os

import pytest
import torch

from ember.loader.model_loader import load_model
from ember.loader.shapes_only import release_tensor_pages, tensors_held

PAGE = 4096


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_released_pages_leave_the_resident_set_and_read_zeros():
    t = torch.ones(64 << 20, dtype=torch.uint8)
    before = _rss_bytes()
    assert release_tensor_pages(t) >= (64 << 20) - 2 * PAGE
    assert before - _rss_bytes() > 60 << 20
    assert int(t[PAGE:-PAGE].sum()) == 0
    t.fill_(2)  # the memory is the tensor's still: written again, it holds what was written
    assert int(t.sum()) == 2 * t.numel()


def test_only_whole_pages_inside_the_tensor_are_released():
    """A view that starts and ends inside pages: the bytes around it, its neighbours', keep their values."""
    base = torch.full((8 * PAGE,), 7, dtype=torch.uint8)
    offset = (-base.data_ptr()) % PAGE + PAGE + 100  # 100 bytes into a page
    view = base[offset : offset + 3 * PAGE]
    assert release_tensor_pages(view) == 2 * PAGE  # the two whole pages inside; the partial ones stay
    assert bool((base[:offset] == 7).all()) and bool((base[offset + 3 * PAGE :] == 7).all())
    assert int((view == 0).sum()) == 2 * PAGE
    strided = base[::2]  # a strided view spans every page it steps over: released whole pages only
    assert release_tensor_pages(strided) % PAGE == 0


def _layout(model: torch.nn.Module) -> list:
    return [
        (path, type(m).__name__, tuple(t.shape), t.dtype, t.stride())
        for path, m in model.named_modules()
        for t in tensors_held(m)
    ]


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_a_shapes_only_load_builds_the_same_model_and_keeps_no_weight_resident(tiny_model_dir, tmp_path, fmt):
    """safetensors: dense layers (no repack hook); GGUF: a hybrid's q8_0 and f32 tensors written by llama.cpp's
    converter, packed by the GGUF methods' hooks."""
    path = tiny_model_dir("qwen3")
    if fmt == "gguf":
        from ember.bench.peers.llamacpp_convert import convert
        from tests.loader.test_gguf_hybrid import hf_folder

        _, folder = hf_folder(str(tmp_path), "qwen3_5", hidden_size=64)
        path = convert(folder, folder + ".q8.gguf", "q8_0", ("--no-mtp",))
    kw = dict(dtype=torch.float32, device=torch.device("cpu"))
    full = load_model(path, None, **kw)
    shapes = load_model(path, None, **kw, shapes_only=True)
    assert _layout(shapes.model) == _layout(full.model)  # modules, parts, shapes, dtypes, strides
    assert shapes.weight_bytes == full.weight_bytes
    for m in shapes.model.modules():  # every weight reads zeros but its first and last partial pages
        for t in tensors_held(m):
            kept = 2 * PAGE // t.element_size()
            assert int((t != 0).sum()) <= kept, (type(m).__name__, tuple(t.shape))
