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
graph shows no module boundaries: then only the kernel ops (GDN core, conv) are split out.
"""

from __future__ import annotations

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
METHOD = (
    "per-op split: torch.profiler (CPU) over {steps} batch-1 decode steps of ember after a {prompt}-token prompt "
    "and warm steps, in ember's process; matmuls = the linear layers (projections, MLP; whatever kernel their "
    "weights take), LM head = the (tied) head, GDN core = ember_cpu::gated_delta_net, conv = "
    "ember_cpu::causal_conv1d_silu, full attention = the attention layers' KV store and attention kernel (their "
    "projections are matmuls), norms and glue = the rest of the model's forward (norms, gated norm, rotary, "
    "residuals, reshapes, embedding), engine = the step outside the forward and the head (scheduling, sampling, "
    "outputs); % of the profiled step; `step` is the unprofiled median"
)


class Labels:
    """Forward hooks that wrap each labelled module's call in a profiler range (outermost only), and the
    model's forward in one of its own."""

    def __init__(self, model):
        from ember.layers.attention import Attention
        from ember.layers.embedding import LMHead
        from ember.layers.linear import LinearBase

        kinds = ((LMHead, HEAD), (LinearBase, MATMULS), (Attention, ATTENTION))
        self.depth, self.open, self.handles = 0, [], []
        for m in model.modules():
            label = next((name for cls, name in kinds if isinstance(m, cls)), None)
            if label is not None:
                self._hook(m, label, counted=True)
        self._hook(model, "forward", counted=False)

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


def _totals_us(events) -> dict[str, float]:
    """Summed durations (us) of the labelled ranges, the named kernel ops and the steps."""
    out: dict[str, float] = {}
    for e in events:
        if e.name.startswith(PREFIX):
            key = e.name[len(PREFIX) :]
        elif e.name in OPS:
            key = OPS[e.name]
        else:
            continue
        out[key] = out.get(key, 0.0) + e.time_range.elapsed_us()
    return out


def split(totals_us: dict[str, float], steps: int, unprofiled_ms: float, executor: str) -> dict:
    """{category: ms per step}, their shares of the profiled step, and the step times."""
    ms = {k: v / steps / 1000 for k, v in totals_us.items()}
    step, forward = ms.get("step", 0.0), ms.get("forward", 0.0)
    # the modules' forwards ran (eager): a compiled graph hides module boundaries from the hooks, and
    # then only the named kernel ops are told apart (the rest is None: not measured)
    labelled = MATMULS in ms
    parts: dict[str, float | None] = {c: ms.get(c, 0.0) for c in (GDN, CONV)}
    if labelled:
        parts.update({c: ms.get(c, 0.0) for c in (MATMULS, HEAD, ATTENTION)})
        parts[GLUE] = max(forward - sum(v for c, v in parts.items() if c != HEAD), 0.0)
        parts[ENGINE] = max(step - forward - parts[HEAD], 0.0)
    parts = {c: parts.get(c) for c in CATEGORIES}
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
    labels = Labels(engine.parts.loaded.model)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with record_function(PREFIX + "step"):
                    engine.step()
    finally:
        labels.remove()
    while engine.has_unfinished_requests():
        engine.step()
    return split(_totals_us(prof.events()), steps, statistics.median(plain), engine.parts.limits.executor)
