"""ember.kernels.tracing: traced branches are taken in traces only, never by an eager step that runs while
another thread compiles (torch's is_compiling flag is process-wide)."""

from __future__ import annotations

import threading

import torch

from ember.kernels.tracing import tracing


def test_an_eager_step_is_not_traced_while_another_thread_compiles(monkeypatch):
    import torch.compiler

    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # what a compile thread sets
    assert torch.compiler.is_compiling()  # the flag the engine used to read
    seen = []
    t = threading.Thread(target=lambda: seen.append(tracing(torch.ones(2))))
    t.start()
    t.join()
    assert seen == [False] and not tracing(torch.ones(2))


def test_dynamo_and_export_traces_take_the_traced_branch():
    def f(x):
        return x + 1 if tracing(x) else x - 1

    x = torch.zeros(3)
    assert torch.equal(f(x), x - 1)
    assert torch.equal(torch.compile(f, backend="eager", fullgraph=True)(x), x + 1)

    class M(torch.nn.Module):
        def forward(self, x):
            return f(x)

    program = torch.export.export(M(), (x,), strict=False)
    assert torch.equal(program.module()(x), x + 1)
