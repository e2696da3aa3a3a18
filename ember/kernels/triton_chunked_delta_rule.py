"""The chunked gated delta rule over a packed varlen prefill step, on a GPU, through fla-core's
Triton kernels (flash-linear-attention, MIT; `pip install fla-core`, an optional GPU extra).

fla's `chunk_gated_delta_rule` computes exactly ember's recurrence (ember/layers/gated_delta_rule.py)
per value head, with the same conventions:

    g     the natural-log decay per token and value head, float32 [T, Hv] (fla turns it into
          log2 and a chunk-local cumsum itself);
    beta  post-sigmoid [T, Hv];
    q, k  [T, Hk, dk] with Hk dividing Hv: value head j reads key head j // (Hv / Hk), ember's
          grouped order (fla calls this GVA), so the key heads are never repeated;
          use_qk_l2norm_in_kernel normalises them as x / sqrt(sum x^2 + 1e-6), ember's l2norm;
    scale dk^-0.5, applied to q . k and to q . S in the output kernel (ember scales q up front);
    state [N, Hv, dk, dv] float32 (S [dk, dv], o = S^T q): ember's pool layout, state_v_first=False.

The pool's slots are not addressed by fla (it reads initial_state[n] and writes a fresh
final_state[n]), so chunked_prefill gathers the initial states from their slots and scatters the
final ones back. A sequence gets one state out: cuts inside a sequence (snapshots) need one call
per piece, or the torch path.

Precision: with bf16/fp16 q, k, v fla keeps its intermediates (the normalised q/k, the WY factors
w and u, the per-chunk states h) in that dtype, with fp32 accumulation and fp32 initial/final
states: what vLLM and SGLang run, a little less exact than ember's all-fp32 reference.

Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors: the tests) two gaps of triton 3.9's
interpreter are bridged for fla's kernels only, on first use (_interpreter_shims): fla autotunes
(the interpreter has no benchmarker: every config ties and the first is used), and one kernel
calls `.to()` on a `for i in range(...)` loop index, which the interpreter leaves a Python int
(it is wrapped as a tensor, as in compiled Triton). bf16 is not testable there (tl.dot on bf16).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def available() -> bool:
    """fla-core's chunked gated delta rule can be imported (it is an optional GPU dependency)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # not installed, or broken against this torch / triton
        return False
    return True


def chunked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor | None = None,
    qk_normalized: bool = False,
) -> torch.Tensor:
    """N sequences packed along dim 0 (T tokens), each from the state in slot src_idx[n] (-1: zeros)
    to slot dst_idx[n] (src and dst may be the same slot; dst slots must be distinct).

    q, k [T, Hk, dk]: the conv's output as it is (L2-normalised in the kernel; qk_normalized=True
    if they already are, unscaled and not repeated over value heads); v [T, Hv, dv]; g float32
    [T, Hv] (log decay); beta [T, Hv] (post-sigmoid); state the pool [slots, Hv, dk, dv] float32,
    updated in place; cu_seqlens [N + 1] int on q's device (cu_seqlens_cpu, the same on the host,
    spares fla a device sync). Returns o [T, Hv, dv] in q's dtype."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if q.device.type == "cpu":
        _interpreter_shims()
    if q.shape[1] != k.shape[1] or v.shape[1] % q.shape[1] or g.shape != v.shape[:2] or beta.shape != g.shape:
        raise ValueError(
            f"chunked_prefill: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}: need q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], Hk | Hv"
        )
    src = src_idx.to(device=state.device, dtype=torch.long)
    h0 = state.index_select(0, src.clamp(min=0))
    h0 = torch.where((src >= 0)[:, None, None, None], h0, 0.0)
    o, ht = chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g.float()[None],
        beta[None],
        scale=q.shape[-1] ** -0.5,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=not qk_normalized,
        cu_seqlens=cu_seqlens.long(),
        cu_seqlens_cpu=None if cu_seqlens_cpu is None else cu_seqlens_cpu.long(),
    )
    state.index_copy_(0, dst_idx.to(device=state.device, dtype=torch.long), ht.to(state.dtype))
    return o[0]


@functools.cache
def _interpreter_shims() -> None:
    """Bridge triton 3.9's interpreter gaps for fla's kernels (see the module docstring); a no-op
    unless TRITON_INTERPRET=1. Patches triton's Autotuner and interpreter classes, touching only
    functions defined in fla's modules."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    import ast

    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    def is_fla(fn) -> bool:
        return getattr(fn, "__module__", "").startswith("fla.")

    # no benchmarker in the interpreter: every config of fla's kernels ties, the first is used
    bench = autotuner.Autotuner.__dict__["do_bench"]  # a cached_property in triton 3.9
    tie = lambda kernel_call, quantiles: [1.0, 1.0, 1.0]  # noqa: E731

    def do_bench(self):
        return tie if is_fla(self.base_fn) else bench.__get__(self, type(self))

    autotuner.Autotuner.do_bench = property(do_bench)

    class LoopIndexAsTensor(ast.NodeTransformer):  # for i in range(n): i = to_tensor(i), as compiled
        def visit_For(self, node):
            self.generic_visit(node)
            it, target = node.iter, node.target
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range":
                if isinstance(target, ast.Name):
                    wrap = ast.parse(f"{target.id} = interpreter_semantic.to_tensor({target.id}, False)").body[0]
                    node.body.insert(0, ast.copy_location(wrap, node.body[0]))
            return node

    def transform_ast(self, src):  # FunctionRewriter._transform_ast, with the loop rewrite for fla
        tree = ast.parse(src)
        if is_fla(self.fn):
            tree = LoopIndexAsTensor().visit(tree)
        tree = self.ast_transformer.visit(tree)
        ast.fix_missing_locations(tree)
        ast.increment_lineno(tree, self.def_file_lineno - 1)
        return tree

    interpreter.FunctionRewriter._transform_ast = transform_ast
