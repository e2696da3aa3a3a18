"""Checkpoint loading: sharded folders, tied heads, and the errors a broken folder must raise."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.config.architectures import ARCHITECTURES, GGUF_ARCHITECTURES
from ember.config.model_config import ModelConfig
from ember.errors import ModelLoadError, UnsupportedModelError
from ember.loader.weights import iter_safetensors
from ember.models.registry import get_model_class
from tests.models.tiny_models import (
    PagedDriver,
    Seq,
    build_hf_model,
    load_ember_model,
    one_thread,
    random_prompt,
    save_hf_model,
)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.fixture(scope="module")
def qwen3_moe_folders(tmp_path_factory):
    hf = build_hf_model("qwen3_moe")
    single = save_hf_model(hf, str(tmp_path_factory.mktemp("single")))
    sharded = save_hf_model(hf, str(tmp_path_factory.mktemp("sharded")), max_shard_size="100KB")
    return single, sharded


def test_sharded_checkpoint_loads_identically(qwen3_moe_folders):
    single, sharded = qwen3_moe_folders
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 2
    names_single = {n for n, _ in iter_safetensors(single, progress=False)}
    names_sharded = {n for n, _ in iter_safetensors(sharded, progress=False)}
    assert names_single == names_sharded
    ids = random_prompt(9, 3)
    outs = [PagedDriver(load_ember_model(p)).step([(Seq(ids, 0), len(ids))])[0] for p in (single, sharded)]
    assert torch.equal(outs[0], outs[1])


def test_load_weights_reports_loaded_params(qwen3_moe_folders):
    folder = qwen3_moe_folders[0]
    cfg = ModelConfig.from_folder(folder)
    model = get_model_class(cfg.architecture)(cfg, dtype=torch.bfloat16, device=torch.device("cpu"))
    loaded = model.load_weights(iter_safetensors(folder, progress=False))
    assert loaded == {n for n, _ in model.named_parameters()}
    assert "model.layers.0.mlp.experts.w13" in loaded and "model.layers.1.mlp.gate_up_proj.weight" in loaded
    assert model.model.layers[0].mlp.experts.w13.dtype == torch.bfloat16
    # Extra checkpoint tensors (rotary caches of old exports) are ignored.
    model.load_weights(
        [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8)), ("foo.bar", torch.zeros(1))]
        + list(iter_safetensors(folder, progress=False))
    )


def test_tied_head_needs_no_lm_head(tmp_path):
    folder = save_hf_model(build_hf_model("qwen2"), str(tmp_path))
    names = {n for n, _ in iter_safetensors(folder, progress=False)}
    assert "lm_head.weight" not in names
    model = load_ember_model(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_weight_is_named(tmp_path):
    folder = save_hf_model(build_hf_model("qwen2"), str(tmp_path))
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    del tensors["model.norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as e:
        load_ember_model(folder)
    assert "model.norm.weight" in str(e.value)
    assert "model.layers.1.self_attn.qkv_proj.bias (shards ['k'])" in str(e.value)


def test_wrong_shape_is_reported(tmp_path):
    folder = save_hf_model(build_hf_model("qwen2"), str(tmp_path))
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg["intermediate_size"] = 96
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(ModelLoadError, match="does not match its config.json"):
        load_ember_model(folder)


def test_truncated_safetensors_raises_model_load_error(tmp_path):
    folder = save_hf_model(build_hf_model("qwen2"), str(tmp_path))
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors.*truncated"):
        next(iter(iter_safetensors(folder, progress=False)))


def test_missing_shard_raises_model_load_error(qwen3_moe_folders, tmp_path):
    sharded = qwen3_moe_folders[1]
    for f in os.listdir(sharded):
        os.link(os.path.join(sharded, f), tmp_path / f)
    victim = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[1]
    os.remove(tmp_path / victim)
    with pytest.raises(ModelLoadError, match=victim):
        next(iter(iter_safetensors(str(tmp_path), progress=False)))


def test_empty_folder_raises(tmp_path):
    with pytest.raises(ModelLoadError, match="no .safetensors"):
        list(iter_safetensors(str(tmp_path)))


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedModelError) as e:
        get_model_class("MistralForCausalLM")
    for arch in ARCHITECTURES:
        assert arch in str(e.value)
    for arch in ARCHITECTURES:
        assert get_model_class(arch).__name__ == arch


def test_the_architecture_table_is_the_only_list():
    """One row per architecture (ember.config.architectures): GGUF names are unique and come with the
    model_type their metadata becomes, and no other module of the engine names an architecture in
    its code (a trait is a column of the table, not a test of the class name)."""
    assert len(GGUF_ARCHITECTURES) == sum(a.gguf is not None for a in ARCHITECTURES.values())
    for row in ARCHITECTURES.values():
        assert (row.gguf is None) == (row.gguf_model_type is None), row.name
        assert row.moe or not row.all_layers_moe, row.name
    quoted = re.compile(r"[\"'](%s)[\"']" % "|".join(ARCHITECTURES))
    ember = Path(__file__).resolve().parents[2] / "ember"
    for path in ember.rglob("*.py"):
        if path.name == "architectures.py" or "bench" in path.relative_to(ember).parts:
            continue  # the table itself; bench writes random models of a named architecture
        hits = [line for line in path.read_text().splitlines() if quoted.search(line.split("#")[0])]
        assert not hits, f"{path} names an architecture in its code: {hits}"
