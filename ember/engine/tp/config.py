"""Which --tensor-parallel-size values a model can run with, checked before any process starts.

Heads split evenly over ranks (q heads always; kv heads too, or each kv head is replicated on
tp / num_kv_heads ranks when there are fewer kv heads than ranks), and so do the MLP's and the
experts' intermediate dims. On CUDA there must be a device per rank; on CPU at most one rank per
core this process may use (more only oversubscribes the cores). A refusal lists the sizes that work.
"""

from __future__ import annotations

import os

from ember.errors import ConfigError
from ember.platform import usable_cores


def device_limit(device_type: str) -> int:
    if device_type == "cuda":
        import torch

        return torch.cuda.device_count()
    return usable_cores()


def shape_problems(mc, tp: int, awq_group_size: int | None = None) -> list[str]:
    """Why this model cannot be split over tp ranks (empty: it can)."""
    bad = []
    if mc.num_heads % tp:
        bad.append(f"{mc.num_heads} attention heads")
    kv = mc.num_kv_heads
    if kv % tp and tp % kv:
        bad.append(f"{kv} kv heads (tp must divide them, or be a multiple of them)")
    dims = {"intermediate_size": mc.intermediate_size}
    if getattr(mc, "num_experts", 0):
        dims["moe_intermediate_size"] = mc.moe_intermediate_size
    for name, n in dims.items():
        if n and n % tp:
            bad.append(f"{name} {n}")
    if awq_group_size is not None and tp > 1:
        # Row-parallel AWQ layers split their input groups; column-parallel ones their packed columns.
        if awq_group_size == -1:
            bad.append("AWQ group_size -1 (one group per row cannot be split)")
        else:
            ins = [mc.num_heads * mc.head_dim] + list(dims.values())
            if any(n and (n // awq_group_size) % tp for n in ins):
                bad.append(f"AWQ groups of {awq_group_size} (the row-parallel inputs' group counts)")
            local_outs = [mc.num_heads * mc.head_dim // tp, kv // min(tp, kv) * mc.head_dim]
            local_outs += [n // tp for n in dims.values()]
            if any(n % 8 for n in local_outs):
                bad.append("AWQ packing (each rank's output columns must be a multiple of 8)")
    return bad


def check_tensor_parallel(
    mc, tp: int, device_type: str, awq_group_size: int | None = None, multi_node: bool = False
) -> None:
    """Raise ConfigError unless mc runs with tp ranks on this device type; the message lists what works.
    multi_node (torchrun): the ranks are spread over hosts, so this host's devices do not bound tp."""
    if tp < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1 (got {tp})")
    if tp == 1:
        return
    limit = max(tp, 64) if multi_node else device_limit(device_type)
    bad = shape_problems(mc, tp, awq_group_size)
    if not bad and tp <= limit:
        return
    ok = [n for n in range(1, max(limit, 1) + 1) if not shape_problems(mc, n, awq_group_size)]
    where = (
        f"{limit} CUDA device(s) visible" if device_type == "cuda" else f"{limit} CPU core(s) available to this process"
    )
    why = f"it does not divide {', '.join(bad)}" if bad else f"there are only {where}"
    raise ConfigError(
        f"--tensor-parallel-size {tp} cannot run {mc.architecture}: {why}. "
        f"Sizes that work here: {', '.join(map(str, ok))}"
    )


def tp_quantization(requested: str | None, model: str | None) -> str:
    """--quantization under TP: a GGUF file runs dequantized (its packed blocks are not split);
    an explicit --quantization gguf is refused. AWQ int4 and dense weights are sharded as stored."""
    from ember.loader.model_loader import resolve_model_path

    requested = requested or "auto"
    if not os.path.isfile(resolve_model_path(model)):
        return requested
    if requested == "gguf":
        raise ConfigError(
            "--quantization gguf keeps GGUF blocks packed, which ember does not split across ranks; "
            "with --tensor-parallel-size > 1 leave --quantization at auto (or none): the file is "
            "dequantized to --dtype at load"
        )
    return "none"


def model_config_for(model: str | None):
    """(ModelConfig, AWQ group size or None) of a model argument, without loading weights."""
    from ember.config.model_config import ModelConfig
    from ember.loader.model_loader import resolve_model_path
    from ember.quant import checkpoint_quantization

    path = resolve_model_path(model)
    if os.path.isfile(path):
        from ember.loader.gguf import GGUFCheckpoint

        return ModelConfig.from_dict(GGUFCheckpoint(path).config), None
    mc = ModelConfig.from_folder(path)
    held, settings = checkpoint_quantization(path, mc.raw)
    group = (
        int((settings or {}).get("group_size", (settings or {}).get("q_group_size", 128))) if held == "awq" else None
    )
    return mc, group
