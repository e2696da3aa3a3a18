"""ember.engine.planner and `ember plan`: figures computed by hand from the configs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ember.config import EngineConfig
from ember.config.model_config import ModelConfig
from ember.engine import planner
from ember.entrypoints.cli import main
from ember.errors import ConfigError, KVCacheTooSmallError
from ember.loader.model_loader import count_parameters
from ember.models.registry import get_model_class

GiB = 2**30
# The seed example's figures (327,680 B per token in fp16, 50K tokens ~ 16.4e9 B) are those of
# 80 layers x 8 KV heads x 128: a Llama-3-70B shape. (40 such layers give half: 163,840.)
SEED = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
H, I, V, L, D = 8192, 28672, 128256, 80, 128


def planned(model, memory_gib=None, **flags) -> planner.Plan:
    """The plan of the engine these flags would start (ember plan's arithmetic)."""
    return planner.plan(EngineConfig(model=model, **flags), memory_gib=memory_gib)


@pytest.fixture
def seed_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SEED))
    return str(path)


def test_seed_example_kv_bytes(seed_config):
    mc = ModelConfig.from_dict(SEED)
    assert planner.kv_bytes_per_token(mc, 2) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert planner.kv_bytes_per_token(mc, 2) * 50_000 == 16_384_000_000  # 50K tokens ~ 16.4e9 B
    assert planner.kv_bytes_per_token(ModelConfig.from_dict(SEED | {"num_hidden_layers": 40}), 2) == 163_840
    p = planned(seed_config, dtype="float16", memory_gib=200, max_model_len=50_000)
    assert p.kv_bytes_per_token == 327_680
    p8 = planned(seed_config, dtype="float16", memory_gib=200, max_model_len=50_000, kv_cache_dtype="fp8")
    assert p8.kv_bytes_per_token == 163_840
    assert p8.kv_budget_bytes == p.kv_budget_bytes
    assert 0 <= p8.pool_tokens - 2 * p.pool_tokens <= 16  # twice the tokens (whole blocks of 16)


def test_seed_example_weights_and_budget(seed_config):
    layer_linear = (64 + 2 * 8) * D * H + H * 64 * D + 3 * H * I
    linear, dense = L * layer_linear, L * 2 * H + 2 * V * H + H
    p = planned(seed_config, dtype="float16", memory_gib=200, max_model_len=50_000, device="cuda")
    assert p.num_parameters == linear + dense == 70_553_706_496  # Llama-3-70B's count
    assert p.weight_bytes == 2 * (linear + dense)
    per_token_act = (2 * H + (2 * 64 + 2 * 8) * D + 3 * I) * 2
    assert p.activation_bytes == 2048 * per_token_act + 2 * 64 * V * 4
    assert p.cuda_reserve_bytes == GiB // 2 + 64 * per_token_act
    usable = int(200 * GiB * 0.9)
    assert p.kv_budget_bytes == usable - p.weight_bytes - p.activation_bytes - p.cuda_reserve_bytes
    block = 327_680 * 16
    assert p.pool_tokens == p.kv_budget_bytes // block * 16
    assert (
        p.fits
        and p.largest_max_model_len == min(131072, p.pool_tokens)
        and p.concurrency == pytest.approx(p.pool_tokens / 50_000)
    )
    awq = planned(seed_config, dtype="float16", memory_gib=200, quantization="awq")
    assert awq.weight_bytes == math.ceil(linear * (0.5 + 2.5 / 128)) + 2 * dense


def test_tensor_parallel_per_device(seed_config):
    p = planned(seed_config, dtype="float16", memory_gib=80, tensor_parallel_size=2)
    assert p.kv_bytes_per_token == 2 * 80 * 4 * 128 * 2 == 163_840  # 4 of the 8 kv heads per device
    layer_linear = (32 + 2 * 4) * D * H + H * 32 * D + 3 * H * (I // 2)
    assert p.weight_bytes == 2 * (L * layer_linear + L * 2 * H + 2 * (V // 2) * H + H)  # norms replicated
    # More devices than kv heads: each device keeps one kv head (replicated k/v).
    p16 = planned(seed_config, dtype="float16", memory_gib=80, tensor_parallel_size=16)
    assert p16.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2 and p16.kv_heads_per_device == 1


def test_mtp_layers_count_with_speculative_tokens(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SEED | {"num_nextn_predict_layers": 1}))
    assert planned(str(path), dtype="float16", memory_gib=200).kv_bytes_per_token == 327_680
    spec = planned(str(path), dtype="float16", memory_gib=200, enable_mtp=True, num_speculative_tokens=2)
    assert spec.kv_bytes_per_token == 2 * 81 * 8 * 128 * 2 and spec.kv_layers == 81


@pytest.mark.slow
def test_default_model_by_hand():
    """SmolLM2-135M (Q4_1 GGUF): 30 layers, 3 kv heads of 64, hidden 576, intermediate 1536, vocab 49152.
    The engine speculates with the default model's MTP head unless told not to: one more KV layer."""
    assert planned(None, dtype="bfloat16", device="cpu", memory_gib=4).kv_layers == 31
    # the step budget named: its default on CPU follows the CPU's flags (groups.default_token_budget)
    p = planned(None, dtype="bfloat16", device="cpu", memory_gib=4, enable_mtp=False, max_num_batched_tokens=2048)
    assert p.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert (p.quantization, p.num_parameters, p.weight_bytes) == ("gguf", 134_515_008, 96_576_768)  # the file's
    assert p.activation_bytes == 2048 * (2 * 576 + (18 + 6) * 64 + 3 * 1536) * 2 + 2 * 16 * 49152 * 4
    assert p.cuda_reserve_bytes == 0 and p.usable_bytes == 4 * GiB
    assert p.kv_budget_bytes == 4 * GiB - 96_576_768 - p.activation_bytes
    assert p.pool_tokens == p.kv_budget_bytes // (23_040 * 16) * 16
    assert p.max_model_len == p.largest_max_model_len == 8192  # capped by the model's context
    fp8 = planned(None, dtype="bfloat16", device="cpu", memory_gib=4, kv_cache_dtype="fp8", enable_mtp=False)
    assert fp8.kv_bytes_per_token == 11_520
    dense = planned(None, dtype="bfloat16", device="cpu", memory_gib=4, quantization="none", enable_mtp=False)
    assert dense.weight_bytes == 134_515_008 * 2


def test_config_only_folder_and_path(seed_config, tmp_path):
    folder = tmp_path / "only-config"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(SEED | {"quantization_config": {"quant_method": "awq", "group_size": 64}})
    )
    p = planned(str(folder), dtype="float16", memory_gib=48, max_model_len=4096)
    assert p.quantization == "awq" and p.kv_bytes_per_token == 327_680
    assert p.weight_bytes == planner.weight_bytes(ModelConfig.from_dict(SEED), "awq", 2, group_size=64)
    with pytest.raises(ConfigError, match="exceeds the model's context"):
        planned(seed_config, memory_gib=24, max_model_len=200_000)
    with pytest.raises(ConfigError, match=".gguf"):
        planned(seed_config, memory_gib=24, quantization="gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_parameter_count_matches_the_built_model(tiny_model_dir, arch):
    mc = ModelConfig.from_folder(tiny_model_dir(arch))
    built = get_model_class(mc.architecture)(mc, dtype=torch.float32, device="meta")
    assert planner.num_parameters(mc) == count_parameters(built)


def test_too_small_names_the_largest_max_model_len():
    pool = planner.kv_pool(10 * 16 * 23_040, 16 * 23_040, 16)
    assert pool.num_blocks == 10 and pool.tokens == 160
    planner.check_fits(pool, 160, "--kv-cache-memory")
    with pytest.raises(KVCacheTooSmallError, match="largest max-model-len that fits is 160"):
        planner.check_fits(pool, 161, "--kv-cache-memory")


def test_cli_table_and_json(seed_config, capsys):
    assert main(["plan", seed_config, "--dtype", "float16", "--memory", "200", "--max-model-len", "50000"]) == 0
    out = capsys.readouterr().out
    assert "327,680 B = 2 x 80 layers x 8 kv heads x 128 head_dim x 2 B" in out
    assert "16.38 GB" in out and "50,000 tokens" in out and "fits" in out
    assert (
        main(["plan", seed_config, "--dtype", "float16", "--memory", "200", "--kv-cache-dtype", "fp8", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 163_840 and data["kv_cache_dtype"] == "fp8"
    assert main(["plan", seed_config, "--dtype", "float16", "--memory", "160", "--max-model-len", "131072"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["plan", seed_config, "--max-model-len", "999999", "--memory", "8"]) == 2  # a user error, no traceback


QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "max_position_embeddings": 262144,
    "rope_theta": 1e7,
    "torch_dtype": "bfloat16",
}


def test_hybrid_plan_counts_attention_kv_and_the_recurrent_state(tmp_path, capsys):
    """Qwen3-Next-80B-A3B's published shape: 12 of 48 layers keep KV; a sequence's state (36 linear
    layers x 32 heads x 128 x 128 fp32 + the bf16 conv window) is ~74 MiB (hybrid.md); 79.7 B parameters."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT_80B))
    p = planned(str(tmp_path), memory_gib=256, max_model_len=32768, dtype="bfloat16", device="cpu")
    assert p.kv_layers == 12 and p.kv_bytes_per_token == 2 * 12 * 2 * 256 * 2
    assert p.state_bytes_per_seq == 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    assert round(p.state_bytes_per_seq / 2**20) == 74
    assert abs(p.num_parameters / 1e9 - 79.67) < 0.01
    assert p.state_slots == 3 * 16 and p.fits
    main(
        ["plan", str(tmp_path), "--memory", "256", "--max-model-len", "32768", "--dtype", "bfloat16", "--device", "cpu"]
    )
    out = capsys.readouterr().out
    assert "recurrent state" in out and "sequences that fit" in out
    tiny = planned(str(tmp_path), memory_gib=150.5, max_model_len=32768, dtype="bfloat16", device="cpu")
    assert not tiny.fits  # the weights leave less than the states need


def release_qwen4_config(path) -> str:
    """Qwen3.8-Flash-Next's released config.json (../shared/research/qwen4exp.md section 1), written out."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    text = dict(
        model_type="qwen4_exp_text", hidden_size=2560, num_hidden_layers=48, vocab_size=248320, layer_types=types,
        num_attention_heads=24, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=640, shared_expert_intermediate_size=640,
        norm_topk_prob=True, hc_count=4, hc_lowrank=320, ple_layer_ids=[2], ple_embed_dim=2560,
        ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000,
        make_ngram_vocab_size_divisible_by=128, split_ngram_parts=128, seed=1234, indexer_n_heads=4,
        indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        rope_parameters=dict(
            rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
            mrope_interleaved=True,
        ),
        max_position_embeddings=262144, output_gate_type="sigmoid", hidden_act="silu", rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=248044, mtp_num_hidden_layers=1, torch_dtype="bfloat16",
    )  # fmt: skip
    cfg = dict(architectures=["Qwen4ExpForConditionalGeneration"], model_type="qwen4_exp", text_config=text)
    (path / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "bfloat16"}))
    return str(path / "config.json")


def test_the_released_qwen4_exp_on_a_24_gb_card(tmp_path):
    """The research's figures for the release (qwen4exp.md sections 1 and 8): 125.7B weights (251 GB bf16), of
    which the routed experts all but 9.9 GB; the n-gram table 95.4 GiB left in the file; 24 KiB of KV and
    3 KiB of indexer keys a token; 115.6 MB of state a sequence (GDN, conv windows, PLE window and ids).
    A 24 GB card holds the rest beside the experts, and the plan says so."""
    p = planner.plan(
        EngineConfig(model=release_qwen4_config(tmp_path), device="cuda", max_model_len=32768, max_num_seqs=4),
        memory_gib=24,
    )
    assert p.weight_bytes == pytest.approx(251.5e9, rel=0.002)
    assert p.weight_bytes - p.expert_weight_bytes == pytest.approx(9.9e9, rel=0.01)
    assert p.mapped_weight_bytes == 320_001_536 * 160 * 2
    assert p.kv_bytes_per_token == 24 * 1024 + 3 * 1024
    assert p.state_bytes_per_seq == pytest.approx(115.6e6, rel=0.001)
    text = planner.format_plan(p)
    assert "read by row from the file" in text
    assert 0 < p.n_cpu_moe_to_fit < 48 and f"fits the model with --n-cpu-moe {p.n_cpu_moe_to_fit}" in text


def release_plan(tmp_path, card_gib: float, host_gib: float, **flags) -> planner.Plan:
    config = EngineConfig(
        model=release_qwen4_config(tmp_path), device="cuda", max_model_len=32768, max_num_seqs=4, **flags
    )
    return planner.plan(config, memory_gib=card_gib, host_memory_gib=host_gib)


def test_the_release_on_24_and_32_gb_cards_with_its_experts_in_host_memory(tmp_path):
    """The release at ~4 bits (the AWQ what-if: 0.52 B a weight, as the Q4 files users run) on the common target,
    a 24-32 GB card and 64-128 GB of RAM (qwen4exp.md section 8): with --cpu-moe the card holds 2.7 GB of weights
    and the rest of its budget goes to KV and the hot-expert cache; 128 GB of RAM holds the 64.7 GB of experts,
    64 GB does not (it needs ~2-bit experts); a 32 GB card takes 14 of the 48 MoE layers' experts itself."""
    p = release_plan(tmp_path, 24, 128, quantization="awq", cpu_moe=True)
    assert p.fits and p.host_fits and (p.moe_layers, p.host_moe_layers) == (48, 48)
    assert p.host_expert_bytes == pytest.approx(64.7e9, rel=0.01)
    assert p.weight_bytes - p.expert_weight_bytes == pytest.approx(2.65e9, rel=0.01)
    assert p.hot_cache_bytes > 10e9 and p.pool_tokens >= 4 * 32768
    text = planner.format_plan(p)
    assert "experts in host memory" in text and "holds them" in text and "hot-expert cache" in text

    small_host = release_plan(tmp_path, 24, 64, quantization="awq", cpu_moe=True)
    assert not small_host.host_fits and not small_host.fits
    assert "CANNOT hold them" in planner.format_plan(small_host)

    card32 = release_plan(tmp_path, 32, 128, quantization="awq")
    n = card32.n_cpu_moe_to_fit
    assert not card32.fits and 30 <= n < 48
    assert release_plan(tmp_path, 32, 128, quantization="awq", n_cpu_moe=n).fits
    assert not release_plan(tmp_path, 32, 128, quantization="awq", n_cpu_moe=n - 1).fits

    bf16 = release_plan(tmp_path, 24, 128, cpu_moe=True)  # 241.6 GB of bf16 experts: no host holds them
    assert not bf16.host_fits and bf16.host_expert_bytes == pytest.approx(241.6e9, rel=0.01)


def test_cli_plans_the_host_side_with_llama_cpps_flag(tmp_path, capsys):
    path = release_qwen4_config(tmp_path)
    args = ["plan", path, "--device", "cuda", "--memory", "32", "--host-memory", "128", "--quantization", "awq"]
    args += ["--max-model-len", "32768", "--max-num-seqs", "4"]
    assert main([*args, "-ncmoe", "40", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["host_moe_layers"], p["moe_layers"], p["host_fits"], p["fits"]) == (40, 48, True, True)


def test_a_gguf_files_host_experts_are_its_own_expert_tensors(tmp_path):
    """--n-cpu-moe 1 on a GGUF: the host holds blk.0's three _exps tensors at their file bytes, the CPU peak RSS
    counts them as mapped (whole) and leaves them out of the resident weights; a hot cache asked for on CPU is
    a part of its own."""
    from gguf import GGUFReader

    from tests.models.tiny_moe_gguf import tiny_moe_gguf

    path = tiny_moe_gguf(str(tmp_path / "moe.gguf"))
    exps = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors if "_exps" in t.name}
    layer0 = sum(v for k, v in exps.items() if k.startswith("blk.0."))
    flags = dict(model=path, device="cpu", kv_cache_memory=0.02, max_model_len=256, executor="eager")
    whole = planner.plan(EngineConfig(**flags))
    split = planner.plan(EngineConfig(n_cpu_moe=1, moe_hot_cache_memory=0.001, **flags))
    assert (split.moe_layers, split.host_moe_layers, split.host_expert_bytes) == (2, 1, layer0)
    assert split.peak_rss_parts["mapped experts"] == layer0 and split.peak_rss_parts["hot cache"] == 2**30 // 1000
    assert split.peak_rss_parts["weights"] < whole.peak_rss_parts["weights"]
    assert not whole.host_moe_layers and "mapped experts" not in planner.format_plan(whole)
