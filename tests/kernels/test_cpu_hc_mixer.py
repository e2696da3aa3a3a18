"""The C++ hyper-connection mixer (ember/kernels/cpu_hc_mixer.*, as HyperConnection runs it) against the layer's
torch path (the reference): odd widths, 2-4 streams, low ranks of 5-24, with and without inject weights (the final
mixer), float32 and bf16 activations, float32 / bf16 matrices (a bf16 matrix under float32 activations is a BF16
GGUF file's), decode rows and a tile's worth (the fused kernel) and prefill rows (its norm / gated-mean ends around
the layer's GEMMs), packed Q8_0 GGUF projections (the ends around their parts); the kernel stays out of tensor
parallel fused paths and out of autograd; bad shapes refused; and the AVX2 build (-march=haswell) run through this
module on an AVX-512 machine."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, quantize

from ember.kernels import cpu_hc_mixer
from ember.kernels.cpp_build import has_cpu_flags
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.hyper_connection import HyperConnection
from ember.quant.gguf_blocks import GGUFTensor
from ember.quant.gguf_quant import GGUFLinearMethod
from tests.kernels import avx2_child

pytestmark = pytest.mark.skipif(
    not (has_cpu_flags("avx512f") or has_cpu_flags("avx2", "fma")), reason="the kernel needs AVX-512 or AVX2 + FMA"
)
PROJECTIONS = ("input_mix_weight_down", "input_mix_weight_up", "block_inject_weight")
ROWS = [1, 7, cpu_hc_mixer.FUSED_MAX_ROWS, cpu_hc_mixer.FUSED_MAX_ROWS + 29]  # decode, fused tiles, prefill


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_hc_mixer.available()


def random_weights(H: int, n: int, L: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hc_norm": torch.randn(n * H, generator=g) * 0.3,
        "input_mix_weight_down": torch.randn(L, n * H, generator=g) * (n * H) ** -0.5 * 2,
        "input_mix_weight_up": torch.randn(n * H, L, generator=g) * L**-0.5 * 2,
        "block_inject_weight": torch.randn(n, n * H, generator=g) * (n * H) ** -0.5 * 2,
    }


def mixer(H, n, L, inject, dtype, weights, cpu_kernel, held="dense") -> HyperConnection:
    """A mixer of `weights` in a `dtype` run, its matrices held as `held` says: dense (the run's dtype), bf16 (a
    BF16 GGUF file's HalfPart under float32) or q8_0 (a Q8_0 GGUF file's packed parts)."""
    method = (lambda name: None) if held == "dense" else (lambda name: GGUFLinearMethod(CpuKernels()))
    hc = HyperConnection(H, n, L, 1e-6, dtype, "cpu", inject, method, cpu_kernel=cpu_kernel)
    with torch.no_grad():
        hc.hc_norm.weight.copy_(weights["hc_norm"])
        for name in PROJECTIONS[: 3 if inject else 2]:
            lin, w = getattr(hc, name), weights[name]
            if held == "dense":
                lin.weight.copy_(w)
                continue
            if held == "bf16":
                lin.load_weight("weight", w.to(torch.bfloat16))
            else:
                raw = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q8_0))
                lin.load_weight("weight", GGUFTensor(GGMLQuantizationType.Q8_0, raw, tuple(w.shape)))
            lin.quant_method.process_weights_after_loading(lin)
    return hc


def check(hc_kernel: HyperConnection, hc_torch: HyperConnection, X: torch.Tensor) -> None:
    with torch.no_grad():
        got, want = hc_kernel(X), hc_torch(X)
    if hc_torch.block_inject_weight is None:
        got, want = (got,), (want,)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == X.dtype and a.shape == b.shape
        if X.dtype == torch.bfloat16:  # the torch path rounds every intermediate to bf16, the kernel only its outputs
            torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=2e-2)
        else:
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, n, L, inject", [(40, 3, 5, True), (64, 4, 16, True), (72, 2, 9, False), (36, 4, 24, True)])
def test_the_mixer_is_the_torch_paths(H, n, L, inject, dtype):
    weights = random_weights(H, n, L, seed=H + n + L)
    hc_kernel = mixer(H, n, L, inject, dtype, weights, True)
    hc_torch = mixer(H, n, L, inject, dtype, weights, False)
    assert hc_kernel.plain_weights() is not None  # the fused kernel up to FUSED_MAX_ROWS rows
    g = torch.Generator().manual_seed(1)
    for T in ROWS:
        check(hc_kernel, hc_torch, (torch.randn(T, n * H, generator=g) * 3).to(dtype))


@pytest.mark.parametrize("held", ["bf16", "q8_0"])
def test_gguf_projections(held):
    """A BF16 file's matrices stay bf16 under float32 activations (fused, W bf16); a Q8_0 file's are packed
    parts (the kernel's two ends around them, at every row count)."""
    H, n, L = 48, 4, 32
    weights = random_weights(H, n, L, seed=5)
    hc_kernel = mixer(H, n, L, True, torch.float32, weights, True, held)
    hc_torch = mixer(H, n, L, True, torch.float32, weights, False, held)
    plain = hc_kernel.plain_weights()
    assert (plain is not None and plain[0].dtype == torch.bfloat16) if held == "bf16" else plain is None
    g = torch.Generator().manual_seed(2)
    for T in ROWS:
        check(hc_kernel, hc_torch, torch.randn(T, n * H, generator=g))


def test_tensor_parallel_and_autograd_keep_their_paths(monkeypatch):
    weights = random_weights(32, 4, 8, seed=3)
    hc = mixer(32, 4, 8, True, torch.float32, weights, True)
    monkeypatch.setattr(hc.input_mix_weight_down, "tp_size", 2)
    assert hc.plain_weights() is None  # a rank holds a slice of the down matrix: the ends only
    monkeypatch.undo()
    hc.input_mix_weight_up.weight.requires_grad_(True)  # ember.train.mtp: the torch path, differentiable
    x, _ = hc(torch.randn(3, 128))
    assert x.grad_fn is not None


def test_bad_shapes_are_refused():
    X, gamma = torch.randn(2, 96), torch.randn(96)
    down, up, inj = torch.randn(8, 96), torch.randn(96, 8), torch.randn(4, 96)
    with pytest.raises(RuntimeError, match="is not 5 streams"):
        torch.ops.ember_cpu.hc_mix(X, gamma, 1e-6, 5, down, up, inj)
    with pytest.raises(RuntimeError, match="w_up must be contiguous"):
        torch.ops.ember_cpu.hc_mix(X, gamma, 1e-6, 4, down, up[:, :7].contiguous(), inj)
    with pytest.raises(RuntimeError, match="all be float32 or all bf16"):
        torch.ops.ember_cpu.hc_mix(X, gamma, 1e-6, 4, down, up.bfloat16(), inj)
    with pytest.raises(RuntimeError, match="gamma must be"):
        torch.ops.ember_cpu.hc_norm(X, gamma[:50].contiguous(), 1e-6, 4)
    assert not cpu_hc_mixer.applies(X.half())  # fp16 activations: the torch path


def test_the_build_is_this_cpus():
    """16 lanes where the CPU has AVX-512, else the AVX2 build's 8 (in the AVX2 child run below too)."""
    assert torch.ops.ember_cpu.hc_mixer_lanes() == (16 if has_cpu_flags("avx512f") else 8)


@pytest.mark.slow
def test_avx2_build_passes_this_module():
    """Where this machine's build is the AVX-512 one, the AVX2 build (-march=haswell) runs this module's other
    tests in a child process that reads the CPU flags as such a machine's (tests/kernels/avx2_child.py)."""
    if not has_cpu_flags("avx512f"):
        pytest.skip("this machine's own build is the AVX2 one")
    # test_gguf_projections' parts: Q8_0 through the tiled GEMV, BF16 through the half GEMV
    env = avx2_child.build("cpu_hc_mixer.cpp", also=("cpu_tiled_gemv.cpp", "cpu_half_gemv.cpp"))
    probe = "import torch; from ember.kernels import cpu_hc_mixer as k; k.available(); "
    probe += "print(torch.ops.ember_cpu.hc_mixer_lanes())"
    said, run = avx2_child.probe_and_run(env, probe, __file__)
    assert said == ["8"]
    ok = run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout  # every test ran
    assert ok, run.stdout[-3000:] + run.stderr[-2000:]
