"""The import graph of ``src/rdzv`` keeps one direction of dependency.

Every module of the package is placed by name in one layer of ``LAYERS``,
lowest first (docs/architecture.md): a module may import from its own layer
or a lower one, never a higher one, and a new module fails
``test_every_module_is_in_a_layer`` until it is placed (one line). Imports
inside functions and under ``TYPE_CHECKING`` count: a lazy import is still a
dependency. Three rules are finer than the layers: the contract imports only
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

# (layer name, its modules), lowest first; a package is placed by its own name.
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
            "rdzv.store",
            "rdzv.store.engine",
            "rdzv.store.memory",
            "rdzv.store.foreign",
            "rdzv.store.file",
            "rdzv.store.throttle",
            "rdzv.store.admission",
            "rdzv.store._connection",
            "rdzv.store.server",
            "rdzv.store.serve",
            "rdzv.store.link",
            "rdzv.store.tcp",
            "rdzv.store.will",
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
            "rdzv.backends.etcd",
            "rdzv.backends.etcd_base",
            "rdzv.backends.etcd_client",
            "rdzv.backends.etcd_gateway",
            "rdzv.backends.etcd_grpc",
            "rdzv.backends.etcd_proto",
            "rdzv.backends.etcd_seats",
            "rdzv.backends.etcd_store",
            "rdzv.backends.redis",
            "rdzv.backends.redis_connection",
            "rdzv.backends.redis_store",
            "rdzv.testing",
            "rdzv.testing.conformance",
            "rdzv.testing.memory",
            "rdzv.testing.store_conformance",
        ),
    ),
    (
        "core decisions",
        (
            "rdzv.dynamic.state",
            "rdzv.dynamic.admission",
            "rdzv.dynamic.seat",
            "rdzv.dynamic.machine",
            "rdzv.dynamic.pacing",
        ),
    ),
    (
        "core driver",
        (
            "rdzv.dynamic",
            "rdzv.dynamic.shared",
            "rdzv.dynamic.confirm",
            "rdzv.dynamic.ticker",
            "rdzv.dynamic.keepalive",
            "rdzv.dynamic.bootstrap",
            "rdzv.dynamic.member",
            "rdzv.dynamic.admission_options",
            "rdzv.dynamic.join",
            "rdzv.dynamic.handler",
            "rdzv.static",
        ),
    ),
    ("assembly", ("rdzv.registry",)),
    ("status", ("rdzv.status", "rdzv.first_failure")),
    (
        "front-ends",
        (
            "rdzv.launch",
            "rdzv.launch.agent",
            "rdzv.launch.barriers",
            "rdzv.launch.config",
            "rdzv.launch.exits",
            "rdzv.launch.bootstrap",
            "rdzv.launch.explain",
            "rdzv.launch.failures",
            "rdzv.launch.timers",
            "rdzv.launch.warm",
            "rdzv.launch.watchdog",
            "rdzv.launch.metrics",
            "rdzv.launch.options",
            "rdzv.launch.progress",
            "rdzv.launch.ranks",
            "rdzv.launch.run",
            "rdzv.launch.slurm",
            "rdzv.launch.workers",
            "rdzv.torchrun",
            "rdzv.torchrun.__main__",
            "rdzv.torchrun.events",
            "rdzv.torchrun.handler",
            "rdzv.torchrun.server_child",
            "rdzv.torchrun.stores",
            "rdzv.torch",
            "rdzv.cli",
            "rdzv.__main__",
            "rdzv",
        ),
    ),
]

# The sans-I/O modules: they compute, and their drivers own the I/O, threads and time.
PURE: frozenset[str] = frozenset(
    {
        "rdzv.backends.base",
        "rdzv.backends.etcd_gateway",
        "rdzv.backends.etcd_proto",
        "rdzv.backends.etcd_seats",
        "rdzv.dynamic.admission",
        "rdzv.dynamic.machine",
        "rdzv.dynamic.pacing",
        "rdzv.dynamic.seat",
        "rdzv.dynamic.state",
        "rdzv.keys",
        "rdzv.store.engine",
        "rdzv.store.protocol",
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
        ("rdzv.backends.etcd", "rdzv.dynamic.handler"),
        ("rdzv.backends.redis", "rdzv.dynamic.handler"),
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
        ("rdzv.backends.etcd_gateway", "os.path"),
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
    # module (rdzv.backends.etcd_grpc) is imported only by create_client, lazily.
    importers = {a for a, b in all_imports() if _matches(b, "grpc")}
    assert importers == {"rdzv.backends.etcd_grpc"}
    lazy = {a for a, b in all_imports() if b == "rdzv.backends.etcd_grpc"}
    assert lazy == {"rdzv.backends.etcd"}
    source = (SRC / "rdzv" / "backends" / "etcd.py").read_text()
    top_level = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.ImportFrom) and node.module == "rdzv.backends.etcd_grpc"
    ]
    assert top_level == []
