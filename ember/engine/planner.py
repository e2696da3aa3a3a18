"""Memory planner: what a model needs per device, and the longest context and concurrency that fit.

`ember plan` prints it; the engine sizes its KV pool and words its "does not fit" error with it.
Everything is per device, with N = --tensor-parallel-size, H hidden, D head_dim, I intermediate,
V vocab, G the AWQ group size, b the activation dtype's bytes:

  weights      dense: elements x b. awq int4: each linear weight costs 0.5 B + 2.5 B per group of
               G (fp16 scale 2 B + packed 4-bit zero 0.5 B), so 0.5 + 2.5/G B; embeddings, lm_head,
               norms, biases and MoE routers stay dense. gguf: the file's own tensor bytes.
               Sharding: q/k/v, gate/up, experts split their outputs /N, o/down their inputs /N,
               embedding and lm_head split the vocab /N, norms and routers are replicated, and k/v
               projections are replicated when kv heads < N (each device keeps one kv head).
  KV per token 2 x layers x kv heads per device x D x kv bytes (kv bytes = b, or 1 for fp8), with
               kv heads per device = max(1, Hkv / N) and layers + MTP layers
               (num_nextn_predict_layers / mtp_num_hidden_layers, of the config or of a separate
               MTP folder) when the engine would speculate with MTP. The engine sizes its pool the same way
               with the MTP layers its proposer loaded (each one more KV layer, same blocks).
  activations  max_num_batched_tokens x (2H + (2 Hq + 2 Hkv) D / N + 3 I' / N) x b    (residual and
               hidden, qkv, attention output, gate_up and its product; I' = max(I, moe_I x top-k))
               + 2 x max_num_seqs x V x 4    (fp32 logits and the sampler's probabilities)
  CUDA reserve on CUDA only: 0.5 GiB (CUDA context, cuBLAS workspace) + the decode-graph pool, taken
               as one step of max_num_seqs tokens' activations. An estimate, not a measurement.
  KV budget    memory x (GPU memory utilization on CUDA) - weights - activations - CUDA reserve;
               the pool holds floor(budget / block bytes) blocks; the largest max_model_len is
               min(model context, pool tokens); concurrency = pool tokens / max_model_len.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

from ember.config import EngineConfig
from ember.config.model_config import ModelConfig
from ember.engine import expert_plan
from ember.errors import ConfigError, KVCacheTooSmallError, ModelLoadError, UnsupportedModelError
from ember.platform import available_ram_bytes, resolve_dtype_name, resolve_kv_cache_dtype_name

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CUDA_CONTEXT_RESERVE = GiB // 2
AWQ_DEFAULT_GROUP = 128


# ---- KV cache ------------------------------------------------------------------------------


def kv_elem_bytes(kv_cache_dtype: str, dtype_bytes: int) -> int:
    return dtype_bytes if kv_cache_dtype == "auto" else 2 if kv_cache_dtype == "bfloat16" else 1


def mtp_layers(mc: ModelConfig) -> int:
    return int(mc.raw.get("num_nextn_predict_layers") or mc.raw.get("mtp_num_hidden_layers") or 0)


def folder_mtp_layers(folder: str) -> int:
    """MTP layers in a separate MTP folder (--speculative-model DIR): its config's count, else 1."""
    try:
        with open(os.path.join(os.path.expanduser(folder), "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the MTP folder's config.json in {folder!r}: {e}") from None
    return int(raw.get("num_nextn_predict_layers") or raw.get("mtp_num_hidden_layers") or 1)


def kv_heads_per_device(mc: ModelConfig, tp: int = 1) -> int:
    return max(1, -(-mc.num_kv_heads // tp))


def kv_bytes_per_token(mc: ModelConfig, elem_bytes: int, tp: int = 1, num_mtp_layers: int = 0) -> int:
    """num_mtp_layers: the MTP layers speculation adds (each one more KV layer). A QSA model's attention
    layers also keep each token's raw indexer key, paged with its K/V (ember.layers.qsa)."""
    layers = mc.num_kv_layers + num_mtp_layers
    indexer = layers * mc.indexer.head_dim * elem_bytes if mc.indexer is not None else 0
    return 2 * layers * kv_heads_per_device(mc, tp) * mc.head_dim * elem_bytes + indexer


@dataclass
class KVPool:
    budget_bytes: float
    block_size: int
    block_bytes: int
    num_blocks: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size


# A model with no attention layer (a hybrid of linear layers only) stores no KV: its blocks cost
# nothing and only do the bookkeeping (positions, prefix hashes). This many of them: 64 Mi tokens.
FREE_BLOCK_TOKENS = 1 << 26


def kv_pool(budget_bytes: float, block_bytes: int, block_size: int) -> KVPool:
    if block_bytes == 0:
        return KVPool(budget_bytes, block_size, 0, FREE_BLOCK_TOKENS // block_size)
    return KVPool(budget_bytes, block_size, block_bytes, max(0, int(budget_bytes // block_bytes)))


def check_states_fit(budget_bytes: float, state_bytes: int, knob: str) -> None:
    """A hybrid model's recurrent-state slots (sequences + snapshots) must leave room for KV blocks."""
    if state_bytes < budget_bytes:
        return
    raise KVCacheTooSmallError(
        f"the recurrent-state slots of this hybrid model need {state_bytes / GiB:.3f} GiB and the KV cache budget is "
        f"{budget_bytes / GiB:.3f} GiB: raise {knob}, or lower --max-num-seqs (one slot a sequence) or "
        "--max-state-snapshots (prefix-cache snapshots); `ember plan` shows the arithmetic"
    )


def check_fits(pool: KVPool, max_model_len: int, knob: str) -> None:
    """KVCacheTooSmallError naming the largest max-model-len that fits, unless one sequence fits."""
    if pool.tokens >= max_model_len:
        return
    need_gib = max_model_len / pool.block_size * pool.block_bytes / GiB
    raise KVCacheTooSmallError(
        f"the KV cache ({pool.budget_bytes / GiB:.3f} GiB, {pool.num_blocks} blocks of {pool.block_size} tokens) "
        f"cannot hold one sequence of --max-model-len {max_model_len}; the largest max-model-len that fits is "
        f"{pool.tokens}: pass --max-model-len {pool.tokens} or raise {knob} (one full sequence needs {need_gib:.3f} "
        "GiB; `ember plan` shows the arithmetic)"
    )


# ---- weights -------------------------------------------------------------------------------


def weight_inventory(mc: ModelConfig, tp: int = 1, extra_layers: int = 0) -> tuple[list[tuple[int, int]], int]:
    """Per device: ([(out, in)] of every linear, elements held dense: embeddings, norms, biases, routers)."""
    H, D, c = mc.hidden_size, mc.head_dim, lambda n: -(-n // tp)
    hq, hkv, vocab = c(mc.num_heads), kv_heads_per_device(mc, tp), c(mc.vocab_size)
    mlp_bias = bool(mc.raw.get("mlp_bias", False))
    linears, dense = [], 0
    for layer in range(mc.num_layers + extra_layers):
        if layer < mc.num_layers and mc.layer_type(layer) == "linear_attention":  # Gated DeltaNet
            kd, vd, nv = (
                c(mc.linear_num_key_heads) * mc.linear_key_head_dim,
                c(mc.linear_num_value_heads) * mc.linear_value_head_dim,
                c(mc.linear_num_value_heads),
            )
            linears += [((2 * kd + 2 * vd), H), (2 * nv, H), (H, vd)]
            dense += 2 * H + (2 * kd + vd) * mc.linear_conv_kernel_dim + 2 * nv + mc.linear_value_head_dim
        elif mc.is_hybrid:  # gated attention: q_proj is twice as tall
            linears += [((2 * hq + 2 * hkv) * D, H), (H, hq * D)]
            dense += 2 * H + 2 * D
        else:
            linears += [((hq + 2 * hkv) * D, H), (H, hq * D)]
            dense += 2 * H + (2 * D if mc.qk_norm else 0)
        if mc.shared_expert_intermediate_size and mc.is_moe_layer(min(layer, mc.num_layers - 1)):
            i = c(mc.shared_expert_intermediate_size)
            linears += [(2 * i, H), (H, i)]
            dense += H
        if mc.attention_bias:
            dense += (hq + 2 * hkv) * D + (0 if mc.traits.qkv_bias_only else H)
        if mc.is_moe_layer(min(layer, mc.num_layers - 1)):
            i = c(mc.moe_intermediate_size)
            linears += [(2 * i, H), (H, i)] * mc.num_experts
            dense += mc.num_experts * H
        else:
            i = c(mc.intermediate_size)
            linears += [(2 * i, H), (H, i)]
            dense += (2 * i + H) if mlp_bias else 0
        if layer >= mc.num_layers:  # an MTP layer: enorm, hnorm, eh_proj [H, 2H] (replicated)
            linears.append((H, 2 * H))
            dense += 2 * H
    dense += vocab * H * (1 if mc.tie_word_embeddings else 2) + H
    if mc.hc_count:
        more, more_dense = hyper_inventory(mc, tp)
        linears, dense = linears + more, dense + more_dense
    return linears, dense


def hyper_inventory(mc: ModelConfig, tp: int = 1) -> tuple[list[tuple[int, int]], int]:
    """qwen4_exp's weights beyond Qwen3.5-MoE's (replicated on every rank today): two hyper-connection mixers a
    layer and the final one (in place of the norms, 2H a layer + H, counted above), each attention layer's
    indexer, and each PLE layer's projections, norms and conv. Not its n-gram table: that stays in the
    file's mapping (ngram_table_elements)."""
    H, n, L = mc.hidden_size, mc.hc_count, mc.hc_lowrank
    mixers = 2 * mc.num_layers + 1
    # each mixer's down-projection split by input across ranks (ember.layers.hyper_connection)
    linears = [(L, n * H // tp), (n * H, L)] * mixers + [(n, n * H)] * (2 * mc.num_layers)
    dense = mixers * n * H - (2 * mc.num_layers + 1) * H
    if mc.indexer is not None:
        d = mc.indexer.head_dim
        linears += [((mc.indexer.num_heads + 1) * d, H)] * mc.num_kv_layers
        dense += 2 * d * mc.num_kv_layers
    if mc.ple is not None:
        for _ in mc.ple.layers:
            E = mc.ple.embed_dim
            linears += [(n * H, E), (H, E)]
            dense += 3 * n * H + n * H * mc.ple.conv_kernel
    return linears, dense


def ngram_table_elements(mc: ModelConfig) -> int:
    """The PLE n-gram tables' elements: read by row from the checkpoint's mapping, never resident whole."""
    from ember.layers.ple import NGramHash

    if mc.ple is None:
        return 0
    width = mc.ple.embed_dim // mc.ple.num_heads
    return sum(NGramHash(mc.ple, mc.vocab_size, i).num_rows * width for i, _ in enumerate(mc.ple.layers))


def mapped_weight_bytes(mc: ModelConfig, src) -> int:
    """The bytes of the checkpoint left in its mapping (the n-gram tables), at the file's element size."""
    elems = ngram_table_elements(mc)
    if not elems:
        return 0
    if src.kind == "gguf":  # the table's own bytes, whatever type it has beside the other tensors
        return src.gguf_mapped_bytes
    if (mc.raw.get("quantization_config") or {}).get("quant_method") == "fp8":
        return elems  # an FP8 checkpoint's table shards are fp8 (a per-tensor scale each)
    return elems * DTYPE_BYTES.get(str(mc.torch_dtype).removeprefix("torch."), 2)


def routed_expert_elements(mc: ModelConfig, tp: int = 1) -> int:
    """The routed experts' elements (gate, up and down of every expert of every MoE layer), per device."""
    if not mc.num_experts:
        return 0
    moe_layers = sum(mc.is_moe_layer(i) for i in range(mc.num_layers))
    return moe_layers * mc.num_experts * 3 * mc.hidden_size * (mc.moe_intermediate_size // tp)


def routed_expert_bytes(mc: ModelConfig, weights: int, tp: int = 1) -> int:
    """Their share of the weights' bytes as held (the same quantization as the other matrices)."""
    elems = routed_expert_elements(mc, tp)
    if not elems:
        return 0
    linears, dense = weight_inventory(mc, tp)
    return math.ceil(weights * elems / (sum(o * i for o, i in linears) + dense))


def num_parameters(mc: ModelConfig, extra_layers: int = 0) -> int:
    linears, dense = weight_inventory(mc, 1, extra_layers)
    return sum(o * i for o, i in linears) + dense + ngram_table_elements(mc)


def weight_bytes(
    mc: ModelConfig,
    quantization: str,
    dtype_bytes: int,
    tp: int = 1,
    extra_layers: int = 0,
    group_size: int = AWQ_DEFAULT_GROUP,
    gguf_bytes: int | None = None,
) -> int:
    linears, dense = weight_inventory(mc, tp, extra_layers)
    linear_elems = sum(o * i for o, i in linears)
    if quantization == "awq":
        return math.ceil(linear_elems * (0.5 + 2.5 / group_size)) + dense * dtype_bytes
    if quantization == "gguf":  # the file's bytes, shared out as the dense elements are
        # (less the bytes left in the file's mapping: mapped_weight_bytes)
        return math.ceil(gguf_bytes * (linear_elems + dense) / num_parameters(mc, extra_layers))
    if quantization == "half":  # a folder's 16-bit matrices and embedding kept so (the norms are few)
        return (linear_elems + dense) * 2
    if quantization == "fp8":  # 1 byte a weight, a float32 scale a block, an int32 scale row a row (ember.quant.fp8)
        bo, bi = fp8_block_size(mc)
        scales = sum(-(-o // bo) * -(-i // bi) * 4 + 4 * o for o, i in linears)
        return linear_elems + scales + dense * dtype_bytes
    return (linear_elems + dense) * dtype_bytes


def fp8_block_size(mc: ModelConfig) -> tuple[int, int]:
    """An FP8 checkpoint's weight_block_size (Qwen's: [128, 128])."""
    block = (mc.raw.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def half_weights_held(config: EngineConfig, src, quant: str, device: str, dtype_bytes: int) -> bool:
    """Whether a dense folder's bf16 / fp16 matrices stay 16-bit in this run (ember.quant.half_weights)."""
    from ember.engine import peak_rss
    from ember.quant.half_weights import HALF_DTYPES

    return (
        quant == "none"
        and src.kind == "folder"
        and (config.quantization or "auto") == "auto"
        and device == "cpu"
        and config.tensor_parallel_size == 1
        and src.mc.torch_dtype in HALF_DTYPES
        and peak_rss.half_weights_kept(dtype_bytes, config.kernel_config.half_weights)
    )


# ---- activations ---------------------------------------------------------------------------


def activation_bytes_per_token(mc: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    c = lambda n: -(-n // tp)  # noqa: E731
    inter = max(mc.intermediate_size, mc.moe_intermediate_size * mc.num_experts_per_tok)
    width = 2 * mc.hidden_size + (2 * c(mc.num_heads) + 2 * kv_heads_per_device(mc, tp)) * mc.head_dim + 3 * c(inter)
    return width * dtype_bytes


def activation_bytes(mc: ModelConfig, dtype_bytes: int, tp: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    return (
        max_num_batched_tokens * activation_bytes_per_token(mc, dtype_bytes, tp) + 2 * max_num_seqs * mc.vocab_size * 4
    )


def cuda_reserve_bytes(mc: ModelConfig, dtype_bytes: int, tp: int, max_num_seqs: int) -> int:
    return CUDA_CONTEXT_RESERVE + max_num_seqs * activation_bytes_per_token(mc, dtype_bytes, tp)


# ---- a model on disk -> a plan --------------------------------------------------------------


@dataclass
class Source:
    path: str
    kind: str  # "gguf" | "folder" | "config"
    mc: ModelConfig
    gguf_bytes: int | None = None
    gguf_tensors: list | None = None  # peak_rss.GGUFTensorInfo of every tensor the loader loads
    gguf_mapped_bytes: int = 0  # the file's tensors read by row, never loaded (qwen4exp's n-gram table)


def load_source(model: str | None) -> Source:
    """A .gguf, an HF folder (config.json alone is enough), a config.json path, or None (the default model)."""
    if model is None:
        from ember.default_model import default_model_path

        model = default_model_path()
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return Source(path, "folder", ModelConfig.from_folder(path))
    if not os.path.isfile(path):
        raise ModelLoadError(f"{model!r} not found: give a config.json, a Hugging Face model folder or a .gguf file")
    if path.endswith(".json"):
        try:
            with open(path) as f:
                return Source(path, "config", ModelConfig.from_dict(json.load(f)))
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    from ember.engine.peak_rss import GGUFTensorInfo
    from ember.loader.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(path)
    infos = [GGUFTensorInfo(*t) for t in ckpt.loaded_tensor_infos()]
    return Source(path, "gguf", ModelConfig.from_dict(ckpt.config), ckpt.tensor_bytes, infos, ckpt.mapped_tensor_bytes)


def resolve_quantization(src: Source, requested: str) -> tuple[str, int]:
    """(none | awq | gguf, AWQ group size). auto follows the checkpoint; awq / none may be asked
    of any config (a what-if); gguf needs a .gguf file."""
    qc = src.mc.raw.get("quantization_config") or {}
    if src.kind == "folder":
        from ember.quant import checkpoint_quantization

        held, qc = checkpoint_quantization(src.path, src.mc.raw)
        qc = qc or {}
    else:
        held = "gguf" if src.kind == "gguf" else str(qc.get("quant_method", "none")).lower()
    group = int(qc.get("group_size") or qc.get("q_group_size") or AWQ_DEFAULT_GROUP)
    q = held if requested in ("auto", None) else requested
    if q not in ("none", "awq", "gguf", "fp8"):
        raise UnsupportedModelError(
            f"{src.path} holds {q!r}-quantized weights; ember plans none, awq, fp8 and gguf. "
            "Pass --quantization none or awq to plan those instead"
        )
    if q == "gguf" and src.kind != "gguf":
        raise ConfigError("--quantization gguf plans from a .gguf file's own tensor bytes; give the .gguf file")
    if q == "awq" and src.kind == "gguf":
        raise ConfigError(f"{src.path} is a GGUF file; plan it with --quantization gguf (or none for dense)")
    return q, group


@dataclass
class Plan:
    model: str
    architecture: str
    device: str
    dtype: str
    kv_cache_dtype: str
    quantization: str
    tensor_parallel_size: int
    num_parameters: int
    weight_bytes: int
    kv_layers: int
    kv_heads_per_device: int
    head_dim: int
    kv_elem_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int
    cuda_reserve_bytes: int
    memory_bytes: int
    usable_bytes: int
    kv_budget_bytes: int
    block_size: int
    pool_tokens: int
    context_len: int
    max_model_len: int
    largest_max_model_len: int
    concurrency: float
    fits: bool
    draft_kv_bytes_per_token: int = 0  # a draft model's layers, included in kv_bytes_per_token
    # hybrid models: one sequence's recurrent state, and the slots the engine keeps (max_num_seqs + snapshots)
    state_bytes_per_seq: int = 0
    state_slots: int = 0
    # a CPU engine process's predicted peak resident set and its parts (ember.engine.peak_rss); 0 on CUDA
    peak_rss_bytes: int = 0
    peak_rss_parts: dict | None = None
    # a first start's package worker (engine/startup/package_worker.py): its own process, its peak; 0 where
    # the decode graphs are not AOTInductor packages built in one (CUDA, eager, torch.compile's graphs)
    package_worker_bytes: int = 0
    # weights left in the checkpoint's mapping, read by row (qwen4_exp's n-gram table), not in weight_bytes
    mapped_weight_bytes: int = 0
    # the routed experts' part of weight_bytes (what host memory would hold beside a card)
    expert_weight_bytes: int = 0
    # --cpu-moe / --n-cpu-moe (ember.engine.expert_plan): the MoE layers, how many keep their experts in host
    # memory (mapped from the file: host_expert_bytes, counted whole, as a long decode touches nearly all), the
    # device's hot-expert cache, the host's memory and whether the host side fits it
    moe_layers: int = 0
    host_moe_layers: int = 0
    host_expert_bytes: int = 0
    hot_cache_bytes: int = 0
    host_memory_bytes: int = 0
    host_fits: bool = True
    # the fewest first MoE layers to keep in host memory for the device to fit (None: not even all of them)
    n_cpu_moe_to_fit: int | None = 0
    hot_cache_slot_bytes: int = 0  # one expert's dense copy in the cache

    def to_dict(self) -> dict:
        return asdict(self)


def default_memory_gib(device: str) -> float:
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GiB
        raise ConfigError("no CUDA device here to size from: pass --memory GiB (the GPU's memory)")
    return available_ram_bytes() / GiB


def plan(config: EngineConfig, memory_gib: float | None = None, host_memory_gib: float | None = None) -> Plan:
    """The memory plan of an engine started with these flags, without loading the model.

    --device auto plans for CUDA (a plan is for the card the model will run on; --device cpu plans
    against this machine's RAM). memory_gib: the device's memory (None: the CUDA device's, or the
    available RAM). Speculation counts as the engine would run it: an MTP proposer's layers (the
    model's own, or a separate MTP folder's; the default model's trained head by default) join the
    KV pool, a draft model's layers join it too (same blocks) and its weights the total. host_memory_gib: the
    host's memory beside a card (None: the available RAM), which holds experts kept there (--cpu-moe)."""
    device = "cuda" if config.device == "auto" else config.device
    tp = config.tensor_parallel_size
    src = load_source(config.model)
    mc = src.mc
    quant, group = resolve_quantization(src, config.quantization)
    dtype = resolve_dtype_name(config.dtype, device)
    b = DTYPE_BYTES[dtype]
    quant = "half" if half_weights_held(config, src, quant, device, b) else quant
    extra, draft = speculation(config, mc)
    sched = config.scheduler_config
    max_num_seqs = sched.default_max_num_seqs(device)
    elem = kv_elem_bytes(resolve_kv_cache_dtype_name(config.kv_cache_dtype, config.dtype, device), b)
    per_token = kv_bytes_per_token(mc, elem, tp, num_mtp_layers=extra)
    weights = weight_bytes(mc, quant, b, tp, extra, group, src.gguf_bytes)
    experts = routed_expert_bytes(mc, weights, tp)
    split = expert_plan.expert_split(config.placement_config, src, quant, weights, experts, b)
    draft_kv, draft_weights = draft_model_bytes(draft, elem, b)
    per_token, weights = per_token + draft_kv, weights + draft_weights
    device_weights = weights - split.device_saved_bytes  # less the experts kept in host memory
    act = activation_bytes(mc, b, tp, sched.token_budget(device), max_num_seqs)
    cuda = cuda_reserve_bytes(mc, b, tp, max_num_seqs) if device == "cuda" else 0
    memory, usable = device_memory(config, device, memory_gib)
    budget = max(0, usable - device_weights - act - cuda)
    state_seq, slots = state_slots(config, mc, b, tp, max_num_seqs)
    block_size = config.block_size
    pool = kv_pool(max(0, budget - state_seq * slots), per_token * block_size, block_size)
    context, want = mc.max_position_embeddings, wanted_model_len(sched.max_model_len, mc.max_position_embeddings)
    pool, hot = hot_cache_pool(config, device, split, mc, pool, (want, max_num_seqs), per_token, b)
    rss = predict_peak_rss(
        config, device, src, quant, b, device_weights, pool.block_bytes, state_seq * slots, want, split, hot
    )
    worker = package_build_bytes(config, src, quant, b, rss[1], state_seq * max_num_seqs, want, per_token * block_size)
    host = host_side(device, split, rss[0], host_memory_gib)
    shortfall = device_weights + act + cuda + state_seq * slots + per_token * want - usable
    return Plan(
        src.path,
        mc.architecture,
        device,
        dtype,
        config.kv_cache_dtype,
        quant,
        tp,
        num_parameters(mc, extra),
        weights,
        mc.num_kv_layers + extra,
        kv_heads_per_device(mc, tp),
        mc.head_dim,
        elem,
        per_token,
        act,
        cuda,
        memory,
        usable,
        budget,
        block_size,
        pool.tokens,
        context,
        want,
        min(context, pool.tokens),
        pool.tokens / want,
        pool.tokens >= want and state_seq * slots < budget and host[1],
        draft_kv,
        state_seq,
        slots,
        *rss,
        worker,
        mapped_weight_bytes(mc, src),
        experts,
        **expert_plan.plan_fields(split, hot, host, shortfall, 3 * mc.hidden_size * mc.moe_intermediate_size * b),
    )


def device_memory(config: EngineConfig, device: str, memory_gib: float | None) -> tuple[int, int]:
    """(the device's memory, what the engine may use of it)."""
    memory = int((memory_gib if memory_gib is not None else default_memory_gib(device)) * GiB)
    return memory, int(memory * (config.gpu_memory_utilization if device == "cuda" else 1.0))


def state_slots(config: EngineConfig, mc: ModelConfig, b: int, tp: int, max_num_seqs: int) -> tuple[int, int]:
    """A hybrid's (recurrent state bytes a sequence, slots): one live state per sequence, plus the prefix
    cache's snapshots; (0, 0) for other models."""
    if not mc.is_hybrid:
        return 0, 0
    return mc.state_bytes_per_seq(b, tp), max_num_seqs + config.cache_config.state_snapshots(max_num_seqs)


def speculation(config: EngineConfig, mc: ModelConfig) -> tuple[int, Source | None]:
    """(the MTP layers speculation adds to the KV pool, a draft model's source)."""
    spec = config.speculative
    if spec is not None and spec.method == "mtp":
        return (folder_mtp_layers(spec.model) if spec.model else mtp_layers(mc)), None
    if spec is not None and spec.method == "draft":
        return 0, load_source(spec.model)
    return 0, None


def hot_cache_pool(config, device: str, split, mc, pool: KVPool, want: tuple[int, int], per_token: int, b: int):
    """(the KV pool, the hot-expert cache's bytes): on CUDA the cache takes its blocks out of the pool
    (ember.engine.startup.hot_cache); want: (max_model_len, max_num_seqs), the sequences the pool keeps."""
    spare = pool.tokens - want[1] * -(-want[0] // pool.block_size) * pool.block_size
    hot = expert_plan.hot_cache_bytes(config.placement_config, device, split, mc, spare, per_token, b)
    if device != "cpu" and hot and pool.block_bytes:
        pool = KVPool(
            pool.budget_bytes, pool.block_size, pool.block_bytes, pool.num_blocks - -(-hot // pool.block_bytes)
        )
    return pool, hot


def host_side(device: str, split, cpu_peak: int, host_memory_gib: float | None) -> tuple[int, bool]:
    """(the host's memory, whether it holds what the host side needs): beside a card, the experts kept in host
    memory (counted whole), the process and what the rest of the machine keeps (expert_plan.HOST_RESERVE_BYTES);
    a CPU engine's whole peak RSS is its own business (not a fit)."""
    from ember.engine import peak_rss

    memory = int(host_memory_gib * GiB) if host_memory_gib is not None else available_ram_bytes()
    if device == "cpu" or not split.host_layers:
        return memory, True
    return memory, split.host_bytes + peak_rss.PROCESS_BYTES + expert_plan.HOST_RESERVE_BYTES <= memory


def draft_model_bytes(draft: Source | None, elem: int, dtype_bytes: int) -> tuple[int, int]:
    """A draft model's KV bytes a token and its weights, unsharded (as ember.spec.draft loads it)."""
    if draft is None:
        return 0, 0
    quant, group = resolve_quantization(draft, "auto")
    return kv_bytes_per_token(draft.mc, elem), weight_bytes(draft.mc, quant, dtype_bytes, 1, 0, group, draft.gguf_bytes)


def wanted_model_len(max_model_len: int | None, context: int) -> int:
    """--max-model-len, or the model's context; refused above the context."""
    if max_model_len is not None and max_model_len > context:
        raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's context length {context}")
    return max_model_len or context


def packaged_graphs(config: EngineConfig, src, quant: str, dtype_bytes: int) -> bool:
    """Whether a CPU engine of these flags runs its decode graphs as AOTInductor packages (peak_rss.packaged)."""
    from ember.engine import peak_rss

    half_kept = peak_rss.half_weights_kept(dtype_bytes, config.kernel_config.half_weights)
    return config.executor_config.executor in ("auto", "compiled") and (
        quant == "half" or (quant == "gguf" and peak_rss.packaged(src.gguf_tensors, half_kept))
    )


def package_build_bytes(
    config: EngineConfig,
    src: Source,
    quant: str,
    dtype_bytes: int,
    rss_parts: dict | None,
    live_states: int,
    max_model_len: int,
    block_bytes: int,
) -> int:
    """A first start's package build beside a CPU engine (peak_rss.package_worker_bytes: its worker loads
    the file's largest tensor at a time and holds one max_model_len sequence of KV blocks); 0 without
    rss_parts (CUDA, or graphs that are not packages, which only GGUF files' are)."""
    from ember.engine import peak_rss

    if rss_parts is None or not packaged_graphs(config, src, quant, dtype_bytes):
        return 0
    if quant == "half":  # the largest 16-bit matrix, the embedding as a rule
        linears, _ = weight_inventory(src.mc)
        largest = 2 * max([o * i for o, i in linears] + [src.mc.vocab_size * src.mc.hidden_size])
    else:
        largest = peak_rss.gguf_largest_weight_bytes(
            src.gguf_tensors, dtype_bytes, src.mc.tie_word_embeddings, config.kernel_config.half_weights
        )
    kv_one_sequence = -(-max_model_len // config.block_size) * block_bytes
    return peak_rss.package_worker_bytes(rss_parts["process"], largest, live_states, kv_one_sequence)


def cpu_kv_budget_bytes(config: EngineConfig) -> float:
    """What a CPU engine's pool gets (engine/startup/kv_pool.py): --kv-cache-memory, else a share of free RAM."""
    from ember.config import CPU_KV_CAP_GIB, CPU_KV_FRACTION

    memory = config.cache_config.kv_cache_memory
    return memory * GiB if memory is not None else min(CPU_KV_FRACTION * available_ram_bytes(), CPU_KV_CAP_GIB * GiB)


def predict_peak_rss(
    config: EngineConfig,
    device: str,
    src: Source,
    quant: str,
    b: int,
    weights: int,
    block_bytes: int,
    state_bytes: int,
    want: int,
    split=None,
    hot_cache: int = 0,
) -> tuple[int, dict | None]:
    """(bytes, their parts by name): the peak RSS of a CPU engine started with these flags
    (ember.engine.peak_rss has the model); (0, None) on CUDA, whose memory is the GPU's. split: the experts
    kept in host memory (expert_plan.ExpertSplit): mapped, counted whole at the file's bytes, and left out of
    the resident weights; hot_cache: a hot-expert cache's bytes (--moe-hot-cache-memory on CPU)."""
    from ember.config import CPU_DENSE_COPY_FRACTION
    from ember.engine import peak_rss

    if device != "cpu":
        return 0, None

    mc, sched, kc = src.mc, config.scheduler_config, config.kernel_config
    copy = 0
    mapped = split.host_bytes if split is not None else 0
    if quant == "gguf" and src.gguf_tensors is not None:
        tensors = expert_plan.resident_tensors(src.gguf_tensors, split)
        weights = peak_rss.gguf_weight_bytes(tensors, b, mc.tie_word_embeddings, kc.half_weights)
        if kc.int4_dense_copy is True or (kc.int4_dense_copy is None and b != 4):  # auto: never float32
            copy = peak_rss.gguf_dense_copy_bytes(tensors, b, kc.int8_activations)
            if kc.int4_dense_copy is None and copy > CPU_DENSE_COPY_FRACTION * available_ram_bytes():
                copy = 0
    pool = kv_pool(max(0.0, cpu_kv_budget_bytes(config) - state_bytes), block_bytes, config.block_size)
    tokens = min(sched.token_budget("cpu"), want)
    max_num_seqs = sched.default_max_num_seqs("cpu")
    step = activation_bytes(mc, b, 1, tokens, max_num_seqs) + peak_rss.hybrid_step_bytes(mc, tokens)
    compiled = config.executor_config.executor in ("auto", "compiled")
    rss = peak_rss.PeakRss(
        peak_rss.PROCESS_BYTES + peak_rss.TOKENIZER_BYTES_PER_TOKEN * mc.vocab_size,
        weights,
        copy,
        pool.num_blocks * pool.block_bytes,
        state_bytes,
        step,
        peak_rss.compile_bytes(max_num_seqs, packaged_graphs(config, src, quant, b)) if compiled else 0,
        mapped,
        hot_cache,
    )
    return rss.total, dict(rss.parts())


def weight_rows(p: Plan, size, tp: str) -> list[tuple[str, str]]:
    rows = [("weights", f"{size(p.weight_bytes)}  [{p.quantization}, {p.dtype}{tp}]")]
    if p.mapped_weight_bytes:
        rows.append(("mapped weights", f"{size(p.mapped_weight_bytes)}  read by row from the file, not resident"))
    if p.expert_weight_bytes:
        rows.append(("routed experts", experts_line(p, size)))
    if p.host_moe_layers:
        rows += host_expert_rows(p, size)
    return rows


def host_expert_rows(p: Plan, size) -> list[tuple[str, str]]:
    """--cpu-moe / --n-cpu-moe: what the host holds, what stays on the device, the hot cache."""
    saved = p.expert_weight_bytes * p.host_moe_layers // max(1, p.moe_layers)
    holds = "holds them" if p.host_fits else "CANNOT hold them (the experts would be read from the disk every step)"
    rows = [
        (
            "experts in host memory",
            f"{size(p.host_expert_bytes)}: the first {p.host_moe_layers} of {p.moe_layers} MoE layers' experts, "
            "mapped from the file and counted whole (a decode over a long prompt touches nearly all of them)"
            + (f"; host memory {size(p.host_memory_bytes)} {holds}" if p.device != "cpu" else ""),
        ),
        ("weights on the device", size(p.weight_bytes - saved)),
    ]
    if p.hot_cache_bytes:
        slots = p.hot_cache_bytes // max(1, p.hot_cache_slot_bytes)
        rows.append(("hot-expert cache", f"{size(p.hot_cache_bytes)}: {slots:,} experts' copies on the {p.device}"))
    return rows


def kv_line(p: Plan) -> str:
    kv = 2 * p.kv_layers * p.kv_heads_per_device * p.head_dim * p.kv_elem_bytes
    return (
        f"{p.kv_bytes_per_token:,} B = 2 x {p.kv_layers} layers x {p.kv_heads_per_device} kv heads"
        f" x {p.head_dim} head_dim x {p.kv_elem_bytes} B"
        + (" + the indexer's key" if p.kv_bytes_per_token > kv + p.draft_kv_bytes_per_token else "")
        + (f" + {p.draft_kv_bytes_per_token:,} B draft model" if p.draft_kv_bytes_per_token else "")
        + f"  [{p.kv_cache_dtype}]"
    )


def experts_line(p: Plan, size) -> str:
    """The routed experts' share of the weights and, where the model does not fit, whether the rest would."""
    rest = p.weight_bytes - p.expert_weight_bytes
    line = f"{size(p.expert_weight_bytes)} of the weights; the rest {size(rest)}"
    n = p.n_cpu_moe_to_fit
    if p.device == "cuda" and n and n > p.host_moe_layers:
        flag = "--cpu-moe" if n == p.moe_layers else f"--n-cpu-moe {n}"
        line += (
            f" (this device fits the model with {flag}: the experts of the first {n} of {p.moe_layers} MoE "
            "layers in host memory)"
        )
    return line


def format_plan(p: Plan) -> str:
    def size(n: float) -> str:
        return f"{n / 1e9:,.2f} GB ({n / GiB:,.2f} GiB)"

    tp = f", per device of {p.tensor_parallel_size}" if p.tensor_parallel_size > 1 else ""
    rows = [
        ("model", f"{p.architecture}  {p.model}"),
        ("parameters", f"{p.num_parameters:,} ({p.num_parameters / 1e9:.2f} B)"),
        *weight_rows(p, size, tp),
        ("KV bytes per token", kv_line(p)),
        ("KV per sequence", f"{size(p.kv_bytes_per_token * p.max_model_len)} for {p.max_model_len:,} tokens"),
        ("activation reserve", size(p.activation_bytes)),
        ("CUDA reserve", size(p.cuda_reserve_bytes) if p.device == "cuda" else "- (cpu)"),
        (
            "memory",
            f"{size(p.memory_bytes)}"
            + (f", usable {size(p.usable_bytes)}" if p.usable_bytes != p.memory_bytes else ""),
        ),
        ("KV cache budget", size(p.kv_budget_bytes)),
        *(
            [
                (
                    "recurrent state",
                    f"{size(p.state_bytes_per_seq)} a sequence (fp32 SSM + conv windows); {p.state_slots} "
                    f"slots (one live a sequence, the rest prefix-cache snapshots) = "
                    f"{size(p.state_bytes_per_seq * p.state_slots)} of the budget",
                )
            ]
            if p.state_bytes_per_seq
            else []
        ),
        ("KV pool", f"{p.pool_tokens:,} tokens (blocks of {p.block_size})"),
        (
            "max_model_len",
            f"{p.max_model_len:,} (model context {p.context_len:,})  {'fits' if p.fits else 'DOES NOT FIT'}",
        ),
        ("largest max_model_len", f"{p.largest_max_model_len:,}"),
        (
            "concurrency",
            f"{p.concurrency:.2f} sequences of {p.max_model_len:,} tokens"
            + (" (each also holds a state slot)" if p.state_bytes_per_seq else ""),
        ),
        *(
            [
                (
                    "sequences that fit",
                    f"{int(p.kv_budget_bytes // (p.kv_bytes_per_token * p.max_model_len + p.state_bytes_per_seq))}"
                    f" of {p.max_model_len:,} tokens, each with its KV and its recurrent state "
                    "(snapshots aside)",
                )
            ]
            if p.state_bytes_per_seq
            else []
        ),
    ]
    if p.peak_rss_parts:
        parts = ", ".join(f"{k} {v / 2**20:,.0f}" for k, v in p.peak_rss_parts.items() if v)
        rows.append(("peak RSS (cpu)", f"{size(p.peak_rss_bytes)} = {parts} MiB"))
    if p.package_worker_bytes:
        rows.append(
            (
                "package build (cpu)",
                f"{size(p.package_worker_bytes)} at its peak (a worker and its compiler), a first start's, "
                "beside the engine",
            )
        )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
