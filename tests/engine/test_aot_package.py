"""AOTInductor packages of decode steps (ember.engine.executor.aot_package): the weights stay the model's own
(found again by path in a later process, wherever the model keeps them), a package is keyed by what
its graph depends on, and a broken one is refused with a message rather than run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ember.engine.executor import aot_package
from ember.errors import EmberError


class Packed:
    """Like a quant method's packed part: tensors in a plain object, read through a list."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        self.codes, self.scale = codes, scale


class Layer(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norm = nn.Parameter(torch.rand(8, generator=g), requires_grad=False)
        self.parts = [Packed(torch.randn(8, 8, generator=g), torch.rand(8, generator=g))]
        self.register_buffer("shift", torch.rand(8, generator=g))

    def forward(self, x):
        part = self.parts[0]
        return (x * self.norm) @ part.codes.T * part.scale + self.shift


class Toy(nn.Module):
    """A layer of its own, and a module held as a plain attribute (as the MTP holds the main model's
    embedding): export sees its tensors as constants."""

    def __init__(self, seed: int):
        super().__init__()
        self.layer = Layer(seed)
        object.__setattr__(self, "_shared", Layer(seed + 1))

    def forward(self, x, rows: list):
        return self._shared(self.layer(x)) + rows[0]


class Step(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, rows):
        return self.model(x, rows)


def test_tensors_are_found_by_path_wherever_the_model_keeps_them():
    toy = Toy(0)
    found = aot_package._tensors_of(toy)
    paths = set(found.values())
    assert {
        "layer.norm",
        "layer.parts.0.codes",
        "layer.parts.0.scale",
        "_shared.norm",
        "_shared.parts.0.codes",
    } <= paths
    for path in paths:
        assert found[aot_package._same_tensor(aot_package._resolve(toy, path))] == path


@pytest.mark.slow
def test_a_package_runs_on_the_weights_of_the_model_it_is_loaded_for(tmp_path):
    """Built on one model, loaded for another of the same structure (a later process): the output is
    the second model's, so no weight was baked into the package."""
    built_on, loaded_for = Toy(0), Toy(10)
    x, rows = torch.randn(3, 8), [torch.randn(3, 8)]
    path = str(tmp_path / "toy.pt2")
    width = torch.export.Dim("rows", min=2)
    aot_package.build(Step(built_on), built_on, (x, rows), ({0: width}, [{0: width}]), {"max_autotune": False}, path)
    assert aot_package.load(str(tmp_path / "other.pt2"), loaded_for) is None  # nothing built there
    package = aot_package.load(path, loaded_for)
    assert torch.allclose(package([x, rows[0]]), loaded_for(x, rows), atol=1e-5)
    assert not torch.allclose(package([x, rows[0]]), built_on(x, rows), atol=1e-2)
    x5, rows5 = torch.randn(5, 8), [torch.randn(5, 8)]  # another row count: the dimension is dynamic
    assert torch.allclose(package([x5, rows5[0]]), loaded_for(x5, rows5), atol=1e-5)

    with open(path, "wb") as f:  # a truncated or foreign file fails to load; the executor then rebuilds it
        f.write(b"not a package")
    with pytest.raises(Exception):
        aot_package.load(path, loaded_for)
    aot_package.discard(path)
    assert aot_package.load(path, loaded_for) is None


@pytest.mark.slow
def test_a_build_copies_no_weight(tmp_path, monkeypatch):
    """AOTInductor clones every buffer of the program it compiles (one that a graph might mutate keeps its
    first value apart): the model's buffers and lifted constants go in as parameters, so the building
    process never holds a second copy of the weights (it held 2x the bf16 hybrid's 1.4 GiB)."""
    import torch._inductor.compile_fx as compile_fx

    cloned = []
    clone = compile_fx.clone_preserve_strides
    monkeypatch.setattr(compile_fx, "clone_preserve_strides", lambda t: cloned.append(t.shape) or clone(t))
    toy = Toy(0)
    x, rows = torch.randn(3, 8), [torch.randn(3, 8)]
    path = str(tmp_path / "toy.pt2")
    aot_package.build(Step(toy), toy, (x, rows), None, {"max_autotune": False}, path)
    assert cloned == []
    assert torch.allclose(aot_package.load(path, toy)([x, rows[0]]), toy(x, rows), atol=1e-5)


def test_a_tensor_the_model_does_not_hold_is_refused(tmp_path):
    class Stray(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Identity()

        def forward(self, x, rows):
            return x + STRAY

    STRAY = torch.randn(8)
    step = Stray()
    with pytest.raises(EmberError, match="not held by the model's modules"):
        aot_package.build(Step(step), step, (torch.randn(3, 8), [torch.randn(3, 8)]), None, {}, str(tmp_path / "s.pt2"))


def test_the_key_covers_shape_executor_and_model():
    base = aot_package.package_path("model-a", "compiled executor", (1, 1), {"mode": "m"})
    assert base.endswith(".pt2") and "ember-aot" in base
    assert base == aot_package.package_path("model-a", "compiled executor", (1, 1), {"mode": "m"})
    others = {
        aot_package.package_path("model-b", "compiled executor", (1, 1), {"mode": "m"}),
        aot_package.package_path("model-a", "MTP fill", (1, 1), {"mode": "m"}),
        aot_package.package_path("model-a", "compiled executor", (1, 2), {"mode": "m"}),
        aot_package.package_path("model-a", "compiled executor", (1, 1), {"mode": "n"}),
    }
    assert base not in others and len(others) == 4


def test_the_source_digest_covers_the_whole_package():
    """A package's key hashes every traced ember source: a module move once left it hashing engine/ alone."""
    import ember

    assert aot_package.ROOT == Path(ember.__file__).resolve().parent
    assert (aot_package.ROOT / "layers" / "linear.py").is_file() and (aot_package.ROOT / "kernels").is_dir()


def test_a_package_worker_that_cannot_start_leaves_its_shapes_eager(tmp_path):
    """A worker is asked for the shapes this machine lacks; when none can start (an engine config that does
    not pickle, no process to spare), they are still not built in this process (they run eagerly); an
    engine without workers (a worker's own, `ember compile`'s) builds them itself."""
    from types import SimpleNamespace

    from ember.engine.executor.compiled import CompiledExecutor

    asked = []

    class Workers:
        def __init__(self, fail):
            self.fail = fail

        def build(self, what, shapes):
            asked.append((what, shapes))
            if self.fail:
                raise OSError("no process")
            return True

    built = tmp_path / "built.pt2"
    built.write_bytes(b"")
    executor = SimpleNamespace(
        what="compiled executor",
        graph_identity="x",
        package_path=lambda shape: str(built if shape == (1, 1) else tmp_path / f"{shape}.pt2"),
        _check_cancelled=lambda: None,  # not cancelled (CompiledExecutor.cancel)
    )
    shapes = [(1, 1), (2, 1)]
    executor.package_workers = Workers(fail=False)
    assert CompiledExecutor._build_in_worker(executor, shapes) == {(2, 1)}  # the built one is not asked for
    executor.package_workers = Workers(fail=True)
    assert CompiledExecutor._build_in_worker(executor, shapes) == {(2, 1)}  # not built here either
    assert asked == [("compiled executor", [(2, 1)])] * 2
    executor.package_workers = None
    assert CompiledExecutor._build_in_worker(executor, shapes) == set()
