"""The package layout's promises, checked on the source: no import cycles, a sans-IO core,
and dependencies that point one way (bench → extproc → limiter)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.paths import REPO

PACKAGES = ("limiter", "extproc")
IO_MODULES = {"asyncio", "socket", "redis", "aiohttp", "grpc", "httpx", "subprocess", "threading"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def module_imports(path: Path, *, type_checking: bool = True) -> Iterator[str]:
    """Modules ``path`` imports at module level (imports inside functions are deferred on
    purpose: lazy optional dependencies); ``type_checking=False`` leaves out those only the
    type checker sees."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) or (
                not type_checking and isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test)):
            continue
        for child in ast.walk(node):
            if isinstance(child, ast.Import):
                yield from (alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                yield child.module
                yield from (f"{child.module}.{alias.name}" for alias in child.names)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {m for m in module_imports(path) if m in known and m != name}
            for name, path in known.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, if any (a package importing its own submodules is not one)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_limiter_or_extproc() -> None:
    """Type-only imports included: a cycle hidden behind TYPE_CHECKING is still a cycle."""
    assert cycle(graph()) is None


def test_the_core_does_no_io_and_the_stores_live_apart() -> None:
    core = {name: path for name, path in modules().items()
            if name.startswith("limiter") and not name.startswith("limiter.stores")}
    for name, path in core.items():
        runtime = list(module_imports(path, type_checking=False))
        imported = {m.split(".")[0] for m in runtime}
        assert not imported & IO_MODULES, f"{name} imports {imported & IO_MODULES}"
        assert "extproc" not in imported, name
        assert not any(m.startswith("limiter.stores") for m in runtime), name


def test_the_product_never_imports_the_benchmarks() -> None:
    for name, path in modules().items():
        source = path.read_text()
        assert "import bench" not in source and "from bench" not in source, name
