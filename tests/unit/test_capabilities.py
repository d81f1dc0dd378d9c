"""A backend's capabilities are adapted once, where the handler is built, not asked where used."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TypeGuard

import rdzv.backends.base as base

# The capability ABCs: a backend offers one by subclassing it.
CAPABILITIES = {
    name
    for name, value in vars(base).items()
    if isinstance(value, type)
    and name.endswith("Backend")
    and value.__doc__
    and value.__doc__.startswith("Capability:")
}

# Where the driver may ask: the handler adapts each capability once, and
# shared_state picks the reads that suit the backend once.
BUILDERS = {("handler.py", "__init__"), ("shared.py", "shared_state")}


def _is_asked(node: ast.AST) -> TypeGuard[ast.Call]:
    """Tell whether ``node`` is ``isinstance(x, <a capability, or a tuple naming one>)``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and any(isinstance(n, ast.Name) and n.id in CAPABILITIES for n in ast.walk(node.args[1]))
    )


def _asked(path: Path) -> list[tuple[str, int]]:
    """Return ``(function, line)`` of each isinstance check of a capability in ``path``."""
    return [
        (function.name, node.lineno)
        for function in ast.walk(ast.parse(path.read_text()))
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if _is_asked(node)
    ]


def test_the_capabilities_are_the_documented_ones() -> None:
    assert {
        "WatchableBackend",
        "SeatedBackend",
        "JoinQueueBackend",
        "VerdictBackend",
        "LivenessBackend",
        "ListedBackend",
    } == CAPABILITIES


def test_the_driver_asks_for_a_capability_only_where_it_adapts_it() -> None:
    dynamic = Path(base.__file__).parent.parent / "dynamic"
    asked = {
        f"{path.name}:{function}:{line}"
        for path in sorted(dynamic.glob("*.py"))
        for function, line in _asked(path)
        if (path.name, function) not in BUILDERS
    }
    assert asked == set()
    assert {path.name for path in dynamic.glob("*.py") if _asked(path)} == {
        "handler.py",
        "shared.py",
    }
