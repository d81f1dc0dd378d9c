"""The import graph of ``src/rdzv`` keeps one direction of dependency.

Every module of the package is placed by name in one layer of ``LAYERS``,
lowest first (docs/architecture.md), and in an order inside its layer: a
module may import from a lower layer, or from a module placed before it in
its own layer, never from a higher layer or a later module, and a new
module fails ``test_every_module_is_in_a_layer`` until it is placed (one
line). Imports inside functions and under ``TYPE_CHECKING`` count: a lazy
import, or one only for the type checker, is still a dependency; so the
modules form no import cycle, which ``test_no_module_imports_itself_through_others``
checks on its own (naming the cycle). Three rules are finer than the layers: the contract imports only
``rdzv.errors``; the core reaches the backends only through the contract and
the capabilities over any Store; and the sans-I/O modules (``PURE``) import
no I/O, thread, clock or randomness module (``IMPURE``) and no rdzv module
but each other and ``rdzv.errors``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# (layer name, its modules), lowest first, each layer's modules in the order
# they may import each other; a package is placed by its own name.
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
            "rdzv.threads",
            "rdzv.metrics",
            "rdzv.worker",
            "rdzv.launch.warm_site.sitecustomize",
        ),
    ),
    (
        "API and retries",
        (
            "rdzv.api",
            "rdzv.retry",
            "rdzv.testing.clock",
        ),
    ),
    (
        "stores",
        (
            "rdzv.store.waiters",
            "rdzv.store.engine",
            "rdzv.store.memory",
            "rdzv.store.foreign",
            "rdzv.store.file",
            "rdzv.store.throttle",
            "rdzv.store._connection",
            "rdzv.store.admission",
            "rdzv.store.server",
            "rdzv.store.serve",
            "rdzv.store.link",
            "rdzv.store.will",
            "rdzv.store.tcp",
            "rdzv.store",
        ),
    ),
    (
        "capabilities and options",
        (
            "rdzv.backends.kv",
            "rdzv.backends.options",
        ),
    ),
    (
        "backends",
        (
            "rdzv.backends",
            "rdzv.backends.store",
            "rdzv.backends.etcd.gateway_codec",
            "rdzv.backends.etcd.client",
            "rdzv.backends.etcd.gateway",
            "rdzv.backends.etcd.grpc_proto",
            "rdzv.backends.etcd.grpc",
            "rdzv.backends.etcd.seats",
            "rdzv.backends.etcd.store",
            "rdzv.backends.etcd.backend",
            "rdzv.backends.etcd",
            "rdzv.backends.redis.connection",
            "rdzv.backends.redis.store",
            "rdzv.backends.redis.backend",
            "rdzv.backends.redis",
            "rdzv.testing.conformance",
            "rdzv.testing.memory",
            "rdzv.testing.store_conformance",
            "rdzv.testing",
        ),
    ),
    (
        "core decisions",
        (
            "rdzv.dynamic.state",
            "rdzv.dynamic.admission",
            "rdzv.dynamic.machine",
            "rdzv.dynamic.judging",
            "rdzv.dynamic.seat",
            "rdzv.dynamic.pacing",
        ),
    ),
    (
        "core driver",
        (
            "rdzv.dynamic.events",
            "rdzv.dynamic.shared",
            "rdzv.dynamic.confirm",
            "rdzv.dynamic.ticker",
            "rdzv.dynamic.keepalive",
            "rdzv.dynamic.bootstrap",
            "rdzv.dynamic.member",
            "rdzv.dynamic.admission_options",
            "rdzv.dynamic.join",
            "rdzv.dynamic.handler",
            "rdzv.dynamic",
            "rdzv.static",
        ),
    ),
    ("assembly", ("rdzv.registry",)),
    (
        "status",
        (
            "rdzv.first_failure",
            "rdzv.exclusion",
            "rdzv.status",
            "rdzv.status_cli",
        ),
    ),
    (
        "front-ends",
        (
            "rdzv.launch.barriers",
            "rdzv.launch.deathsig",
            "rdzv.launch.exits",
            "rdzv.launch.torch_server",
            "rdzv.launch.explain",
            "rdzv.launch.failures",
            "rdzv.launch.timers",
            "rdzv.launch.progress",
            "rdzv.launch.ranks",
            "rdzv.launch.bootstrap",
            "rdzv.launch.slurm",
            "rdzv.launch.workers",
            "rdzv.launch.warm",
            "rdzv.launch.config",
            "rdzv.launch.health",
            "rdzv.launch.watchdog",
            "rdzv.launch.agent",
            "rdzv.launch",
            "rdzv.launch.metrics",
            "rdzv.launch.options",
            "rdzv.launch.nproc",
            "rdzv.launch.run",
            "rdzv.torchrun.events",
            "rdzv.torch",
            "rdzv.torchrun.stores",
            "rdzv",
            "rdzv.torchrun.server_child",
            "rdzv.torchrun.__main__",
            "rdzv.torchrun.handler",
            "rdzv.torchrun",
            "rdzv.cli",
            "rdzv.__main__",
        ),
    ),
]

# The sans-I/O modules: they compute, and their drivers own the I/O, threads and time.
PURE: frozenset[str] = frozenset(
    {
        "rdzv.backends.base",
        "rdzv.backends.etcd.gateway_codec",
        "rdzv.backends.etcd.grpc_proto",
        "rdzv.backends.etcd.seats",
        "rdzv.dynamic.admission",
        "rdzv.dynamic.judging",
        "rdzv.dynamic.machine",
        "rdzv.dynamic.pacing",
        "rdzv.dynamic.seat",
        "rdzv.dynamic.state",
        "rdzv.keys",
        "rdzv.store.engine",
        "rdzv.store.protocol",
        "rdzv.store.waiters",
    }
)

# What a sans-I/O module never imports (by a module name's first part).
IMPURE: frozenset[str] = frozenset(
    {
        "_thread",
        "asyncio",
        "concurrent",
        "http",
        "io",
        "logging",
        "multiprocessing",
        "os",
        "pathlib",
        "random",
        "secrets",
        "select",
        "selectors",
        "shutil",
        "signal",
        "socket",
        "ssl",
        "subprocess",
        "sys",
        "tempfile",
        "threading",
        "time",
        "urllib",
    }
)

# Finer rules: importer prefix -> the only rdzv modules (prefixes) it may import
# from the named package.
RESTRICTED: list[tuple[str, str, tuple[str, ...]]] = [
    ("rdzv.backends.base", "rdzv", ("rdzv.errors",)),
    ("rdzv.dynamic", "rdzv.backends", ("rdzv.backends.base", "rdzv.backends.kv")),
]

_LAYER_OF = {module: index for index, (_, modules) in enumerate(LAYERS) for module in modules}
_RANK_OF = {module: rank for rank, module in enumerate(m for _, ms in LAYERS for m in ms)}


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int:
    """Return the index of the layer ``module`` is placed in."""
    if module not in _LAYER_OF:
        raise LookupError(f"{module} is in no layer; place it in LAYERS")
    return _LAYER_OF[module]


def _impure(importer: str, imported: str) -> bool:
    if importer not in PURE:
        return False
    if _matches(imported, "rdzv"):
        return imported not in PURE and imported != "rdzv.errors"
    return imported.partition(".")[0] in IMPURE


def violations(edges: set[tuple[str, str]]) -> list[str]:
    """Return a message for every import ``(importer, imported)`` against the rules.

    ``imported`` may be any module: only the sans-I/O rule reads those
    outside rdzv.
    """
    found: list[str] = []
    for importer, imported in sorted(edges):
        if _impure(importer, imported):
            found.append(f"{importer} is sans-I/O and imports {imported}")
        if not _matches(imported, "rdzv"):
            continue
        low, high = layer_of(imported), layer_of(importer)
        if low > high:
            found.append(f"{importer} ({LAYERS[high][0]}) imports {imported} ({LAYERS[low][0]})")
        elif low == high and _RANK_OF[imported] > _RANK_OF[importer]:
            found.append(
                f"{importer} ({LAYERS[high][0]}) imports {imported} "
                f"({LAYERS[low][0]}, placed after it)"
            )
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


def import_cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Return the import cycles of ``edges``: each strongly connected set of modules, sorted."""
    graph: dict[str, list[str]] = {}
    for importer, imported in sorted(edges):
        graph.setdefault(importer, []).append(imported)
        graph.setdefault(imported, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        # Tarjan's algorithm, iterative: (module, its next successor to visit).
        work = [(root, 0)]
        while work:
            module, next_child = work.pop()
            if next_child == 0:
                index[module] = low[module] = len(index)
                stack.append(module)
                on_stack.add(module)
            children = graph[module]
            if next_child < len(children):
                work.append((module, next_child + 1))
                child = children[next_child]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
    return sorted(found)


def test_no_module_imports_itself_through_others() -> None:
    assert import_cycles(import_edges()) == []


def test_a_cycle_through_a_type_checking_import_is_caught() -> None:
    # The cycle of issue 53: the server imports its connection and admission,
    # which imported the server back for its type only.
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rdzv.store import server\n"
    )
    tree = ast.parse(source)
    found = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert found == {"typing", "rdzv.store"}  # ast.walk reaches under TYPE_CHECKING
    edges = {
        ("rdzv.store.server", "rdzv.store._connection"),
        ("rdzv.store.server", "rdzv.store.admission"),
        ("rdzv.store.admission", "rdzv.store._connection"),
        ("rdzv.store._connection", "rdzv.store.server"),
        ("rdzv.store.engine", "rdzv.store.protocol"),
    }
    assert import_cycles(edges) == [
        ["rdzv.store._connection", "rdzv.store.admission", "rdzv.store.server"]
    ]
    assert (
        "rdzv.store._connection (stores) imports rdzv.store.server (stores, placed after it)"
        in (violations(edges))
    )


def test_every_module_is_in_a_layer() -> None:
    placed = [module for _, modules in LAYERS for module in modules]
    assert len(placed) == len(set(placed)), "a module is placed twice"
    modules = {_module_name(p) for p in SRC.rglob("*.py")}
    modules |= {m for edge in import_edges() for m in edge}
    assert sorted(modules - set(placed)) == [], "place these modules in LAYERS"
    assert sorted(set(placed) - modules) == [], "these placed modules do not exist"
    assert sorted(PURE - modules) == [], "these sans-I/O modules do not exist"


def test_an_unplaced_module_is_in_no_layer() -> None:
    for module in ("rdzv.brand_new", "rdzv.dynamic.brand_new", "rdzv.store.brand_new"):
        with pytest.raises(LookupError):
            layer_of(module)


def test_imports_follow_the_layers() -> None:
    assert violations(all_imports()) == []


@pytest.mark.parametrize(
    "edge",
    [
        # The backward edges of 756ab93, each of which must stay caught.
        ("rdzv.backends.etcd.backend", "rdzv.dynamic.handler"),
        ("rdzv.backends.redis.backend", "rdzv.dynamic.handler"),
        ("rdzv.dynamic.handler", "rdzv.backends.store"),
        ("rdzv.backends.base", "rdzv.api"),
        ("rdzv.dynamic.state", "rdzv.status"),
        ("rdzv.store.tcp", "rdzv.registry"),
        ("rdzv.registry", "rdzv.cli"),
        # Edges inside the once-wide layers of 38636e1.
        ("rdzv.dynamic.machine", "rdzv.dynamic.handler"),
        ("rdzv.api", "rdzv.store.server"),
        ("rdzv.retry", "rdzv.store.tcp"),
        ("rdzv.status", "rdzv.launch.ranks"),
        # Upward edges inside a layer (issue 53).
        ("rdzv.store.admission", "rdzv.store.server"),
        ("rdzv.store.engine", "rdzv.store.memory"),
        ("rdzv.dynamic.shared", "rdzv.dynamic.handler"),
        ("rdzv.launch.workers", "rdzv.launch.agent"),
    ],
)
def test_a_backward_edge_is_caught(edge: tuple[str, str]) -> None:
    # By the layers, or by a finer rule (the core's only way to the backends).
    importer, imported = edge
    assert any(
        (m.startswith(f"{importer} (") and f" imports {imported} (" in m)
        or m.startswith(f"{importer} may import from ")
        for m in violations({edge})
    )


@pytest.mark.parametrize(
    "edge",
    [
        ("rdzv.dynamic.machine", "time"),
        ("rdzv.store.protocol", "socket"),
        ("rdzv.backends.etcd.gateway_codec", "os.path"),
        ("rdzv.dynamic.seat", "threading"),
        # rdzv modules of a lower layer that are not sans-I/O themselves
        ("rdzv.store.engine", "rdzv.threads"),
        ("rdzv.dynamic.state", "rdzv.retry"),
    ],
)
def test_a_sans_io_module_importing_io_is_caught(edge: tuple[str, str]) -> None:
    assert f"{edge[0]} is sans-I/O and imports {edge[1]}" in violations({edge})


def test_relative_imports_are_resolved() -> None:
    node = ast.parse("from .machine import decide").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve("rdzv.dynamic.handler", False, node) == "rdzv.dynamic.machine"
    assert _resolve("rdzv.dynamic", True, node) == "rdzv.dynamic.machine"


def test_grpc_is_imported_only_by_the_grpc_client() -> None:
    # The core stays standard library: grpcio is the etcd extra's, and its one
    # module (rdzv.backends.etcd.grpc) is imported only by create_client, lazily.
    importers = {a for a, b in all_imports() if _matches(b, "grpc")}
    assert importers == {"rdzv.backends.etcd.grpc"}
    lazy = {a for a, b in all_imports() if b == "rdzv.backends.etcd.grpc"}
    assert lazy == {"rdzv.backends.etcd.backend"}
    source = (SRC / "rdzv" / "backends" / "etcd" / "backend.py").read_text()
    top_level = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.ImportFrom) and node.module == "rdzv.backends.etcd.grpc"
    ]
    assert top_level == []
