"""EngineConfig's flat flags and the sub-configs built from them; CpuKernels chosen from the flags."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ember.config import EngineConfig, KernelConfig
from ember.errors import ConfigError
from ember.kernels import cpu_fused_elementwise
from ember.kernels.cpu_kernels import CpuKernels


def test_flags_round_trip_and_feed_their_sub_configs():
    config = EngineConfig(
        model="m",
        max_num_seqs=4,
        block_size=32,
        enforce_eager=True,
        cpu_paged_attention=False,
        tensor_parallel_size=2,
        kv_cache_memory=0.5,
        seed=7,
    )
    assert EngineConfig(**config.flags()) == config
    assert set(config.flags()) == set(EngineConfig.field_names()) and "load_config" not in config.flags()
    assert config.load_config.model == "m" and config.load_config.seed == 7
    assert config.cache_config.block_size == 32 and config.cache_config.kv_cache_memory == 0.5
    assert config.scheduler_config.max_num_seqs == 4 and config.scheduler_config.default_max_num_seqs("cuda") == 4
    assert config.executor_config.executor == "eager"  # --enforce-eager folded in
    assert config.kernel_config.paged_attention is False and config.kernel_config.flash_attention is True
    assert config.parallel_config.tensor_parallel_size == 2
    assert EngineConfig(model="m").scheduler_config.default_max_num_seqs("cpu") == 16


def test_step_budget_defaults_by_device_and_cpu_flags(monkeypatch):
    """--max-num-batched-tokens left unset: 512 on a CPU without AMX (its prefill transients stay in the
    heap: a bounded chunk bounds the peak RSS), 2048 with AMX and on CUDA; never below --max-num-seqs,
    and with chunked prefill off never below max_model_len. One given is kept."""
    from ember.config import groups

    for amx, cpu in ((False, 512), (True, 2048)):
        monkeypatch.setattr(groups, "has_cpu_flags", lambda *flags, amx=amx: amx and flags == ("amx_bf16",))
        sched = EngineConfig(model="m").scheduler_config
        assert sched.token_budget("cpu") == cpu and sched.token_budget("cuda") == 2048
    monkeypatch.setattr(groups, "has_cpu_flags", lambda *flags: False)
    assert EngineConfig(model="m", max_num_seqs=1000).scheduler_config.token_budget("cpu") == 1000
    assert EngineConfig(model="m", max_num_seqs=1000).scheduler_config.default_max_num_seqs("cpu") == 1000
    off = EngineConfig(model="m", enable_chunked_prefill=False).scheduler_config
    assert off.token_budget("cpu", max_model_len=4096) == 4096 and off.token_budget("cpu", max_model_len=100) == 512
    given = EngineConfig(model="m", max_num_batched_tokens=3000).scheduler_config
    assert given.token_budget("cpu") == given.token_budget("cuda") == 3000
    with pytest.raises(ConfigError, match="--max-num-seqs 64 exceeds --max-num-batched-tokens 32"):
        EngineConfig(model="m", max_num_seqs=64, max_num_batched_tokens=32)


def test_sub_configs_check_their_own_flags():
    with pytest.raises(ConfigError, match="--block-size must be a power of two"):
        EngineConfig(block_size=24)
    with pytest.raises(ConfigError, match="--attention-backend 'flash'"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="--kv-cache-memory sizes the CPU KV cache"):
        EngineConfig(device="cuda", kv_cache_memory=1.0)
    with pytest.raises(ConfigError, match="contradicts --executor eager"):
        EngineConfig(executor="eager", compilation_config={})


def test_config_is_a_light_import():
    """ember.config (and so `import ember`) pulls in neither torch nor the engine."""
    code = "import sys, ember.config; print(sorted(m for m in ('torch', 'ember.engine', 'ember.kernels') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cpu_kernels_follow_the_flags():
    off = KernelConfig(
        attention_backend="auto",
        num_threads=None,
        paged_attention=False,
        flash_attention=False,
        tiled_gemv=False,
        half_weights=False,
        int8_activations=False,
        fused_elementwise=False,
        gated_delta_net=False,
        fp8_gemv=False,
        block_gemv=False,
        int8_decode=None,
        int4_dense_copy=None,
    )
    assert CpuKernels.select(off, "cpu", torch.float32) == CpuKernels.none()
    assert CpuKernels.select(EngineConfig().kernel_config, "cuda", torch.bfloat16) == CpuKernels.none()
    on = CpuKernels.select(EngineConfig().kernel_config, "cpu", torch.float32)
    assert on.int8_activations  # float32: nothing to build for the bf16-only ones
    assert on.fused_elementwise == cpu_fused_elementwise.available()  # float32 rows are the fused kernels' too


def test_every_command_help_renders():
    """argparse %-formats help strings: a stray % (e.g. a formatted percentage) crashes --help."""
    import argparse

    from ember.entrypoints.cli import build_parser

    def parsers(p):
        yield p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    yield from parsers(sub)

    seen = [p.format_help() for p in parsers(build_parser())]
    assert len(seen) > 10
