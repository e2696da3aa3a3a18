"""The structure docs/architecture.md promises, checked on the source (ast only: nothing is imported).

- ember's packages import each other without a cycle, function-local imports included (a top-level
  module such as ember/engine/planner.py counts as a package of its own);
- inside each package, its modules import each other without a cycle either (function-local imports
  included);
- an import under `if TYPE_CHECKING:` is no edge (it never runs): a module may name a type from a
  package it must not import at run time;
- ember.config imports none of the engine, kernels, quantization, speculation or distributed code;
- no function or method is longer than 80 lines, and LLMEngine at most 250;
- ember/kernels holds no module-level on/off switch (a layer's kernels are chosen when it is built,
  from the CpuKernels handed to it);
- docs/architecture.md names every package.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EMBER = ROOT / "ember"


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in EMBER.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


MODULES = _modules()


def package_of(module: str) -> str:
    """ember.engine.runner -> engine; ember.engine.planner -> planner; ember -> ember (the root package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ember"


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING` (an `if` on it never runs its body)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_time_nodes(tree: ast.AST):
    """ast.walk, less the bodies of `if TYPE_CHECKING:` (their `else:` runs, so it is kept)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo += [node.test, *node.orelse]
        else:
            todo += ast.iter_child_nodes(node)


def _imported(module: str, tree: ast.Module, modules: dict[str, ast.Module] = MODULES) -> set[str]:
    """Every ember module `module` imports when it runs, anywhere in its body (function-local imports
    too; not those under `if TYPE_CHECKING:`)."""
    found = set()
    is_pkg = (EMBER / Path(*module.split(".")[1:]) / "__init__.py").exists() if "." in module else True
    for node in _run_time_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ember"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ember":
                continue
            # `from ember.engine import planner` imports the module ember.engine.planner; `from ember import LLM` the root
            found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, tree in MODULES.items():
        src = package_of(module)
        for target in _imported(module, tree):
            dst = package_of(target)
            if dst != src:
                graph[src].add(dst)
    return graph


def module_graph(modules: dict[str, ast.Module] = MODULES) -> dict[str, set[str]]:
    """Module -> the modules of its own package it imports (what package_graph leaves out). The
    package's __init__ is a module like the others; importing a submodule runs its package's
    __init__ first, but that implicit import is no edge (only the imports written in the source)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, tree in modules.items():
        for target in _imported(module, tree, modules):
            if target in modules and target != module and package_of(target) == package_of(module):
                graph[module].add(target)
    return graph


def cycles_inside_packages(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Package -> one import cycle among its modules, for every package that has one."""
    cycles = {}
    for package in sorted({package_of(m) for m in graph}):
        cycle = find_cycle({m: targets for m, targets in graph.items() if package_of(m) == package})
        if cycle:
            cycles[package] = cycle
    return cycles


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_graph_is_acyclic():
    cycle = find_cycle(package_graph())
    assert cycle is None, f"import cycle between ember's packages: {' -> '.join(cycle)}"


def test_no_import_cycle_inside_a_package():
    """Every package, ember.bench included (until its restructure lands, this fails on its cycles)."""
    cycles = cycles_inside_packages(module_graph())
    assert not cycles, "import cycles inside ember's packages:\n" + "\n".join(
        f"  {package}: {' -> '.join(cycle)}" for package, cycle in cycles.items()
    )


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None


def test_module_graph_finds_a_cycle_inside_a_package():
    """A function-local import closes a cycle; an import under TYPE_CHECKING, or one through another
    package (package_graph's business), does not."""
    sources = {
        "ember.pkg": "from ember.pkg.a import A\nfrom ember.pkg.b import B\n",
        "ember.pkg.a": "class A:\n    def f(self):\n        from ember.pkg import helper\n",
        "ember.pkg.b": "from typing import TYPE_CHECKING\nimport ember.other\n"
        "if TYPE_CHECKING:\n    from ember.pkg import A\nclass B:\n    pass\n",
        "ember.other": "import ember.pkg.b\n",
    }
    graph = module_graph({module: ast.parse(source) for module, source in sources.items()})
    assert cycles_inside_packages(graph) == {"pkg": ["ember.pkg", "ember.pkg.a", "ember.pkg"]}
    sources["ember.pkg.a"] = "class A:\n    pass\n"
    assert cycles_inside_packages(module_graph({m: ast.parse(s) for m, s in sources.items()})) == {}


def test_imported_skips_type_checking_and_keeps_both_halves_of_a_mixed_from_import():
    tree = ast.parse(
        "import typing\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ember.engine.engine import LLMEngine\n"
        "if typing.TYPE_CHECKING:\n    import ember.spec\nelse:\n    import ember.config\n"
        "def f():\n    from ember.kernels import cpu_kernels\n"
        "from ember.quant import QuantConfig, gemm_dispatch\n"
    )
    assert _imported("ember.server.x", tree) == {
        "ember.config",
        "ember.kernels.cpu_kernels",
        "ember.quant",
        "ember.quant.gemm_dispatch",
    }


def test_config_imports_no_engine_side_package():
    forbidden = {"engine", "spec", "kernels", "quant", "distributed"}
    assert not package_graph()["config"] & forbidden


def test_no_function_over_80_lines_and_a_short_engine():
    long = []
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{module}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
            if isinstance(node, ast.ClassDef) and node.name == "LLMEngine":
                assert node.end_lineno - node.lineno < 250, f"LLMEngine is {node.end_lineno - node.lineno + 1} lines"
    assert not long, f"functions over 80 lines: {long}"


def test_no_module_level_switch_in_kernels():
    """A bool assigned at module level (or `global` rebinding one) would be a hidden on/off switch."""
    switches = []
    for module, tree in MODULES.items():
        if package_of(module) != "kernels":
            continue
        for node in tree.body:
            if (
                isinstance(node, (ast.Assign, ast.AnnAssign))
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, bool)
            ):
                switches.append(f"{module}: {ast.unparse(node)}")
        switches += [f"{module}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    assert not switches, switches


def test_architecture_doc_names_every_package():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    packages = sorted({package_of(m) for m in MODULES} - {"ember"})
    missing = [p for p in packages if f"`{p}" not in doc]
    assert not missing, f"docs/architecture.md does not name: {missing}"
