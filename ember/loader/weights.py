"""Iterate (name, tensor) over a Hugging Face safetensors checkpoint, single file or sharded.

Every file's header is opened and checked before the first tensor is yielded, so a missing or
truncated shard fails fast with a ModelLoadError that names the file, not halfway through
loading with safetensors' own error.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from ember.errors import ModelLoadError
from ember.loader.mapped_safetensors import MappedSafetensors

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's .safetensors files, in load order; raises ModelLoadError if any is missing."""
    if os.path.isfile(folder) and folder.endswith(".safetensors"):
        return [folder]
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({e!r}); download it again") from None
        files = sorted(set(weight_map.values()))
        missing = [n for n in files if not os.path.exists(os.path.join(folder, n))]
        if missing:
            raise ModelLoadError(
                f"{folder} is missing shard file(s) {', '.join(missing)} listed in {INDEX_FILE}; "
                "download the complete model"
            )
        return [os.path.join(folder, n) for n in files]
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{folder} has no .safetensors weights; give a Hugging Face model folder or a .gguf file")
    return files


def _open(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        raise ModelLoadError(
            f"{path} ({size} bytes) is not a readable safetensors file: {e}. "
            "It is probably truncated or corrupt; download it again"
        ) from None


def iter_safetensors(
    folder: str, progress: bool = True, mapped: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, CPU tensor) for every tensor of the model in `folder`. A name `mapped`
    picks comes as a view of the file's mapping, read by the rows touched (ember.loader.mapped_safetensors);
    every other tensor is read whole."""
    files = safetensors_files(folder)
    with contextlib.ExitStack() as stack:
        handles = [(path, stack.enter_context(_open(path))) for path in files]
        total = sum(len(h.keys()) for _, h in handles)
        # disable=None: tqdm shows the bar on a terminal and stays silent in logs and CI.
        bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=None if progress else True)
        with bar:
            for path, h in handles:
                mapping = None
                for name in h.keys():
                    try:
                        if mapped is not None and mapped(name):
                            mapping = mapping or MappedSafetensors(path)
                            tensor = mapping.get(name)
                        else:
                            tensor = h.get_tensor(name)
                    except (SafetensorError, OSError, ValueError) as e:
                        raise ModelLoadError(
                            f"{path}: cannot read tensor {name!r} ({e}); download the file again"
                        ) from None
                    yield name, tensor
                    bar.update(1)
