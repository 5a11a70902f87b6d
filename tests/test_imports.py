"""The package's seams, read from the source: which module imports which (function-local imports
included, so a cycle cannot hide inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tessera"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:``: they never run (annotations only), so they make
    no import cycle; every other import counts, wherever it sits."""
    return {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
        for statement in block.body
        for node in ast.walk(statement)
    }


def imports() -> dict[str, set[str]]:
    """Every tessera module and the tessera modules it imports anywhere in its body (outside type-only blocks)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        tree = ast.parse(path.read_text())
        skipped = _type_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:  # `from pkg import submodule` depends on the submodule
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
        graph[name] = {m for m in found if m in modules}
    return graph


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_parallel_never_imports_the_models() -> None:
    """parallel/ receives a chosen policy; the model families (models/) build on parallel/, not the reverse."""
    wrong = {m: sorted(d for d in deps if _inside(d, "tessera.models")) for m, deps in imports().items()}
    wrong = {m: d for m, d in wrong.items() if d and _inside(m, "tessera.parallel")}
    assert not wrong, f"parallel/ imports models/: {wrong}"


def test_the_runtime_knows_nothing_of_clusters_or_the_planner() -> None:
    """Emulation reaches the runtime only as hooks handed to the Booster."""
    banned = ("tessera.cluster", "tessera.planner")
    wrong = {
        m: sorted(d for d in deps if any(_inside(d, b) for b in banned))
        for m, deps in imports().items()
        if _inside(m, "tessera.runtime") or m == "tessera.booster"
    }
    assert not any(wrong.values()), f"the runtime imports: {wrong}"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module
    (Tarjan), plus modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_even_through_function_local_imports() -> None:
    assert not cycles(imports()), f"import cycles: {cycles(imports())}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_clusters_do_not_import_the_planner() -> None:
    """The planner builds on cluster descriptions (and emulation plays them), never the reverse."""
    wrong = {
        m: sorted(d for d in deps if _inside(d, "tessera.planner"))
        for m, deps in imports().items()
        if _inside(m, "tessera.cluster")
    }
    assert not any(wrong.values()), f"cluster/ imports the planner: {wrong}"
