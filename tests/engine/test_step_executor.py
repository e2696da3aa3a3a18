"""StepExecutor: the padding/bucketing functions, padded fixed-shape steps leaving real rows
alone, and the refusals (cuda-graph on CPU, contradicting flags). Eager vs compiled (torch.compile and
AOTInductor packages) giving the same greedy tokens and logprobs: tests/engine/test_step_executor_dense.py,
_hybrid.py and _mtp.py, one file a theme, so that pytest-xdist's --dist loadfile (`make test`) can run
them on different workers; COMPILE and outputs() here are theirs too."""

from __future__ import annotations

import pytest
import torch

from ember.config import EngineConfig
from ember.engine.executor.base import graph_query_lens, resolve_executor
from ember.engine.executor.decode_batch import (
    bucket_for,
    default_sizes,
    fixed_meta,
    leading,
    pad_decode,
    static_buffers,
    table_width,
    uniform_query_len,
    warmup_inputs,
)
from ember.errors import ConfigError
from ember.kernels.metadata import AttentionMetadata
from ember.kernels.torch_attention import TorchAttentionBackend
from ember.layers.attention import write_kv_cache
from tests.engine.test_engine import make_llm
from tests.models.tiny_models import load_ember_model, one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
# default mode, no C++ wrapper: fastest to compile (test_compiled_with_cpp_wrapper_equals_eager covers the wrapper)
COMPILE = {"compile_sizes": [1, 4], "mode": "default", "freezing": True, "cpp_wrapper": False}


def decode_meta(
    seq_lens: list[int], tables: list[list[int]], slots: list[int], block_size: int = 4, q_len: int = 1
) -> AttentionMetadata:
    B = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32) * q_len,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        block_size=block_size,
        query_lens_cpu=[q_len] * B,
        seq_lens_cpu=seq_lens,
        max_query_len=q_len,
        max_seq_len=max(seq_lens),
        all_slots_valid=True,
    )


# ---- plain functions ----------------------------------------------------------------------------------


def test_sizes_and_buckets():
    assert default_sizes(16) == [1, 2, 4, 8, 16]
    assert default_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_sizes(1) == [1] and default_sizes(3) == [1, 2, 3]
    assert [bucket_for(n, [1, 4]) for n in range(1, 6)] == [1, 4, 4, 4, None]
    assert table_width(1, 16) == 2 and table_width(33, 16) == 3  # never 1: compile would specialise it
    assert uniform_query_len(decode_meta([3, 5], [[1, 2], [3, 4]], [2, 12])) == 1
    mixed = decode_meta([3, 5], [[1, 2], [3, 4]], [2, 12])
    mixed.query_lens_cpu = [1, 3]
    assert uniform_query_len(mixed) is None


def test_pad_decode_appends_inert_rows():
    meta = decode_meta([5, 2, 9], [[7, 3, 0], [4, 0, 0], [1, 2, 6]], [3 * 4 + 0, 4 * 4 + 1, 6 * 4 + 0])
    ids, pos = torch.tensor([11, 12, 13]), torch.tensor([4, 1, 8])
    x = pad_decode(ids, pos, meta, batch=4, width=4)
    assert x.input_ids.tolist() == [11, 12, 13, 0] and x.positions.tolist() == [4, 1, 8, 0]
    assert x.slot_mapping.tolist() == [12, 17, 24, -1]
    assert x.seq_lens.tolist() == [5, 2, 9, 1] and x.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert x.block_tables.tolist() == [[7, 3, 0, 0], [4, 0, 0, 0], [1, 2, 6, 0], [0, 0, 0, 0]]
    m = fixed_meta(x, 1, 4)
    assert m.fixed_shape and m.max_seq_len == 16 and m.num_seqs == 4 and m.seq_lens_cpu == [16] * 4

    # verify-shaped (q_len 3): padding sequences get q_len rows and seq_len q_len
    v = decode_meta([5, 9], [[7, 3], [1, 2]], list(range(6)), q_len=3)
    y = pad_decode(torch.arange(6), torch.arange(6), v, batch=3, width=3)
    assert y.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, -1, -1, -1]
    assert y.seq_lens.tolist() == [5, 9, 3] and y.query_start_loc.tolist() == [0, 3, 6, 9]


def test_static_buffers_take_a_padded_step():
    static = static_buffers(max_batch=8, q_len=1, width=6, device=torch.device("cpu"))
    static.block_tables.fill_(99)  # stale ids past a table's width are never read unmasked
    meta = decode_meta([5, 2, 9], [[7, 3, 0], [4, 0, 0], [1, 2, 6]], [12, 17, 24])
    x = pad_decode(torch.tensor([11, 12, 13]), torch.tensor([4, 1, 8]), meta, batch=4, width=3)
    x.copy_into(static)
    view = leading(static, 4, 1)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
        assert torch.equal(getattr(view, name), getattr(x, name)), name
    assert torch.equal(view.block_tables[:, :3], x.block_tables) and (view.block_tables[:, 3:] == 99).all()
    assert static.slot_mapping[4:].tolist() == [-1] * 4  # rows of larger graphs untouched
    w = warmup_inputs(2, 1, 2, torch.device("cpu"))
    assert w.slot_mapping.tolist() == [0, -1]


def test_fixed_shape_kv_write_skips_padding_rows():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 8, generator=g)
    k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([9, 3, 17, -1, -1])
    ref = cache.clone()
    write_kv_cache(k[:3], v[:3], ref, slots[:3], all_valid=True)
    write_kv_cache(k, v, cache, slots, fixed_shape=True)
    assert torch.equal(cache, ref)


def test_padded_fixed_shape_step_leaves_real_rows_alone(tiny_model_dir):
    """A 3-sequence decode padded to 5 with fixed-shape metadata: same hidden rows, the same K/V in
    the real rows' slots (up to GEMM rounding: 5 rows are not 3), every other slot untouched."""
    model = load_ember_model(tiny_model_dir("llama"))
    cfg, bs = model.cfg, 4
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, 12, bs, cfg.num_kv_heads, cfg.head_dim, generator=g) for _ in range(cfg.num_layers)]
    meta = decode_meta([6, 3, 9], [[2, 5, 0], [7, 0, 0], [1, 4, 8]], [5 * 4 + 1, 7 * 4 + 2, 8 * 4 + 0])
    ids, pos = torch.tensor([17, 400, 9]), torch.tensor([5, 2, 8])
    ref_caches = [c.clone() for c in caches]
    untouched = [c.clone() for c in caches]
    with torch.inference_mode():
        ref = model(ids, pos, ref_caches, meta)
        x = pad_decode(ids, pos, meta, batch=5, width=table_width(meta.max_seq_len, bs) + 1)
        out = model(x.input_ids, x.positions, caches, fixed_meta(x, 1, bs))
    torch.testing.assert_close(out[:3], ref, rtol=1e-5, atol=1e-5)
    real = meta.slot_mapping
    for c, r, u in zip(caches, ref_caches, untouched):
        c, r, u = c.flatten(1, 2), r.flatten(1, 2), u.flatten(1, 2)  # [2, slots, Hkv, D]
        torch.testing.assert_close(c[:, real], r[:, real], rtol=1e-5, atol=1e-5)
        others = torch.ones(c.shape[1], dtype=torch.bool)
        others[real] = False
        assert torch.equal(c[:, others], u[:, others])


# ---- flags and refusals -------------------------------------------------------------------------------


class _GpuBackend:
    """What resolve_executor reads of a GPU backend (importing the Triton one here would build its
    kernels before tests/kernels sets TRITON_INTERPRET)."""

    graph_devices = ("cuda",)


GPU_BACKEND = _GpuBackend()


def test_executor_resolution_and_refusals():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_executor(EngineConfig(), cpu) == "eager"
    # CUDA: graphs by default with a GPU attention backend, never over the torch reference
    assert resolve_executor(EngineConfig(), cuda, backend=TorchAttentionBackend()) == "eager"
    assert resolve_executor(EngineConfig(), cuda, backend=GPU_BACKEND) == "cuda-graph"
    assert resolve_executor(EngineConfig(attention_backend="torch"), cuda, backend=TorchAttentionBackend()) == "eager"
    assert resolve_executor(EngineConfig(tensor_parallel_size=2), cuda, backend=GPU_BACKEND) == "eager"
    with pytest.raises(ConfigError, match="does not run under --tensor-parallel-size 2"):
        resolve_executor(EngineConfig(executor="compiled", tensor_parallel_size=2), cpu)
    assert resolve_executor(EngineConfig(executor="cuda-graph"), cuda) == "cuda-graph"
    assert resolve_executor(EngineConfig(enforce_eager=True), cuda) == "eager"
    assert resolve_executor(EngineConfig(executor="compiled"), cpu) == "compiled"
    with pytest.raises(ConfigError, match="--executor cuda-graph needs a CUDA device.*--executor compiled"):
        resolve_executor(EngineConfig(executor="cuda-graph"), cpu)
    with pytest.raises(ConfigError, match="CPU path.*cuda-graph"):
        resolve_executor(EngineConfig(executor="compiled"), cuda)
    with pytest.raises(ConfigError, match="kv-cache-dtype auto only"):
        resolve_executor(EngineConfig(executor="compiled", kv_cache_dtype="fp8"), cpu, torch.float8_e4m3fn)
    with pytest.raises(ConfigError, match="--enforce-eager contradicts --executor compiled"):
        EngineConfig(enforce_eager=True, executor="compiled")
    with pytest.raises(ConfigError, match="unknown keys"):
        EngineConfig(executor="compiled", compilation_config={"level": 3})
    with pytest.raises(ConfigError, match="contradicts --executor eager"):
        EngineConfig(executor="eager", compilation_config={"compile_sizes": [1]})
    assert EngineConfig(compilation_config={"compile_sizes": [1]}).executor_config.compilation  # auto compiles on CPU
    with pytest.raises(ConfigError, match="compile_sizes"):
        EngineConfig(executor="compiled", compilation_config='{"compile_sizes": [0]}')
    with pytest.raises(ConfigError, match="cuda-graph-max-batch-size"):
        EngineConfig(cuda_graph_max_batch_size=0)
    config = EngineConfig(executor="compiled", compilation_config={"compile_sizes": [1, 8, 32]})
    cc = config.executor_config.compile_options(16)
    assert cc["compile_sizes"] == [1, 8, 16] and cc["freezing"] is None  # auto: chosen from the model's linears
    # CUDA graphs capture 1 + k only where the backend runs it from fixed-shape metadata
    assert graph_query_lens(0, TorchAttentionBackend()) == [1]
    assert graph_query_lens(3, TorchAttentionBackend()) == [1]

    class Varlen:
        fixed_shape_max_query_len = 9

    assert graph_query_lens(3, Varlen()) == [1, 4]


def test_cuda_graph_refused_on_cpu_engine(tiny_model_dir):
    with pytest.raises(ConfigError, match="needs a CUDA device, and this engine runs on cpu"):
        make_llm(tiny_model_dir("llama"), device="cpu", executor="cuda-graph")


# ---- eager vs compiled ----------------------------------------------------------------------------------


def outputs(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def assert_same_outputs(a, b, tag, tolerance: float = 1e-4) -> None:
    """Two runs' outputs: the same tokens, the same top logprob ids, each logprob within tolerance."""
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids, tag
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t].logprob - ly[t].logprob) < tolerance for t in lx), tag


def test_hybrid_executor_choice_says_what_to_change(tiny_hybrid_dir):
    """A hybrid whose GDN layers run in torch ops stays eager under auto and is refused under --executor
    compiled with the reason; a MoE hybrid (Qwen3-Next: its experts run sync-free in a graph) is not held back."""
    from ember.engine.startup.limits import hybrid_blocker
    from ember.kernels.cpu_kernels import CpuKernels
    from ember.loader.model_loader import load_model

    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="cannot run this model: its Gated DeltaNet"):
        resolve_executor(EngineConfig(executor="compiled"), cpu, hybrid_blocker="its Gated DeltaNet layers ...")
    assert resolve_executor(EngineConfig(), cpu, hybrid_blocker="its Gated DeltaNet layers ...") == "eager"
    for arch, kernels, reason in [
        ("qwen3_next", None, None),
        ("qwen3_5", CpuKernels.none(), "torch ops"),
        ("qwen3_5", None, None),
    ]:
        loaded = load_model(tiny_hybrid_dir(arch), None, torch.float32, cpu, kernels=kernels)
        blocker = hybrid_blocker(loaded, cpu)
        assert (blocker is None) if reason is None else (reason in blocker), (arch, blocker)


def test_compiled_query_lens_follow_the_fused_kernel():
    """Verify graphs only where the attention runs them from fixed-shape metadata alone."""
    from ember.engine.executor.base import compiled_query_lens
    from ember.kernels.cpu_attention import CpuAttentionBackend

    backend = CpuAttentionBackend()
    assert compiled_query_lens(0, backend) == [1]  # no speculation
    assert compiled_query_lens(2, backend) == [1, 3]
    assert compiled_query_lens(2, backend, adaptive=True) == [1, 2, 3]  # adaptive k may pick any of 1..2
    assert compiled_query_lens(16, backend) == [1]  # 17 queries: past the kernel's fixed-shape bound
    off = CpuAttentionBackend(fused_decode=False)  # --no-cpu-paged-attention: the torch path needs host lists
    assert compiled_query_lens(2, off) == [1]
    assert compiled_query_lens(2, TorchAttentionBackend()) == [1]  # the reference, likewise
    assert compiled_query_lens(2, None) == [1]


def test_fixed_shape_verify_attention_equals_the_host_list_path():
    """3 queries per sequence from fixed-shape metadata (the bounds in the host lists, real lengths
    only in seq_lens) give what the reference path computes from the real host lists."""
    from ember.kernels.cpu_paged_attention import paged_attention_op

    assert paged_attention_op() is not None
    g = torch.Generator().manual_seed(2)
    bs, n, Hq, Hkv, D = 4, 3, 4, 2, 32
    cache = torch.randn(2, 10, bs, Hkv, D, generator=g)
    lens, tables = [7, 12], [[3, 1, 0, 0], [2, 5, 9, 4]]
    q = torch.randn(2 * n, Hq, D, generator=g)
    common = dict(
        slot_mapping=torch.zeros(2 * n, dtype=torch.int64),
        query_start_loc=torch.tensor([0, n, 2 * n], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        block_size=bs,
        query_lens_cpu=[n, n],
        max_query_len=n,
        all_slots_valid=True,
    )
    real = AttentionMetadata(seq_lens_cpu=lens, max_seq_len=max(lens), **common)
    fixed = AttentionMetadata(seq_lens_cpu=[16, 16], max_seq_len=16, fixed_shape=True, **common)
    from ember.kernels.cpu_attention import CpuAttentionBackend

    want = TorchAttentionBackend().forward(q, None, None, cache, real, 0.125)
    got = CpuAttentionBackend().forward(q, None, None, cache, fixed, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
