"""The import graph of ``src/rdzv`` keeps one direction of dependency.

contract -> foundation -> store capabilities and backends -> core -> assembly
-> front-ends (docs/architecture.md). Every module of the package is placed
in a layer below; a module may import from its own layer or a lower one,
never a higher one. Imports inside functions and under ``TYPE_CHECKING``
count: a lazy import is still a dependency. Two rules are finer than the
layers: the contract imports only ``rdzv.errors``, and the core reaches the
backends only through the contract and the capabilities over any Store.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# (layer name, module prefixes); a module belongs to the longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("rdzv.errors",)),
    (
        "contract and leaves",
        (
            "rdzv.backends.base",
            "rdzv.keys",
            "rdzv._lazy",
            "rdzv.endpoint",
            "rdzv.utils",
            "rdzv.net",
            "rdzv.auth",
            "rdzv.store.base",
            "rdzv.store.protocol",
            "rdzv.testing.netns",
            "rdzv.metrics",
            "rdzv.threads",
        ),
    ),
    ("stores and API", ("rdzv.store", "rdzv.api", "rdzv.retry", "rdzv.testing.clock")),
    ("capabilities and options", ("rdzv.backends.kv", "rdzv.backends.options")),
    ("backends", ("rdzv.backends", "rdzv.testing")),
    ("core", ("rdzv.dynamic", "rdzv.static")),
    ("assembly", ("rdzv.registry",)),
    (
        "front-ends",
        (
            "rdzv.launch",
            "rdzv.status",
            "rdzv.torchrun",
            "rdzv.torch",
            "rdzv.cli",
            "rdzv.__main__",
            "rdzv",
        ),
    ),
]

# Finer rules: importer prefix -> the only rdzv modules (prefixes) it may import
# from the named package.
RESTRICTED: list[tuple[str, str, tuple[str, ...]]] = [
    ("rdzv.backends.base", "rdzv", ("rdzv.errors",)),
    ("rdzv.dynamic", "rdzv.backends", ("rdzv.backends.base", "rdzv.backends.kv")),
]


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int:
    """Return the index of the layer of ``module`` (the longest matching prefix wins)."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _matches(module, prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    if best is None:
        raise LookupError(f"{module} is in no layer; place it in LAYERS")
    return best[1]


def violations(edges: set[tuple[str, str]]) -> list[str]:
    """Return a message for every edge ``(importer, imported)`` against the layering."""
    found: list[str] = []
    for importer, imported in sorted(edges):
        low, high = layer_of(imported), layer_of(importer)
        if low > high:
            found.append(f"{importer} ({LAYERS[high][0]}) imports {imported} ({LAYERS[low][0]})")
        for who, package, allowed in RESTRICTED:
            if (
                _matches(importer, who)
                and _matches(imported, package)
                and not any(_matches(imported, a) for a in allowed)
            ):
                found.append(f"{importer} may import from {package} only {', '.join(allowed)}")
    return found


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def all_imports() -> set[tuple[str, str]]:
    """Every ``(importer, imported)`` pair of an rdzv module, lazy ones included."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    edges: set[tuple[str, str]] = set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, path.name == "__init__.py", node)
                # ``from rdzv.x import y`` may name a submodule y.
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            edges.update((module, target) for target in targets if target != module)
    return edges


def import_edges() -> set[tuple[str, str]]:
    """Every ``(importer, imported)`` pair between rdzv modules, lazy ones included."""
    return {
        (importer, imported) for importer, imported in all_imports() if _matches(imported, "rdzv")
    }


def test_every_module_is_in_a_layer() -> None:
    modules = {m for edge in import_edges() for m in edge}
    modules |= {_module_name(p) for p in SRC.rglob("*.py")}
    for module in sorted(modules):
        layer_of(module)


def test_imports_follow_the_layers() -> None:
    assert violations(import_edges()) == []


@pytest.mark.parametrize(
    "edge",
    [
        # The backward edges of 756ab93, each of which must stay caught.
        ("rdzv.backends.etcd", "rdzv.dynamic.handler"),
        ("rdzv.backends.redis", "rdzv.dynamic.handler"),
        ("rdzv.dynamic.handler", "rdzv.backends.store"),
        ("rdzv.backends.base", "rdzv.api"),
        ("rdzv.dynamic.state", "rdzv.status"),
        ("rdzv.store.tcp", "rdzv.registry"),
        ("rdzv.registry", "rdzv.cli"),
    ],
)
def test_a_backward_edge_is_caught(edge: tuple[str, str]) -> None:
    assert violations({edge}), f"{edge} should violate the layering"


def test_relative_imports_are_resolved() -> None:
    node = ast.parse("from .machine import decide").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve("rdzv.dynamic.handler", False, node) == "rdzv.dynamic.machine"
    assert _resolve("rdzv.dynamic", True, node) == "rdzv.dynamic.machine"
