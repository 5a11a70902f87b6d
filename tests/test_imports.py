"""The package's seams, read from the source: which module imports which (function-local imports
included, so a cycle cannot hide inside a function)."""

from __future__ import annotations

import ast
import functools
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


@functools.cache  # parsed once for all the rules below (the source does not change during a run)
def imports() -> dict[str, frozenset[str]]:
    """Every tessera module and the tessera modules it imports anywhere in its body (outside type-only blocks)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, frozenset[str]] = {}
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
        graph[name] = frozenset(m for m in found if m in modules)
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


def cycles(graph: dict[str, frozenset[str]] | dict[str, set[str]]) -> list[list[str]]:
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


def _importers(target: str, among: str | None = None) -> dict[str, list[str]]:
    """Modules (inside ``among`` when given) that import something inside ``target``, with what."""
    found = {
        m: sorted(d for d in deps if _inside(d, target))
        for m, deps in imports().items()
        if among is None or _inside(m, among) or m == among
    }
    return {m: d for m, d in found.items() if d}


def test_the_booster_and_runtime_meet_the_groups_through_one_membership_and_know_no_testbed() -> None:
    """Everything between Plan.groups is the across package's: the Booster obtains one Membership
    (tessera.across.membership) and reaches into nothing else of it; neither it nor the runtime plays a
    cluster (the testbed, emulation): hooks are handed in."""
    for module in ("tessera.booster", "tessera.runtime"):
        across = {m: d for m, d in _importers("tessera.across", module).items() if d != ["tessera.across.membership"]}
        assert not across, f"{module} reaches into the across package: {across}"
        testbed = _importers("tessera.testbed", module)
        assert not testbed, f"{module} imports the testbed: {testbed}"


def test_only_the_across_packages_front_doors_are_used_from_outside() -> None:
    """The runtime's door (membership), the launcher's (lighthouse: starting torchft's Lighthouse) and the
    data-parallel wrapper's (hierarchical: its DDP hook for gradients crossing groups every step)."""
    doors = {"tessera.across.membership", "tessera.across.lighthouse", "tessera.across.hierarchical"}
    wrong = {
        m: [d for d in deps if d not in doors]
        for m, deps in _importers("tessera.across").items()
        if not _inside(m, "tessera.across")
    }
    wrong = {m: d for m, d in wrong.items() if d}
    assert not wrong, f"modules reach past the across package's doors: {wrong}"


def test_the_launcher_never_imports_the_rank_side() -> None:
    """tessera.launch parses, checks and launches; what runs on a rank (tessera.train) is named, never
    imported, so a launch builds neither the model nor the training loop."""
    wrong = _importers("tessera.train", "tessera.launch")
    assert not wrong, f"the launcher imports the rank side: {wrong}"


def test_the_mechanisms_and_the_runtime_do_not_import_the_data_package() -> None:
    """parallel/ and runtime/ take batches as tensors; the mask that keeps packed records apart lives in
    tessera.packing, not with the data that packs them."""
    for package in ("tessera.parallel", "tessera.runtime"):
        wrong = _importers("tessera.data", package)
        assert not wrong, f"{package} imports data/: {wrong}"


def test_checkpoints_know_no_component() -> None:
    """The checkpoint code saves what the optimizer's parts give it: it imports neither the mechanisms
    (ZeRO-1, experts) nor the groups' outer sync nor the runtime."""
    for package in ("tessera.parallel", "tessera.across", "tessera.runtime", "tessera.optim"):
        wrong = _importers(package, "tessera.checkpoint")
        assert not wrong, f"tessera.checkpoint imports {package}: {wrong}"


def test_the_rank_arithmetic_has_one_home() -> None:
    """Only tessera.plan.grid turns ranks into coordinates: no other module calls its rank-order helper (the
    planner walks ranks in order through grid_order, written there too)."""
    callers = {
        m
        for m, path in ((m, PACKAGE.parent / (m.replace(".", "/") + ".py")) for m in imports())
        if path.is_file() and "grid_coords(" in path.read_text() and m != "tessera.plan.grid"
    }
    assert not callers, f"rank arithmetic outside tessera.plan.grid: {callers}"
