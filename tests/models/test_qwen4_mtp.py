"""qwen4_exp's MTP layer (ember.models.qwen4_exp.Qwen4ExpMTP) as ember's MTP proposer: the input fusion
equation by equation (SGLang's qwen4_exp_mtp `_fuse_residual_linear_shared`), and speculation with a random
MTP layer giving exactly the tokens of plain decoding (transformers' greedy tokens), past the QSA budget,
chunked and batched. transformers ignores mtp.*, so there is no reference for the drafts themselves."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ember import LLM, SamplingParams
from ember.errors import ModelLoadError
from tests.models.tiny_models import hf_greedy, one_thread  # noqa: F401
from tests.models.tiny_qwen4 import build_qwen4, prompt, save_qwen4

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
GEN = 12


def add_mtp_layer(path: str, seed: int = 0, drop: str | None = None) -> None:
    """Random mtp.* tensors beside the model's, named as the release names them: the input fusion, one
    attention decoder layer shaped like the model's attention layers, the MTP's own final mixer."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(seed)
    cfg = json.load(open(os.path.join(path, "config.json")))
    H, n = cfg["hidden_size"], cfg["hc_count"]
    attn = next(i for i, t in enumerate(cfg["layer_types"]) if t != "linear_attention")
    mtp = {
        "mtp.fc_embedding.weight": torch.randn(H, H, generator=g) / H**0.5,
        "mtp.fc_hidden.weight": torch.randn(H, H, generator=g) / H**0.5,
        "mtp.pre_fc_norm_embedding.weight": torch.randn(H, generator=g) * 0.3,
        "mtp.pre_fc_norm_hidden.weight": torch.randn(n * H, generator=g) * 0.3,
    }
    for name, t in tensors.items():
        for src, dst in (
            (f"model.layers.{attn}.", "mtp.layers.0."),
            ("model.hyper_connection_mixer.", "mtp.hyper_connection_mixer."),
        ):
            if name.startswith(src) and t.is_floating_point():
                mtp[dst + name.removeprefix(src)] = t + torch.randn(
                    t.shape, generator=g, dtype=t.dtype
                ) * t.float().std().clamp_min(0.1)
    if drop:
        mtp.pop(drop)
    save_file(tensors | mtp, file, metadata={"format": "pt"})
    cfg["mtp_num_hidden_layers"] = 1
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = build_qwen4()
    path = save_qwen4(hf, str(tmp_path_factory.mktemp("qwen4-mtp")))
    add_mtp_layer(path)
    prompts = [prompt(150, 1, eos_at=(30, 31)), prompt(20, 2), prompt(90, 3, eos_at=(89,))]
    return hf, path, prompts, [hf_greedy(hf, p, GEN) for p in prompts]


def llm(path, **kw):
    args = dict(dtype="float32", executor="eager", max_model_len=512, kv_cache_memory=0.05, max_num_seqs=4)
    return LLM(path, **(args | kw))


@pytest.mark.parametrize("k,chunk", [(3, 512), (2, 23)])
def test_mtp_speculation_gives_the_plain_tokens(tiny, k, chunk):
    hf, path, prompts, refs = tiny
    engine = llm(path, enable_mtp=True, num_speculative_tokens=k, adaptive_spec=False, max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    stats = engine.engine.stats()
    assert stats["spec_num_drafts"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if k > 1:
        assert stats["spec_num_draft_tokens_per_pos"][k - 1] > 0


def test_the_input_fusion_is_sglangs(tiny):
    """e = fc_embedding(RMS(E)(1 + g_e)); H normed by ONE RMS over its n*H values (1 + g_h); stream s =
    e + fc_hidden(H_s): written out here from the checkpoint's tensors and compared with the module's (dense:
    on CPU the draft's projections are otherwise packed to 8-bit tiles, rtn_tiled)."""
    from safetensors.torch import load_file

    _, path, _, _ = tiny
    engine = llm(path, enable_mtp=True, num_speculative_tokens=1, cpu_tiled_gemv=False)
    mtp = engine.engine.parts.spec.proposer.mtp
    w = {
        k.removeprefix("mtp."): v.float()
        for k, v in load_file(os.path.join(path, "model.safetensors")).items()
        if k.startswith("mtp.")
    }
    E = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"].float()
    H, n = mtp.cfg.hidden_size, mtp.hc_count
    ids = torch.tensor([5, 77, 300])
    resid = torch.randn(3, n * H)

    def rms(x, gamma):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mtp.cfg.rms_norm_eps) * (1 + gamma)

    e = rms(E[ids], w["pre_fc_norm_embedding.weight"]) @ w["fc_embedding.weight"].T
    h = rms(resid, w["pre_fc_norm_hidden.weight"]).view(3, n, H) @ w["fc_hidden.weight"].T
    ours = mtp.fuse(ids, resid)
    assert torch.allclose(ours, (e[:, None, :] + h).flatten(1), atol=1e-5)


def test_a_missing_mtp_tensor_is_named(tmp_path):
    path = save_qwen4(build_qwen4(), str(tmp_path))
    add_mtp_layer(path, drop="mtp.fc_hidden.weight")
    with pytest.raises(ModelLoadError, match="fc_hidden"):
        llm(path, enable_mtp=True, num_speculative_tokens=1)


def test_a_separate_mtp_folder_made_for_another_model_is_refused_by_its_values(tiny, tmp_path):
    """A folder of mtp.* tensors (what train-mtp writes) attaches to any qwen4_exp model of its shape (HF folder or
    GGUF: ember bench flash's MTP row); one whose config.json sizes the layer otherwise is refused before
    any tensor is read, naming the values."""
    from ember.bench.lib.flash_model import build_mtp_folder

    _, path, _, _ = tiny
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump(cfg | {"moe_intermediate_size": 64, "indexer_head_dim": 32}, open(other / "config.json", "w"))
    folder = build_mtp_folder(str(other))
    with pytest.raises(ModelLoadError, match=r"moe_intermediate_size 64 \(the model: 32\), indexer_head_dim 32"):
        llm(path, speculative_config={"method": "mtp", "model": folder, "num_speculative_tokens": 1})
