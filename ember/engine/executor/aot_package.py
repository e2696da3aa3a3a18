"""Decode step graphs as AOTInductor packages: built once on a machine, loaded by later processes in milliseconds.

torch.compile's on-disk caches (ember.engine.executor.compile_cache) spare a restart inductor's work but not
dynamo's: it traces the forward again, and a cached batch-1 graph of the default model still took
7.5 s to load on 2 cores, two graphs (decode and the speculative verify) 14 s before the first
answer. An AOTInductor package is the graph already built: torch.export traces the step once (the
block-table width and the pool's block count dynamic), inductor compiles it ahead of time into a
shared library with its C++ entry point, and a later process maps that library and calls it, with
no tracing and no guards: ~5 ms a graph (docs/tuning.md, "Compile caches").

The weights stay out of the package (aot_inductor.package_constants_in_so off): the loader points
the graph at the model's own tensors (user-managed constants), so a package costs no memory beside
the model. A sidecar file names where each constant lives on the model. Packed weights that a quant
method reads through plain Python objects (the GGUF parts' lists) reach export as lifted tensor
constants; they are found on the model by identity at build time and handed to inductor as buffers,
so that the package keeps their names.

A package is keyed by everything its graph depends on: the model file and the flags that change the
trace (compile_cache.graph_identity), the executor, the shape, inductor's options, torch's version,
the CPU's flags, and ember's own source (the model code the trace runs through and the kernels it
calls: an edit there builds anew; the server, the CLI and the benches are left out).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from ember.errors import EmberError

ROOT = Path(__file__).resolve().parents[2]  # the ember package (this module is ember/engine/executor/)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # _parameters, _buffers, _modules, hooks, training


# ember's packages no decode step runs through (the rest is hashed into every package's key)
NOT_TRACED = frozenset({"bench", "server", "entrypoints", "eval", "train"})


@functools.cache
def source_digest() -> str:
    """A hash of ember's Python and C++ sources but NOT_TRACED (~1 MB; a few ms, once a process)."""
    h = hashlib.sha256()
    for path in sorted(
        p
        for p in ROOT.rglob("*")
        if p.suffix in (".py", ".cpp", ".h") and p.relative_to(ROOT).parts[0] not in NOT_TRACED
    ):
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def package_path(identity: str, what: str, shape: tuple[int, int], options: dict) -> str:
    """Where the package of one (batch size, query length) graph of an executor lives."""
    from ember.engine.executor.compile_cache import use_compile_cache
    from ember.platform import cpu_flags_line

    key = json.dumps(
        [identity, what, list(shape), options, torch.__version__, cpu_flags_line(), source_digest()],
        sort_keys=True,
        default=str,
    )
    return os.path.join(use_compile_cache(), "ember-aot", hashlib.sha256(key.encode()).hexdigest()[:32] + ".pt2")


def _constants_file(path: str) -> str:
    return path.removesuffix(".pt2") + ".constants.json"


def _same_tensor(t: torch.Tensor) -> tuple:
    """What makes two tensor objects the same data: export may hand back a parameter as another object
    (detached) over the same memory."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)


def _tensors_of(module: torch.nn.Module) -> dict[tuple, str]:
    """_same_tensor(tensor) -> its path on `module` (the first found), for every tensor a module of the tree holds
    as a parameter, a buffer or an attribute, inside a plain object, list or tuple it holds (a quant
    method's packed parts), or in a module it holds as a plain attribute (the MTP's shared embedding and
    rotary table): paths that _resolve follows."""
    found: dict[tuple, str] = {}
    walked: set[int] = set()

    def walk(sub: torch.nn.Module, prefix: str) -> None:
        if id(sub) in walked:
            return
        walked.add(id(sub))
        for name, t in list(sub._parameters.items()) + list(sub._buffers.items()):
            if t is not None:
                found.setdefault(_same_tensor(t), prefix + name)
        for name, child in sub._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")
        for name, value in vars(sub).items():
            if name not in _MODULE_INTERNALS:
                visit(value, prefix + name, 3)

    def visit(value, path: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(_same_tensor(value), path)
        elif isinstance(value, torch.nn.Module):
            walk(value, path + ".")
        elif depth == 0 or isinstance(value, type):
            return
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{path}.{i}", depth - 1)
        elif hasattr(value, "__dict__"):
            for name, item in vars(value).items():
                visit(item, f"{path}.{name}", depth - 1)

    walk(module, "")
    return found


def _resolve(module: torch.nn.Module, path: str) -> torch.Tensor:
    obj = module
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, (list, tuple)) else getattr(obj, part)
    return obj


def _structural_copy(module: torch.nn.Module) -> torch.nn.Module:
    """New module objects (their own parameter, buffer and child tables) over the same tensors and
    everything else. Non-strict export swaps fake tensors into the parameters and buffers of the module
    it traces; a copy keeps the served model untouched while a background export runs beside its steps."""
    new = copy.copy(module)
    new._parameters, new._buffers = dict(module._parameters), dict(module._buffers)
    new._modules = {k: None if m is None else _structural_copy(m) for k, m in module._modules.items()}
    return new


def build(
    step: torch.nn.Module, owner: torch.nn.Module, example: tuple, dynamic_shapes: tuple, options: dict, path: str
) -> None:
    """Export `step` (a module whose submodule `owner` holds the weights) on `example` and compile it
    into a package at `path`, with its constants file. Raises EmberError when a constant the graph reads
    is not a tensor of `owner` (it could not be found again by a later process)."""
    import torch._inductor
    from torch.export.graph_signature import InputKind

    owner_name = next(name for name, m in step.named_children() if m is owner)
    traced = _structural_copy(step)
    where = _tensors_of(traced)
    with torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(traced, example, dynamic_shapes=dynamic_shapes, strict=False)
    constants: dict[str, str] = {}  # the package's constant name -> its path on owner
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    for spec in program.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            continue
        tensor = program.constants.get(spec.target, program.state_dict.get(spec.target))
        found = where.get(_same_tensor(tensor))
        if found is None or not found.startswith(owner_name + "."):
            raise EmberError(
                f"the step reads a tensor ({spec.target}: {tuple(tensor.shape)} {tensor.dtype}) that "
                "is not held by the model's modules, so a later process could not hand it to an "
                "ahead-of-time package"
            )
        constants[spec.target] = found.removeprefix(owner_name + ".")
        # Every weight the step reads goes to inductor as a parameter, the lifted constants (kept by name:
        # see the module docstring) and the buffers alike: AOTInductor clones each buffer before it
        # compiles (torch._inductor.compile_fx._unlift_graph, for buffers a graph might mutate; a decode
        # step mutates none), which held a second copy of the weights in the building process
        # (+2.9 GiB for the bf16 hybrid's 1.4 GiB). The package reads none of them: they stay the model's.
        if spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            if spec.target in mutated:
                raise EmberError(
                    f"the step writes the model's tensor {spec.target}; a decode step writes only its caches"
                )
            program.state_dict[spec.target] = torch.nn.Parameter(tensor, requires_grad=False)
            program.constants.pop(spec.target, None)
            spec.kind, spec.persistent = InputKind.PARAMETER, None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path.removesuffix(".pt2") + f".{os.getpid()}.partial.pt2"  # torch wants the suffix
    partial_constants = f"{_constants_file(path)}.{os.getpid()}.partial"
    try:
        torch._inductor.aoti_compile_and_package(
            program,
            package_path=partial,
            # always_keep_tensor_constants: inductor would otherwise inline a weight of up to 8 values (a
            # small norm, a scale) into the code, where a later load could not replace it. GEMMs on aten
            # only: max-autotune's CPU GEMM template packs the weight it multiplies into a new constant
            # of its own, which the model does not hold (a dense bf16 GGUF's batch-4 step then failed to
            # load: "constants ... are not named in its constants file", and was rebuilt every start)
            inductor_configs=options
            | {
                "aot_inductor.package_constants_in_so": False,
                "always_keep_tensor_constants": True,
                "max_autotune_gemm_backends": "ATEN",
            },
        )
        with open(partial_constants, "w") as f:
            json.dump(constants, f)
        os.replace(partial_constants, _constants_file(path))  # whole files only, whoever else builds it
        os.replace(partial, path)  # last: a package on disk always has its constants file
    finally:  # a failed build leaves nothing in the cache
        for leftover in (partial, partial_constants):
            if os.path.exists(leftover):
                os.remove(leftover)


class LoadedStep:
    """A loaded package bound to the model's tensors: call it with the step's tensors in export order."""

    def __init__(self, path: str, owner: torch.nn.Module):
        with open(_constants_file(path)) as f:
            where = json.load(f)
        self._loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        names = self._loader.get_constant_fqns()
        missing = [n for n in names if n not in where]
        if missing:
            raise EmberError(
                f"{path}: constants {missing[:3]} are not named in its constants file; "
                "delete the package to build it again"
            )
        self.constants = {n: _resolve(owner, where[n]) for n in names}  # kept alive: the loader holds pointers
        # (constants map, use the inactive buffer, check that every constant is set, user-managed, host copies)
        self._loader.load_constants(self.constants, False, True, True, False)
        self._run = self._loader.boxed_run

    def __call__(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self._run(inputs)[0]  # boxed: the list is consumed


def load(path: str, owner: torch.nn.Module) -> LoadedStep | None:
    """The package at `path` bound to `owner`'s tensors, or None when there is none."""
    if not (os.path.exists(path) and os.path.exists(_constants_file(path))):
        return None
    return LoadedStep(path, owner)


def discard(path: str) -> None:
    """Remove a package (and its constants file) that failed to load or to run."""
    for p in (path, _constants_file(path)):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
