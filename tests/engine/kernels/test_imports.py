"""No import cycles among the modules of engine/kernels, imports inside functions included: a cycle dodged by
a function-level import still ties two modules together, and breaks the day the import moves to the top.
Shared helpers go to a module both sides import (`fp8/quant.py`, `moe/combine.py`). Read from the source
with `ast`, so nothing is imported."""

import ast
import graphlib
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
KERNELS = ROOT / "engine" / "kernels"


def _module(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, package: str, modules: set[str]) -> set[str]:
    """The modules of `modules` one import statement (of a module in `package`) loads."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & modules
    base = node.module or ""
    if node.level:  # relative: `from . import x` in package a.b is a.b.x
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([node.module] if node.module else []))
    # `from pkg import name`: the submodule pkg.name where there is one, else pkg itself.
    found = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return found & modules


def import_graph(root: Path, top: Path) -> dict[str, set[str]]:
    """Module name -> the modules under `top` it imports anywhere in its source (top level, inside functions,
    under `if`s), for every module under `top`; names are dotted from `root`."""
    paths = {_module(p, root): p for p in sorted(top.rglob("*.py"))}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[name] |= _imported(node, package, modules) - {name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(reversed(e.args[1]))  # graphlib lists it against the import direction
    return None


def test_no_import_cycles_in_engine_kernels():
    graph = import_graph(ROOT, KERNELS)
    found = cycle(graph)
    assert found is None, f"import cycle {' -> '.join(found)}: move what both need into a module of its own"


def test_the_graph_sees_the_kernel_modules_imports():
    graph = import_graph(ROOT, KERNELS)
    assert {"engine.kernels.fp8.quant", "engine.kernels.pdl"} <= graph["engine.kernels.linear.triton"]
    assert "engine.kernels.linear.triton" in graph["engine.kernels.fp8.triton"]
    assert {"engine.kernels.moe.gemv", "engine.kernels.moe.combine"} <= graph["engine.kernels.moe.triton"]
    assert "engine.kernels.dispatch" in graph["engine.kernels.fp8"]  # a package's __init__ by its name


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from pkg import a\n    return a\n")
    graph = import_graph(tmp_path, pkg)
    assert graph["pkg.sub.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    found = cycle(graph)
    assert found is not None and found[0] == found[-1] and set(found) == {"pkg.a", "pkg.sub.b", "pkg.sub.c"}
    assert all(b in graph[a] for a, b in itertools.pairwise(found)), found  # each imports the next
    (pkg / "sub" / "c.py").write_text("def f():\n    return 1\n")
    assert cycle(import_graph(tmp_path, pkg)) is None
