"""create_backend / the registry entries for the store backend."""

import socket

import pytest

import rdzv
from rdzv.api import RendezvousParameters
from rdzv.backends.options import endpoint_is_local
from rdzv.backends.store import C10dRendezvousBackend, create_backend
from rdzv.dynamic.handler import DynamicRendezvousHandler
from tests.procs import free_port


def test_loopback_and_local_names_are_local() -> None:
    assert endpoint_is_local("127.0.0.1")
    assert endpoint_is_local("::1")
    assert endpoint_is_local("localhost")
    assert endpoint_is_local(socket.gethostname())


def test_foreign_or_unresolvable_hosts_are_not_local() -> None:
    assert not endpoint_is_local("192.0.2.77")  # TEST-NET-1, never assigned
    assert not endpoint_is_local("no-such-host.invalid")


def test_unknown_store_type_is_rejected_by_name() -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:1", "job", 1, 1, store_type="etcd")
    with pytest.raises(ValueError, match="'etcd'"):
        create_backend(params)


def test_builtin_names_are_registered() -> None:
    backends = rdzv.rendezvous_handler_registry.backends()
    for name in ("c10d", "p10d", "core", "tcp"):
        assert name in backends


@pytest.mark.timeout(30)
def test_create_handler_just_works(handlers: list[DynamicRendezvousHandler]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    params = RendezvousParameters(
        "c10d", endpoint, "job", 1, 1, local_addr="127.0.0.1", read_timeout=5
    )
    handler = rdzv.create_handler(params)
    assert isinstance(handler, DynamicRendezvousHandler)
    handlers.append(handler)
    second = rdzv.create_handler(params)  # binding fails: falls back to a client
    assert isinstance(second, DynamicRendezvousHandler)
    handlers.append(second)
    info = handler.next_rendezvous()
    assert info.world_size == 1
    assert handler.get_backend() == "c10d"


@pytest.mark.timeout(30)
def test_explicit_host_that_cannot_bind_is_an_error(
    handlers: list[DynamicRendezvousHandler],
) -> None:
    from rdzv.errors import RendezvousConnectionError

    endpoint = f"127.0.0.1:{free_port()}"
    first = RendezvousParameters("c10d", endpoint, "job", 1, 1, is_host=True, read_timeout=5)
    backend, store = create_backend(first)
    try:
        assert isinstance(backend, C10dRendezvousBackend)
        with pytest.raises(RendezvousConnectionError, match="could not host"):
            create_backend(first)
    finally:
        backend.close()
        store.close()


@pytest.mark.timeout(30)
def test_a_hosted_store_allows_connections_for_the_whole_job() -> None:
    from rdzv.store.server import DEFAULT_MAX_CONNECTIONS
    from rdzv.store.tcp import TCPStore

    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{free_port()}", "job", 1, 3000, is_host=True, read_timeout=5
    )
    backend, store = create_backend(params)
    try:
        assert isinstance(store, TCPStore)
        assert store.server is not None
        assert store.server.max_connections == 6 * 3000 + 64
    finally:
        backend.close()
        store.close()
    small = RendezvousParameters(
        "c10d", f"127.0.0.1:{free_port()}", "job", 1, 8, is_host=True, read_timeout=5
    )
    backend, store = create_backend(small)
    try:
        assert isinstance(store, TCPStore)
        assert store.server is not None
        assert store.server.max_connections == DEFAULT_MAX_CONNECTIONS
    finally:
        backend.close()
        store.close()
