"""Where one ember decode step's time goes, by kind of work: torch.profiler over a few batch-1 decode steps.

The model's modules are labelled by forward hooks that open a profiler range around each call (the
outermost labelled module only, so nothing is counted twice): its linear layers (LinearBase: the
projections and the MLP, whatever kernel their weights take) are "matmuls", the LM head (LMHead, tied
or not) is "LM head", the paged attention of the full-attention layers (Attention: KV store and the
attention kernel; their projections are matmuls) is "full attention". The Gated DeltaNet kernels are
ops of their own: ember_cpu::gated_delta_net ("GDN core") and ember_cpu::causal_conv1d_silu ("conv").
The rest of the model's forward is "norms and glue" (RMSNorms, the gated norm, rotary, residual adds,
reshapes, the embedding lookup); what the step spends outside the forward and the head (scheduling,
sampling, outputs) is "engine". Shares are of the profiled step; the profiler's own cost per op lands
mostly in glue, so the step's unprofiled time is reported beside it. A step that runs as a compiled
graph shows no module boundaries: then only the kernel ops (GDN core, conv) are split out, but for
qwen4_exp, whose kinds of work are modules (no kernel op of their own): its split is taken over the same steps
run eagerly (the compiled executor's graphs set aside while profiling), next to the compiled step's time.
"""

from __future__ import annotations

import contextlib
import statistics
import time

PREFIX = "bench-split::"
MATMULS, HEAD, GDN, CONV, ATTENTION, GLUE, ENGINE = (
    "matmuls",
    "LM head",
    "GDN core",
    "conv",
    "full attention",
    "norms and glue",
    "engine",
)
CATEGORIES = (MATMULS, HEAD, GDN, CONV, ATTENTION, GLUE, ENGINE)
OPS = {"ember_cpu::gated_delta_net": GDN, "ember_cpu::causal_conv1d_silu": CONV}
# qwen4_exp (a model with hyper-connection mixers) is split by its own kinds of work: each module whole (a
# Gated DeltaNet layer with its projections and kernels; QSA scoring = the indexer's projections, key cache
# and block selection; selected attention = the attention over the kept blocks, or the dense backend below
# the budget; router = the MoE gate; experts = routed + shared experts)
HC, PLE, GDN_LAYER, QSA_SCORING, SELECTED, ROUTER, EXPERTS = (
    "HC mixers",
    "PLE",
    "GDN",
    "QSA scoring",
    "selected attention",
    "router",
    "experts",
)
QWEN4_CATEGORIES = (HC, PLE, GDN_LAYER, QSA_SCORING, SELECTED, ROUTER, EXPERTS, HEAD, MATMULS, GLUE, ENGINE)
QWEN4_METHOD = (
    "per-op split of qwen4_exp: torch.profiler (CPU) over {steps} batch-1 decode steps after a {prompt}-token "
    "prompt, in ember's process; each module whole: HC mixers = the hyper-connection mixers, PLE = the n-gram "
    "layer (hash, row reads, gate, conv), GDN = the Gated DeltaNet layers (projections and kernels), QSA scoring "
    "= the indexer (projections, key cache, block scores and top-k), selected attention = attention over the kept "
    "blocks, router = the MoE gate, experts = routed and shared experts, LM head, matmuls = the attention "
    "layers' projections, glue = the rest of the forward, engine = the step outside the forward and the head; "
    "a compiled step hides its modules, so its split is profiled over the same kind of steps run eagerly "
    "(executor `compiled (split eager)`; `step` is the compiled step's unprofiled median, `profiled step` the eager one's)"
)
METHOD = (
    "per-op split: torch.profiler (CPU) over {steps} batch-1 decode steps of ember after a {prompt}-token prompt "
    "and warm steps, in ember's process; matmuls = the linear layers (projections, MLP; whatever kernel their "
    "weights take), LM head = the (tied) head, GDN core = ember_cpu::gated_delta_net, conv = "
    "ember_cpu::causal_conv1d_silu, full attention = the attention layers' KV store and attention kernel (their "
    "projections are matmuls), norms and glue = the rest of the model's forward (norms, gated norm, rotary, "
    "residuals, reshapes, embedding), engine = the step outside the forward and the head (scheduling, sampling, "
    "outputs); % of the profiled step; `step` is the unprofiled median"
)


def is_qwen4(model) -> bool:
    from ember.layers.hyper_connection import HyperConnection

    return any(isinstance(m, HyperConnection) for m in model.modules())


def module_labels(model) -> dict:
    """{module: category} of a model's labelled modules (an inner one of a labelled module is not counted)."""
    from ember.layers.attention import Attention
    from ember.layers.embedding import LMHead
    from ember.layers.linear import LinearBase

    kinds = ((LMHead, HEAD), (LinearBase, MATMULS), (Attention, ATTENTION))
    if is_qwen4(model):
        return qwen4_labels(model)
    return {m: label for m in model.modules() if (label := next((n for c, n in kinds if isinstance(m, c)), None))}


def qwen4_labels(model) -> dict:
    from ember.layers.attention import Attention
    from ember.layers.embedding import LMHead
    from ember.layers.gated_deltanet import GatedDeltaNet
    from ember.layers.hyper_connection import HyperConnection
    from ember.layers.linear import LinearBase
    from ember.layers.ple import PLELayer
    from ember.layers.qsa import QSAIndexer

    kinds = ((HyperConnection, HC), (PLELayer, PLE), (GatedDeltaNet, GDN_LAYER), (QSAIndexer, QSA_SCORING))
    kinds += ((Attention, SELECTED), (LMHead, HEAD))
    out = {}
    for m in model.modules():
        if hasattr(m, "gate") and hasattr(m, "experts"):  # an MoE block
            out[m.gate] = ROUTER
            out.update({e: EXPERTS for e in (m.experts, getattr(m, "shared_expert", None)) if e is not None})
            if getattr(m, "shared_expert_gate", None) is not None:
                out[m.shared_expert_gate] = EXPERTS
        label = next((n for c, n in kinds if isinstance(m, c)), None)
        if label is not None:
            out[m] = label
        elif isinstance(m, LinearBase) and m not in out:
            out[m] = MATMULS
    return out


class Labels:
    """Forward hooks that wrap each labelled module's call in a profiler range (outermost only), and the
    model's forward in one of its own. qwen4_exp's sparse path calls two functions outside any module's
    forward (the indexer's block selection, the selected-block attention): while labelled, they are wrapped
    in ranges of their own (QSA scoring, selected attention)."""

    def __init__(self, model):
        self.depth, self.open, self.handles, self.restore = 0, [], [], []
        labels = module_labels(model)
        for m, label in labels.items():
            self._hook(m, label, counted=True)
        self._hook(model, "forward", counted=False)
        if is_qwen4(model):
            self._wrap_sparse_path(model)

    def _wrap_sparse_path(self, model) -> None:
        import ember.models.qwen4_exp as qwen4
        from ember.layers.qsa import QSAIndexer

        for m in model.modules():
            if isinstance(m, QSAIndexer):
                self._wrap(m, "select_blocks", QSA_SCORING, instance=True)
        self._wrap(qwen4, "selected_attention", SELECTED, instance=False)

    def _wrap(self, owner, name: str, label: str, instance: bool) -> None:
        from torch.profiler import record_function

        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            self.depth += 1
            try:
                if self.depth > 1:
                    return inner(*args, **kwargs)
                with record_function(PREFIX + label):
                    return inner(*args, **kwargs)
            finally:
                self.depth -= 1

        setattr(owner, name, wrapped)
        self.restore.append((owner, name, inner, instance))

    def _hook(self, module, label: str, counted: bool) -> None:
        from torch.profiler import record_function

        def enter(mod, args):
            if counted:
                self.depth += 1
                if self.depth > 1:
                    return
            rf = record_function(PREFIX + label)
            rf.__enter__()
            self.open.append((module, rf))

        def leave(mod, args, out):
            if counted:
                self.depth -= 1
            if self.open and self.open[-1][0] is module:
                self.open.pop()[1].__exit__(None, None, None)

        self.handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for owner, name, inner, instance in self.restore:
            if instance:
                delattr(owner, name)  # the class's method again
            else:
                setattr(owner, name, inner)


def _totals_us(events, ops=OPS) -> dict[str, float]:
    """Summed durations (us) of the labelled ranges, the named kernel ops and the steps."""
    out: dict[str, float] = {}
    for e in events:
        if e.name.startswith(PREFIX):
            key = e.name[len(PREFIX) :]
        elif e.name in ops:
            key = OPS[e.name]
        else:
            continue
        out[key] = out.get(key, 0.0) + e.time_range.elapsed_us()
    return out


def split(totals_us: dict[str, float], steps: int, unprofiled_ms: float, executor: str, categories=CATEGORIES) -> dict:
    """{category: ms per step}, their shares of the profiled step, and the step times. categories:
    CATEGORIES or QWEN4_CATEGORIES (which has no kernel ops of its own: its modules are timed whole)."""
    ms = {k: v / steps / 1000 for k, v in totals_us.items()}
    step, forward = ms.get("step", 0.0), ms.get("forward", 0.0)
    # the modules' forwards ran (eager): a compiled graph hides module boundaries from the hooks, and
    # then only the named kernel ops are told apart (the rest is None: not measured)
    labelled = MATMULS in ms or HC in ms
    kernel_ops = [c for c in (GDN, CONV) if c in categories]
    parts: dict[str, float | None] = {c: ms.get(c, 0.0) for c in kernel_ops}
    if labelled:
        parts.update({c: ms.get(c, 0.0) for c in categories if c not in (GLUE, ENGINE, *kernel_ops)})
        parts[GLUE] = max(forward - sum(v for c, v in parts.items() if c != HEAD), 0.0)
        parts[ENGINE] = max(step - forward - parts[HEAD], 0.0)
    parts = {c: parts.get(c) for c in categories}
    return {
        "steps": steps,
        "executor": executor,
        "step_ms": unprofiled_ms,
        "profiled_step_ms": step,
        "ms": parts,
        "percent": {c: 100 * v / step if step and v is not None else None for c, v in parts.items()},
        "labelled": labelled,
    }


def decode_split(llm, request_id: str, prompt: list[int], steps: int = 8, warm: int = 4) -> dict:
    """Profile `steps` batch-1 decode steps of `llm` (after its prompt and `warm` steps): see split()."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from ember.sampling import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1 + warm + 2 * steps + 1, ignore_eos=True)
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while not any(o.request_id == request_id and o.outputs[0].token_ids for o in engine.step()):
        pass  # the prefill (in chunks, if it is long)
    for _ in range(warm):
        engine.step()
    plain = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        plain.append(1000 * (time.perf_counter() - t0))
    model = engine.parts.loaded.model
    qwen4 = is_qwen4(model)
    executor = engine.parts.limits.executor
    labels = Labels(model)
    try:
        with (
            _eager_steps(engine.parts.runner.executor, qwen4) as eager,
            profile(activities=[ProfilerActivity.CPU]) as prof,
        ):
            for _ in range(steps):
                with record_function(PREFIX + "step"):
                    engine.step()
    finally:
        labels.remove()
    while engine.has_unfinished_requests():
        engine.step()
    totals = _totals_us(prof.events(), {} if qwen4 else OPS)
    categories = QWEN4_CATEGORIES if qwen4 else CATEGORIES
    return split(
        totals, steps, statistics.median(plain), f"{executor} (split eager)" if eager else executor, categories
    )


@contextlib.contextmanager
def _eager_steps(executor, wanted: bool):
    """While open, a compiled executor runs its steps eagerly (its graphs set aside; yields whether it does):
    for qwen4_exp, whose kinds of work show only as modules."""
    ready = getattr(executor, "ready", None)
    if not wanted or not ready:
        yield False
        return
    executor.ready = {}
    try:
        yield True
    finally:
        executor.ready = ready
