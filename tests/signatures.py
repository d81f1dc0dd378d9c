"""rdzv's public signatures against the reference specs' (tests/unit/test_spec_signatures.py
for the tensorplay spec, tests/torchcompat/test_signatures.py for torch 2.13).

A signature is compared by its :func:`shape`: parameter names, kinds,
defaults and order, without annotations. Where rdzv differs on purpose,
:data:`TORCH_DIFFERENCES` or :data:`TENSORPLAY_DIFFERENCES` pins rdzv's
shape under the spec's name (``<spec module>.<qualified name>``), and
docs/torch-compat.md's signature table has a row naming it
(:func:`documented`). :func:`drift` reports any other difference, a pinned
shape that changed, and a pinned name that no longer differs.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "torch-compat.md"
TABLE_HEADING = "### Signatures"
ABSENT = "absent"


def shape(obj: object) -> str:
    """Return ``obj``'s signature without annotations, ``(property)`` or :data:`ABSENT`."""
    if obj is None:
        return ABSENT
    if isinstance(obj, property):
        return "(property)"
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(no signature)"
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def parse(text: str) -> str:
    """Return the :func:`shape` of a signature written as ``(a, b=1, *args, c=None, **kw)``."""
    function: Callable[..., None] = eval(  # the tests' own literals
        f"lambda {text.strip()[1:-1]}: None", {"timedelta": timedelta}
    )
    return shape(function)


def member(module: str, qualname: str) -> object:
    """Return ``module.qualname``, None when absent; a property as itself, not its value."""
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = (
            inspect.getattr_static(obj, part, None)
            if inspect.isclass(obj)
            else getattr(obj, part, None)
        )
        if obj is None:
            return None
        if isinstance(obj, (staticmethod, classmethod)):  # as called: no cls
            obj = obj.__get__(None, object)
    return obj


def drift(
    reference: Mapping[str, str], ours: Mapping[str, str], allowed: Mapping[str, str]
) -> list[str]:
    """Return every difference of ``ours`` from ``reference`` the allow-list does not pin.

    All three map a spec name to a :func:`shape`; ``allowed`` holds rdzv's
    shape where it differs on purpose.
    """
    problems = []
    for name, expected in reference.items():
        actual = ours[name]
        if actual == expected:
            if name in allowed:
                problems.append(f"{name}: allow-listed, but now the same as the spec's {expected}")
        elif name not in allowed:
            problems.append(f"{name}: spec {expected}, rdzv {actual} (not allow-listed)")
        elif allowed[name] != actual:
            problems.append(f"{name}: allow-listed as {allowed[name]}, rdzv now {actual}")
    problems.extend(f"{name}: allow-listed, not a spec name" for name in set(allowed) - set(ours))
    return problems


def documented() -> set[str]:
    """Return the names in the first column of docs/torch-compat.md's signature table."""
    section = DOC.read_text(encoding="utf-8").split(TABLE_HEADING, 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}


# rdzv's shapes that differ from a spec's on purpose (docs/torch-compat.md, "Signatures").
# Those of objects both specs name are written once.
_REGISTRY = "(load_entry_points=True)"
_REGISTER = "(self, backend, creator, origin=None)"
_SETTINGS = (
    "(run_id, min_nodes, max_nodes, timeout=None, keep_alive_interval=datetime.timedelta("
    "seconds=5), keep_alive_max_attempt=3, join=None, last_call=None, close=None, heartbeat=None)"
)
_DYNAMIC = (
    "(node, settings, backend_name, store, backend, local_addr, node_rank=None, clock=None, "
    "admission=None)"
)
_FROM_BACKEND = (
    "(run_id, store, backend, min_nodes, max_nodes, local_addr=None, timeout=None, "
    "keep_alive_interval=5, keep_alive_max_attempt=3, *, node_rank=None, clock=None, "
    "admission=None)"
)
_STORE_BACKEND = "(store, run_id, liveness_store=None, clock=None)"
_ETCD_BACKEND = (
    "(client, run_id, key_prefix=None, ttl=None, liveness_ttl=None, *, owns_client=False, "
    "clock=None)"
)
_STATIC = "(params_or_endpoint, master_port=None, rank=None, world_size=1, run_id='', timeout=600)"

TORCH_DIFFERENCES: dict[str, str] = {
    "api.RendezvousHandlerRegistry": _REGISTRY,
    "api.RendezvousHandlerRegistry.register": _REGISTER,
    "api.RendezvousInfo": (
        "(store, rank, world_size, bootstrap_store_info=None, participants=None, wait_list=None)"
    ),
    "api.RendezvousParameters": (
        "(backend, endpoint, run_id, *args, min_nodes=None, max_nodes=None, local_addr=None, "
        "node_rank=0, local_world_size=1, config=None, **kwargs)"
    ),
    "api.RendezvousStoreInfo.build": "(rank, store, local_addr=None, server_port=None)",
    "dynamic_rendezvous.RendezvousSettings": _SETTINGS,
    "dynamic_rendezvous.DynamicRendezvousHandler": _DYNAMIC,
    "dynamic_rendezvous.DynamicRendezvousHandler.from_backend": _FROM_BACKEND,
    "dynamic_rendezvous.create_handler": "(store, backend, params, admission=None)",
    "c10d_rendezvous_backend.C10dRendezvousBackend": _STORE_BACKEND,
    "etcd_rendezvous_backend.EtcdRendezvousBackend": _ETCD_BACKEND,
    "static_tcp_rendezvous.StaticTCPRendezvous": _STATIC,
}

TENSORPLAY_DIFFERENCES: dict[str, str] = {
    "api.RendezvousStoreInfo": "(master_addr, master_port)",
    "api.RendezvousHandlerRegistry": _REGISTRY,
    "api.RendezvousHandlerRegistry.register": _REGISTER,
    "dynamic_rendezvous.RendezvousSettings": _SETTINGS,
    "dynamic_rendezvous.DynamicRendezvousHandler": _DYNAMIC,
    "dynamic_rendezvous.DynamicRendezvousHandler.from_backend": _FROM_BACKEND,
    "dynamic_rendezvous.DynamicRendezvousHandler.use_agent_store": "(property)",
    "dynamic_rendezvous.create_handler": "(store, backend, params, admission=None)",
    "core_rendezvous_backend.RendezvousBackend.set_state": "(self, state, token=None)",
    "core_rendezvous_backend.CoreRendezvousBackend": _STORE_BACKEND,
    "core_rendezvous_backend.create_backend": "(params)",
    "c10d_rendezvous_backend.C10dRendezvousBackend": _STORE_BACKEND,
    "p10d_rendezvous_backend.P10dRendezvousBackend": _STORE_BACKEND,
    "tp_rendezvous_backend.TpRendezvousBackend": _STORE_BACKEND,
    "etcd_rendezvous_backend.EtcdRendezvousBackend": _ETCD_BACKEND,
    "static_tcp_rendezvous.StaticTCPRendezvous": _STATIC,
}
