"""The PLE gate-and-conv CPU kernel (ember/kernels/cpu_ple.*) against the layer's torch form
(PLELayer.mix_reference): several sequences of several tokens (the conv reaches into the carried window and
into the step's own earlier tokens), widths that leave a vector tail, float32 and bf16, traced by
torch.compile, bad input refused, and the AVX2 build (-march=haswell) run through this module on an AVX-512
machine."""

from __future__ import annotations

import pytest
import torch

from ember.config.model_config import PLEConfig
from ember.kernels import cpp_build, cpu_ple
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.ple import PLELayer
from tests.kernels import avx2_child

pytestmark = pytest.mark.skipif(
    not (cpp_build.has_cpu_flags("avx512f") or cpp_build.has_cpu_flags("avx2", "fma")),
    reason="the PLE kernel needs AVX-512 or AVX2 + FMA",
)

# (hidden, streams, conv taps, n-gram size): a tiny model's; a hidden of 20 (a tail of 4 lanes under AVX2,
# all tail under AVX-512) with 3 streams and a 2-tap conv of dilation 4
SHAPES = [(64, 4, 4, 3), (20, 3, 2, 4)]


@pytest.fixture(autouse=True, scope="module")
def built():
    assert cpu_ple.available()  # loaded (built once where it was not): its op is there


def layer(hidden: int, streams: int, taps: int, ngram: int, dtype, seed: int = 0) -> PLELayer:
    cfg = PLEConfig((0,), 2 * hidden, taps, ngram, 1, 1000, 128, 1234, 1)
    ple = PLELayer(cfg, 512, hidden, streams, 1e-6, 0, dtype, "cpu", CpuKernels.none())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ple.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return ple


def inputs(ple: PLELayer, B: int, n: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    W, H, window = ple.hidden * ple.count, ple.hidden, ple.cfg.conv_window

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 2).to(dtype)

    return rand(B * n, W), rand(B * n, W), rand(B * n, H), rand(B, window, W)


def kernel(ple: PLELayer, x, kp, v, window0):
    return cpu_ple.ple_mix(
        x,
        kp,
        v,
        ple.norm_key.weight,
        ple.norm_query.weight,
        ple.norm_conv.weight,
        ple.conv_weight,
        window0,
        ple.norm_key.eps,
        ple.cfg.ngram_size,
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_torch_form(shape, dtype):
    ple = layer(*shape, dtype)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=0.02)
    for B, n in [(1, 1), (3, 1), (2, 5)]:  # decodes; prefill chunks long enough to reach their own tokens
        x, kp, v, window0 = inputs(ple, B, n, dtype, seed=B * 10 + n)
        out, columns = kernel(ple, x, kp, v, window0)
        ref_out, ref_columns = ple.mix_reference(x, kp, v, window0, n)
        assert out.dtype == columns.dtype == dtype and columns.shape == ref_columns.shape
        torch.testing.assert_close(columns.float(), ref_columns.float(), **tol)
        torch.testing.assert_close(out.float(), ref_out.float(), **tol)
        assert torch.equal(columns[:, : window0.shape[1]], window0)  # the carried columns, as they came


def test_the_layer_takes_the_kernel_where_it_is_on():
    ple = layer(*SHAPES[0], torch.float32)
    ple.cpu_kernel = True
    x, kp, v, window0 = inputs(ple, 2, 3, torch.float32, seed=1)
    calls = []
    real = cpu_ple.ple_mix
    cpu_ple.ple_mix = lambda *a: calls.append(1) or real(*a)
    try:
        out, _ = ple.mix(x, kp, v, window0, 3)
        ple.cpu_kernel = False  # CpuKernels.none(): the torch form
        ple.mix(x, kp, v, window0, 3)
    finally:
        cpu_ple.ple_mix = real
    assert calls == [1]
    torch.testing.assert_close(out, ple.mix_reference(x, kp, v, window0, 3)[0], atol=2e-5, rtol=2e-5)


def test_traced_by_torch_compile():
    ple = layer(*SHAPES[1], torch.float32)
    x, kp, v, window0 = inputs(ple, 2, 1, torch.float32, seed=2)
    fn = torch.compile(lambda *a: kernel(ple, *a), fullgraph=True, backend="aot_eager")
    out, columns = fn(x, kp, v, window0)
    ref_out, ref_columns = kernel(ple, x, kp, v, window0)
    assert torch.equal(out, ref_out) and torch.equal(columns, ref_columns)


def test_bad_input_is_refused():
    ple = layer(*SHAPES[0], torch.float32)
    x, kp, v, window0 = inputs(ple, 2, 1, torch.float32, seed=3)
    with pytest.raises(RuntimeError, match="window0 must carry"):
        kernel(ple, x, kp, v, window0[:, 1:])
    with pytest.raises(RuntimeError, match="kp must be"):
        kernel(ple, x, kp[:, :-1], v, window0)
    with pytest.raises(RuntimeError, match="B sequences"):
        kernel(ple, *(torch.cat([t, t[:1]]) for t in (x, kp, v)), window0)  # 3 rows, 2 sequences


@pytest.mark.slow
def test_avx2_build_passes_this_module():
    """Where this machine has AVX-512 the kernel is its 16-lane build; the 8-lane AVX2 + FMA build is
    compiled here with -march=haswell and this module's other tests run against it in a child process."""
    if not cpp_build.has_cpu_flags("avx512f"):
        pytest.skip("this machine's own build is the AVX2 one")
    env = avx2_child.build(cpu_ple.SOURCE)
    lanes = (
        "import torch; from ember.kernels import cpu_ple as p; p.available(); print(torch.ops.ember_cpu.ple_lanes())"
    )
    said, run = avx2_child.probe_and_run(env, lanes, __file__, masked=False)
    assert said == ["8"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
