"""The engine's configuration: the flat flags (EngineConfig) and the sub-configs built from them.

A leaf package: it imports nothing from the engine, the kernels, quantization, speculation or
distributed code (tests/test_package_graph.py keeps it so), so `import ember` stays light and
any layer may read a config.
"""

from ember.config.engine_config import EngineConfig
from ember.config.groups import (
    ATTENTION_BACKENDS,
    COMPILE_DEFAULTS,
    CPU_DENSE_COPY_FRACTION,
    CPU_KV_CAP_GIB,
    CPU_KV_FRACTION,
    DEVICES,
    EXECUTORS,
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    CacheConfig,
    ExecutorConfig,
    KernelConfig,
    LoadConfig,
    ParallelConfig,
    PlacementConfig,
    SchedulerConfig,
)
from ember.config.speculative import SpeculativeConfig
from ember.platform import DTYPES, available_ram_bytes, cpu_has_avx512_bf16

__all__ = [
    "EngineConfig",
    "LoadConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ExecutorConfig",
    "KernelConfig",
    "ParallelConfig",
    "PlacementConfig",
    "SpeculativeConfig",
    "ATTENTION_BACKENDS",
    "COMPILE_DEFAULTS",
    "CPU_DENSE_COPY_FRACTION",
    "CPU_KV_CAP_GIB",
    "CPU_KV_FRACTION",
    "DEVICES",
    "DTYPES",
    "EXECUTORS",
    "KV_CACHE_DTYPES",
    "QUANTIZATION_CHOICES",
    "available_ram_bytes",
    "cpu_has_avx512_bf16",
]
