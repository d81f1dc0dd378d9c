"""rdzv's public signatures against the tensorplay spec's, and the documented differences.

tensorplay is not installed, so its signatures are data here, read from
``tensorplay/distributed/elastic/rendezvous/`` of lexing-2026/TensorPlay (the
commit of each file is named above its entries). Out of scope: the legacy
etcd modules (``etcd_rendezvous``, ``etcd_store``, ``etcd_server``), which
rdzv does not mirror (docs/torch-compat.md, the etcd row), and the private
names the spec's ``__init__`` exports.
"""

from __future__ import annotations

from tests.signatures import (
    TENSORPLAY_DIFFERENCES,
    TORCH_DIFFERENCES,
    documented,
    drift,
    member,
    parse,
    shape,
)

HANDLER_METHODS = (
    "get_backend",
    "next_rendezvous",
    "is_closed",
    "set_closed",
    "num_nodes_waiting",
    "get_run_id",
    "shutdown",
    "pre_shutdown",
)


def handler_methods(name: str, target: str) -> dict[str, tuple[str, str]]:
    """The ``(self)`` methods every spec handler has (its own or its base's)."""
    return {f"{name}.{method}": (target, "(self)") for method in HANDLER_METHODS}


# spec name -> (rdzv object as "module" (same qualified name) or "module:qualname", signature)
SPEC: dict[str, tuple[str, str]] = {
    # api.py @ 4d92f3037b928d66842628d8696cd0b9eb4cd82d
    "api.RendezvousExhaustedError": ("rdzv", "(config, timeout)"),
    "api.RendezvousStoreInfo": ("rdzv", "(master_addr, port)"),
    "api.RendezvousStoreInfo.build": ("rdzv", "(rank, store, local_addr=None, server_port=None)"),
    "api.RendezvousInfo": (
        "rdzv",
        "(store, rank, world_size, bootstrap_store_info=None, participants=None, wait_list=None)",
    ),
    "api.RendezvousHandler": ("rdzv", "()"),
    **handler_methods("api.RendezvousHandler", "rdzv"),
    "api.RendezvousParameters": (
        "rdzv",
        (
            "(backend, endpoint, run_id, *args, min_nodes=None, max_nodes=None, local_addr=None,"
            " node_rank=0, local_world_size=1, config=None, **kwargs)"
        ),
    ),
    "api.RendezvousParameters.get": ("rdzv", "(self, key, default=None)"),
    "api.RendezvousParameters.get_as_bool": ("rdzv", "(self, key, default=None)"),
    "api.RendezvousParameters.get_as_int": ("rdzv", "(self, key, default=None)"),
    "api.RendezvousTimeout": ("rdzv", "(join=None, last_call=None, close=None, heartbeat=None)"),
    "api.RendezvousTimeout.from_params": ("rdzv", "(params)"),
    "api.RendezvousHandlerRegistry": ("rdzv", "()"),
    "api.RendezvousHandlerRegistry.register": ("rdzv", "(self, backend, creator)"),
    "api.RendezvousHandlerRegistry.create_handler": ("rdzv", "(self, params)"),
    "api.get_registry": ("rdzv", "()"),
    "api.create_handler": ("rdzv", "(params)"),
    # dynamic_rendezvous.py @ 3fcf19d68311dc8372c69d49338586b52977bb31
    "dynamic_rendezvous.RendezvousSettings": (
        "rdzv",
        (
            "(join=timedelta(seconds=600), last_call=timedelta(seconds=30),"
            " close=timedelta(seconds=30), heartbeat=timedelta(seconds=5), min_nodes=1, max_nodes=1)"
        ),
    ),
    "dynamic_rendezvous.DynamicRendezvousHandler": (
        "rdzv",
        "(backend, settings, local_addr, node_rank, run_id, store=None, backend_name='core')",
    ),
    "dynamic_rendezvous.DynamicRendezvousHandler.from_backend": (
        "rdzv",
        "(run_id, endpoint, settings, local_addr=None, **kwargs)",
    ),
    "dynamic_rendezvous.DynamicRendezvousHandler.use_agent_store": ("rdzv", "(self)"),
    **handler_methods("dynamic_rendezvous.DynamicRendezvousHandler", "rdzv"),
    "dynamic_rendezvous.create_handler": ("rdzv.dynamic", "(params)"),
    # core_rendezvous_backend.py @ 0dd48286f4e271ea64f040fbad5a6fbf5ba290ce (and @ 2eb2338)
    "core_rendezvous_backend.RendezvousBackend": ("rdzv", "()"),
    "core_rendezvous_backend.RendezvousBackend.get_state": ("rdzv", "(self)"),
    "core_rendezvous_backend.RendezvousBackend.set_state": ("rdzv", "(self, value, token)"),
    # rdzv's "core" backend is the c10d store backend (rdzv.registry.BACKEND_ALIASES)
    "core_rendezvous_backend.CoreRendezvousBackend": (
        "rdzv:C10dRendezvousBackend",
        "(store, run_id)",
    ),
    "core_rendezvous_backend.create_backend": ("rdzv.backends.store", "(params, store_type='tcp')"),
    # c10d_rendezvous_backend.py @ 0dd48286f4e271ea64f040fbad5a6fbf5ba290ce
    "c10d_rendezvous_backend.C10dRendezvousBackend": ("rdzv", "(store, run_id)"),
    "c10d_rendezvous_backend.C10dRendezvousBackend.get_state": ("rdzv", "(self)"),
    "c10d_rendezvous_backend.C10dRendezvousBackend.set_state": (
        "rdzv",
        "(self, state, token=None)",
    ),
    "c10d_rendezvous_backend.create_backend": ("rdzv.backends.store", "(params)"),
    # p10d_rendezvous_backend.py @ 3fcf19d68311dc8372c69d49338586b52977bb31
    "p10d_rendezvous_backend.P10dRendezvousBackend": ("rdzv", "(store, run_id)"),
    "p10d_rendezvous_backend.P10dRendezvousBackend.get_state": ("rdzv", "(self)"),
    "p10d_rendezvous_backend.P10dRendezvousBackend.set_state": (
        "rdzv",
        "(self, state, token=None)",
    ),
    "p10d_rendezvous_backend.create_backend": ("rdzv.backends.store", "(params)"),
    # tp_rendezvous_backend.py @ 9f1cefb5382db822365fca724bc00f7f0b23d96e
    "tp_rendezvous_backend.TpRendezvousBackend": ("rdzv", "(store, run_id)"),
    "tp_rendezvous_backend.TpRendezvousBackend.get_state": ("rdzv", "(self)"),
    "tp_rendezvous_backend.TpRendezvousBackend.set_state": ("rdzv", "(self, state, token=None)"),
    "tp_rendezvous_backend.create_backend": ("rdzv.backends.store", "(params)"),
    # etcd_rendezvous_backend.py @ 4d92f3037b928d66842628d8696cd0b9eb4cd82d
    "etcd_rendezvous_backend.EtcdRendezvousBackend": (
        "rdzv",
        "(client, run_id, key_prefix=None, ttl=None)",
    ),
    "etcd_rendezvous_backend.EtcdRendezvousBackend.get_state": ("rdzv", "(self)"),
    "etcd_rendezvous_backend.EtcdRendezvousBackend.set_state": (
        "rdzv",
        "(self, state, token=None)",
    ),
    "etcd_rendezvous_backend.create_backend": ("rdzv.backends.etcd", "(params)"),
    # static_tcp_rendezvous.py @ 4d92f3037b928d66842628d8696cd0b9eb4cd82d
    "static_tcp_rendezvous.StaticTCPRendezvous": (
        "rdzv",
        "(params, master_port=None, rank=0, world_size=1, run_id='', timeout=600)",
    ),
    **handler_methods("static_tcp_rendezvous.StaticTCPRendezvous", "rdzv"),
    "static_tcp_rendezvous.create_rdzv_handler": ("rdzv.static", "(params)"),
    "static_tcp_rendezvous.create_handler": ("rdzv.static", "(params)"),
    # registry.py @ 3fcf19d68311dc8372c69d49338586b52977bb31
    "registry.get_rendezvous_handler": ("rdzv.registry", "(params)"),
    # utils.py @ 0dd48286f4e271ea64f040fbad5a6fbf5ba290ce
    "utils.parse_rendezvous_endpoint": ("rdzv.utils", "(endpoint, default_port)"),
}


def rdzv_object(name: str, target: str) -> object:
    """Return rdzv's counterpart of the spec's ``name`` (None when absent)."""
    module, _, qualname = target.partition(":")
    return member(module, qualname or name.split(".", 1)[1])


def test_every_signature_of_the_tensorplay_spec_is_rdzvs_or_a_documented_difference() -> None:
    reference = {name: parse(signature) for name, (_, signature) in SPEC.items()}
    ours = {name: shape(rdzv_object(name, target)) for name, (target, _) in SPEC.items()}
    assert drift(reference, ours, TENSORPLAY_DIFFERENCES) == []


def test_the_comparison_catches_a_changed_default_kind_or_order() -> None:
    reference = {"f": parse("(a, b=1, *args, c=None, **kwargs)")}
    for wrong in ("(a, b=2, *args, c=None, **kwargs)", "(a, b=1, *, c=None, **kwargs)"):
        assert drift(reference, {"f": parse(wrong)}, {}) != []
    assert drift(reference, {"f": parse("(b=1, a=2, *args, c=None, **kwargs)")}, {}) != []
    assert drift(reference, {"f": reference["f"]}, {"f": reference["f"]}) != []  # stale entry
    assert drift(reference, {"f": reference["f"]}, {}) == []


def test_the_signature_table_of_the_docs_lists_exactly_the_allowed_differences() -> None:
    assert documented() == set(TENSORPLAY_DIFFERENCES) | set(TORCH_DIFFERENCES)
