"""Every public name of torch's rendezvous module and of the tensorplay spec imports from rdzv."""

import ast
import importlib
import inspect

import pytest

import rdzv

SPEC_NAMES = [
    # errors
    "RendezvousError",
    "RendezvousClosedError",
    "RendezvousTimeoutError",
    "RendezvousConnectionError",
    "RendezvousStateError",
    "RendezvousGracefulExitError",
    "RendezvousExhaustedError",
    # api
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousStoreInfo",
    "RendezvousParameters",
    "RendezvousSettings",
    "RendezvousTimeout",
    # registry
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "rendezvous_handler_registry",
    "create_handler",
    "get_registry",
    "parse_rendezvous_endpoint",
    # dynamic rendezvous and backends
    "RendezvousBackend",
    "DynamicRendezvousHandler",
    "C10dRendezvousBackend",
    "P10dRendezvousBackend",
    "TpRendezvousBackend",
    "EtcdRendezvousBackend",
    "StaticTCPRendezvous",
]

# The per-backend factories live in their modules, as in torch.
BACKEND_FUNCTIONS = [
    ("rdzv.backends.store", "create_backend"),
    ("rdzv.backends.etcd", "create_backend"),
    ("rdzv.backends.redis", "create_backend"),
    ("rdzv.dynamic", "create_handler"),
    ("rdzv.static", "create_rdzv_handler"),
]


def test_all_holds_every_spec_name() -> None:
    missing = [name for name in SPEC_NAMES if name not in rdzv.__all__]
    assert missing == []


def test_per_backend_factories_exist() -> None:
    for module, name in BACKEND_FUNCTIONS:
        function = getattr(importlib.import_module(module), name)
        assert callable(function)
        assert (function.__doc__ or "").strip(), f"{module}.{name} has no docstring"


def test_the_store_backend_has_every_alias() -> None:
    assert rdzv.C10dRendezvousBackend is rdzv.P10dRendezvousBackend is rdzv.TpRendezvousBackend


def test_every_name_in_all_imports_and_is_documented() -> None:
    for name in rdzv.__all__:
        value = getattr(rdzv, name)
        if (
            callable(value)
            and not isinstance(value, type(rdzv))
            and name != "RendezvousHandlerCreator"
        ):
            assert (value.__doc__ or "").strip(), f"{name} has no docstring"


def test_from_import_works_for_all_names() -> None:
    module = importlib.import_module("rdzv")
    namespace: dict[str, object] = {}
    exec("from rdzv import *", namespace)
    for name in module.__all__:
        assert name in namespace


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        rdzv.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("package", ["rdzv", "rdzv.store"])
def test_the_imports_for_type_checkers_name_the_public_names(package: str) -> None:
    # The lazy table is the one list (__all__ comes from it); the imports a
    # type checker reads cannot be derived, so they must agree with it, each
    # name re-exported as itself.
    module = importlib.import_module(package)
    tree = ast.parse(inspect.getsource(module))
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    imported = {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name
    }
    assert imported == module._EXPORTS
    assert sorted(module.__all__) == sorted(
        [*module._EXPORTS, *(["__version__"] * (package == "rdzv"))]
    )
