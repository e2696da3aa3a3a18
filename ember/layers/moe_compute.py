"""How sparse MoE experts compute a step: grouped eagerly, sync-free in a graph (torch.compile, CUDA graphs).

The eager path (grouped_experts) groups token slots by expert and reads each expert's token count
on the host (bincount().tolist()), one sync per layer: dynamo cannot trace it, and a CUDA graph cannot
capture it. In a graph, experts run in one of two sync-free forms instead:

- gathered_experts (dense stacked experts; CPU graphs and CUDA graphs): fixed shapes, each token slot's
  expert weights indexed (w13[ids]) and multiplied in batched matmuls. Eagerly that copies k experts per
  token, but inductor fuses the index, the batched matrix-vector products, SiLU and the weighted sum into
  one kernel that reads each slot's expert rows in place (no copy): on a small MoE shape, the compiled
  form beat the grouped path at decode batches 1, 16 and 64 (docs/tuning.md, "MoE experts in a graph").
- the `ember::moe_experts` op (CPU; storages with no gathered form: AWQ int4, GGUF packed parts): the
  grouped path run whole inside one registered op (torch.library, with a fake kernel), which a compiled
  graph calls as it calls ember's C++ kernels. The op serves every storage (they differ only in their
  expert_forward), so it cannot take the weights as arguments; it finds its experts module by a key given
  at construction (as vLLM's moe_forward op finds its layer by name). It still syncs inside, which a CPU
  graph does not mind and a CUDA graph cannot capture.

The op's key is a counter in construction order, not an id(): a graph holds it as a constant, so the same
model built the same way in a later process traces the same graph and finds torch's compile cache.
Keys are unique within a process, which is what keeps two engines of one model apart. A graph that holds
a key is tied to this process's modules, so a model whose graph calls the op is never built into an
AOTInductor package (CompiledExecutor.ahead_of_time; ember.engine.executor.aot_package), which a later
process would load.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from ember.kernels.tracing import tracing

_registered: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> experts module
_next_key = itertools.count()


def register_experts(experts: torch.nn.Module) -> str:
    """A key by which the ember::moe_experts op finds `experts` (alive as long as the module is)."""
    key = f"moe{next(_next_key)}"
    _registered[key] = experts
    return key


def calls_experts_op(model: torch.nn.Module) -> bool:
    """Whether a traced step of `model` calls ember::moe_experts (so its graph holds this process's keys)."""
    return any(
        m.graph_key in _registered for m in model.modules() if getattr(m, "graph_key", None) and not _gathered(m)
    )


def _gathered(experts) -> bool:
    return getattr(experts, "gathered", None) is not None


def in_graph(x: torch.Tensor) -> bool:
    """Whether this forward is being traced by dynamo or captured into a CUDA graph."""
    return tracing(x) or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def experts_forward(experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """What every experts storage's forward runs: the grouped path eagerly; in a graph, the storage's
    gathered form where it has one (experts.gathered), else the registered op."""
    if not in_graph(x):
        return grouped_experts(x, topk_ids, topk_weights, experts.num_experts, experts.expert_forward)
    if _gathered(experts):
        return experts.gathered(x, topk_ids, topk_weights)
    return torch.ops.ember.moe_experts(x, topk_ids, topk_weights, experts.graph_key)


@torch.library.custom_op("ember::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, key: str) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert(topk_ids[t, k], x[t]) by the grouped path of the experts under key (or
    their own eager path, `run`, where they have one: experts kept in host memory, ember.layers.expert_placement)."""
    experts = _registered[key]
    run = getattr(experts, "run", None)
    if run is not None:
        return run(x, topk_ids, topk_weights)
    return grouped_experts(x, topk_ids, topk_weights, experts.num_experts, experts.expert_forward)


@moe_experts.register_fake
def _(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(x)


def gathered_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act
) -> torch.Tensor:
    """The grouped path's result in fixed shapes: x [T, H], topk [T, k], w13 [E, 2I, H], w2 [E, H, I];
    act: gate;up [n, 2I] -> [n, I]. Slot s = (t, j) multiplies x[t] by its own copy of expert topk_ids[t, j]."""
    T, k = topk_ids.shape
    H = x.shape[1]
    flat = topk_ids.flatten()
    xs = x[:, None, :].expand(T, k, H).reshape(T * k, H, 1)
    h = act(torch.bmm(w13[flat], xs).squeeze(-1))
    y = torch.bmm(w2[flat], h[:, :, None]).view(T, k, H)
    return (y * topk_weights[:, :, None]).sum(dim=1)


def grouped_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, expert_forward
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_forward(topk_ids[t, k], x[t]) over token slots grouped by expert.

    Shared by every experts storage (dense, AWQ int4, GGUF): they differ only in expert_forward(e, x_e).
    Eager only: it syncs with the host once (experts_forward picks what a graph runs)."""
    T, k = topk_ids.shape
    if T == 0:
        return torch.zeros_like(x)
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)  # token slots grouped by expert
    token_of = order // k
    weight_of = topk_weights.flatten()[order]
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host sync per layer
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        outs.append(expert_forward(e, x[token_of[start : start + n]]))
        start += n
    y = torch.cat(outs) * weight_of[:, None]
    return torch.zeros_like(x).index_add_(0, token_of, y)
