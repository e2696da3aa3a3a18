"""GGUF weights kept packed (placeholder: dequantized until the packed methods land)."""
from __future__ import annotations

from ember.quant import QuantConfig


class GGUFConfig(QuantConfig):
    name = "gguf"
