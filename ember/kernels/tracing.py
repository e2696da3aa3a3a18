"""Whether the code running now is being traced into a graph, asked per thread.

torch.compiler.is_compiling() reads one process-wide flag, which inductor and export set while they
trace. The engine's background compile (ember.engine.executor.background_compile) traces on a thread of
its own while the step thread runs the same model eagerly, and there that flag sent eager steps down
the traced branch: a bf16 GEMV through its opaque op, whose dynamo wrapper then raced the compile
thread's fx metadata and aborted the process (KeyError: 'custom', then "terminate called"). So:
- under dynamo, is_dynamo_compiling() is folded to True in the trace;
- under export and AOTAutograd, whose Python runs for real on the tracing thread, the tensors are not
  plain tensors (fake, functional, proxy subclasses), which an eager step's activations always are.
"""

from __future__ import annotations

import torch


def tracing(x: torch.Tensor) -> bool:
    """Whether the forward that handed over `x` (an activation) is being traced, on this thread."""
    if torch.compiler.is_dynamo_compiling():
        return True
    return torch.compiler.is_compiling() and type(x) is not torch.Tensor
