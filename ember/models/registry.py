"""HF "architectures" name -> model class, from the one architecture table
(ember.config.architectures: a new model is its file plus one row there)."""

from __future__ import annotations

import importlib

from ember.config.architectures import architecture


def get_model_class(name: str) -> type:
    module, cls = architecture(name).model.split(":")
    return getattr(importlib.import_module(module), cls)
