"""Routed experts kept as views of the checkpoint's mapping (ember.quant.mapped_experts): a GGUF layer's experts
are slices of its 3-D tensors in the file's map (nothing copied, the layer's tensor one view again), a
folder's and a BF16 GGUF's float views likewise, and an expert computed from them equals the dense reference
built from gguf-py's dequantizer and the resident GGUF experts' output."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from ember.kernels.cpu_kernels import CpuKernels
from ember.loader.gguf import GGUFCheckpoint
from ember.loader.mapped_safetensors import MappedSafetensors
from ember.loader.model_loader import resident_weight_bytes
from ember.quant import process_weights_after_loading
from ember.quant.gguf_quant import GGUFExperts
from ember.quant.mapped_experts import MappedExperts
from tests.models.tiny_models import one_thread  # noqa: F401 (fixture)
from tests.models.tiny_moe_gguf import tiny_moe_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

E, H, I = 4, 256, 256
REFERENCE = CpuKernels(block_gemv=False)  # the storage's own reference: each chosen expert dequantized alone
PREFIX = "model.layers.0.mlp.experts."


def load_layer(path: str, experts) -> GGUFCheckpoint:
    """Layer 0's expert tensors of the file into `experts`, as the loader hands them to a host layer."""
    ck = GGUFCheckpoint(path)
    for name, t in ck.iter_weights(packed=True, mapped=lambda n: n.startswith(PREFIX)):
        if name.startswith(PREFIX):
            experts.load_weight(name.removeprefix(PREFIX), t)
    experts.quant_method.process_weights_after_loading(experts)
    return ck


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    path = tiny_moe_gguf(str(tmp_path_factory.mktemp("mapped") / "moe.gguf"), layers=1, experts=E)
    experts = MappedExperts(E, H, I, torch.float32, REFERENCE)
    return path, experts, load_layer(path, experts)


def reference(path: str, kind: str) -> torch.Tensor:
    """blk.0.ffn_{kind}_exps dequantized whole by gguf-py: [E, rows, cols] float32."""
    t = next(t for t in GGUFCheckpoint(path)._reader.tensors if t.name == f"blk.0.ffn_{kind}_exps.weight")
    return torch.from_numpy(np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).copy())


def swiglu(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def test_gguf_experts_stay_views_of_the_files_map(quantized):
    path, experts, ck = quantized
    mm = ck._reader.data  # the reader's map of the whole file
    lo, hi = mm.ctypes.data, mm.ctypes.data + mm.nbytes
    assert experts.types() == {"gate": "Q8_0", "up": "Q4_K", "down": "Q6_K"}
    for m in experts.matrices.values():
        stacked = m.stacked()
        assert stacked is not None and stacked.shape[0] == E  # the layer's 3-D tensor, one view
        for e, v in enumerate(m.views):
            assert lo <= v.data_ptr() < hi and v.data_ptr() == stacked[e].data_ptr()
    assert resident_weight_bytes(experts) == 0  # placeholders only: nothing held resident
    file_bytes = sum(t.n_bytes for t in ck._reader.tensors if "_exps" in t.name)
    assert experts.mapped_expert_bytes() == file_bytes
    assert experts.expert_bytes * E == file_bytes


def test_an_expert_computes_from_its_blocks_as_gguf_pys_values_do(quantized):
    path, experts, _ = quantized
    gate, up, down = (reference(path, k) for k in ("gate", "up", "down"))
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    for e in range(E):
        got = experts.expert_forward(e, x)
        torch.testing.assert_close(got, swiglu(x, gate[e], up[e], down[e]), rtol=1e-5, atol=1e-5)
        w13, w2 = experts.dense_expert(e, torch.float32)
        assert torch.equal(w13, torch.cat([gate[e], up[e]])) and torch.equal(w2, down[e])


def test_routed_forward_equals_the_resident_experts(quantized):
    """The grouped forward over mapped experts against GGUFExperts (packed at load, resident) on one routing:
    both without the block kernel (its path: test_the_block_kernel_runs_the_mapped_blocks), so the resident
    experts are tiled parts over float x and the mapped ones gguf-py's values."""
    path, experts, _ = quantized
    resident = GGUFExperts(E, H, I, torch.float32, kernels=REFERENCE)
    ck = GGUFCheckpoint(path)
    for name, t in ck.iter_weights(packed=True):
        if name.startswith(PREFIX):
            resident.load_weight(name.removeprefix(PREFIX), t)
    resident.pack()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, H, generator=g)
    ids = torch.randint(0, E, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    want = resident(x, ids, w)
    torch.testing.assert_close(experts(x, ids, w), want, rtol=0, atol=2e-3 * float(want.abs().max()))


def test_the_block_kernel_runs_the_mapped_blocks(quantized):
    """With the block kernels (the default where they build): one block_moe call over the layer's three stacked
    views, and one expert alone through the block GEMV, as the kernel's own reference computes them (x and h
    rounded to int8 per block as llama.cpp rounds them: tests/kernels/test_cpu_block_gemv.py)."""
    from tests.kernels.test_cpu_block_gemv import moe_reference

    path, _, _ = quantized
    experts = MappedExperts(E, H, I, torch.float32)
    load_layer(path, experts)
    assert experts.block
    weights = tuple(reference(path, k).double() for k in ("gate", "up", "down"))
    types = tuple(experts.matrices[k].qtype for k in ("gate", "up", "down"))
    g = torch.Generator().manual_seed(4)
    x, ids, w = torch.randn(6, H, generator=g), torch.randint(0, E, (6, 2), generator=g), torch.rand(6, 2, generator=g)
    ref = moe_reference(x, ids, w, weights, types)
    tol = 2e-3 * float(ref.abs().max())  # h's rounding may land a code on the other side of a tie
    assert (experts(x, ids, w).double() - ref).abs().max() <= tol
    one = moe_reference(x, torch.full((6, 1), 2), torch.ones(6, 1), weights, types)
    assert (experts.expert_forward(2, x).double() - one).abs().max() <= 2e-3 * float(one.abs().max())


def test_bf16_gguf_experts_are_float_views(tmp_path):
    path = tiny_moe_gguf(str(tmp_path / "bf16.gguf"), layers=1, experts=E, expert_types=(T.BF16, T.BF16, T.BF16))
    experts = MappedExperts(E, H, I, torch.float32)
    ck = load_layer(path, experts)
    mm = ck._reader.data
    for m in experts.matrices.values():
        assert m.qtype is None and m.views[0].dtype == torch.bfloat16
        assert mm.ctypes.data <= m.views[-1].data_ptr() < mm.ctypes.data + mm.nbytes
    gate, up, down = (reference(path, k) for k in ("gate", "up", "down"))
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(2))
    # the half GEMV widens in registers: float32 products, its own summation order
    torch.testing.assert_close(experts.expert_forward(1, x), swiglu(x, gate[1], up[1], down[1]), rtol=1e-4, atol=1e-4)


def test_a_folders_fused_experts_are_views_of_its_mapping(tmp_path):
    """transformers 5's fused gate_up_proj [E, 2I, H] / down_proj [E, H, I] in a safetensors file: each expert a
    view of MappedSafetensors' map, the layer one strided view; per-expert names load the same."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(E, 2 * 64, 64, generator=g) * 0.1).bfloat16()
    down = (torch.randn(E, 64, 64, generator=g) * 0.1).bfloat16()
    save_file({"gate_up_proj": gate_up, "down_proj": down}, str(tmp_path / "e.safetensors"))
    mapped = MappedSafetensors(str(tmp_path / "e.safetensors"))
    fused, per = MappedExperts(E, 64, 64, torch.float32), MappedExperts(E, 64, 64, torch.float32)
    fused.load_weight("gate_up_proj", mapped.get("gate_up_proj"))
    fused.load_weight("down_proj", mapped.get("down_proj"))
    for e in range(E):
        per.load_weight(f"{e}.gate_proj.weight", gate_up[e, :64])
        per.load_weight(f"{e}.up_proj.weight", gate_up[e, 64:])
        per.load_weight(f"{e}.down_proj.weight", down[e])
    process_weights_after_loading(fused)
    process_weights_after_loading(per)
    assert fused.matrices["down"].stacked() is not None and fused.mapped_expert_bytes() == 3 * E * 64 * 64 * 2
    x = torch.randn(3, 64, generator=g)
    for e in range(E):
        want = swiglu(x, gate_up[e, :64].float(), gate_up[e, 64:].float(), down[e].float())
        torch.testing.assert_close(fused.expert_forward(e, x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(per.expert_forward(e, x), want, rtol=1e-5, atol=1e-5)
    assert os.path.getsize(tmp_path / "e.safetensors") > fused.mapped_expert_bytes()
