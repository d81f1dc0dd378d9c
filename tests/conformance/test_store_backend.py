from collections.abc import Callable, Iterator

import pytest

from rdzv.backends.base import RendezvousBackend
from rdzv.backends.store import C10dRendezvousBackend, P10dRendezvousBackend, TpRendezvousBackend
from rdzv.store.base import Store
from rdzv.store.memory import HashStore
from rdzv.testing.conformance import CHECKS, BackendHarness, Check


class _NoWatchStore(HashStore):
    """A HashStore that hides its watch, to exercise the polling fallback."""

    @property
    def supports_watch(self) -> bool:
        return False


class StoreHarness(BackendHarness):
    def __init__(self, store: Store, client: Callable[[], Store] | None = None) -> None:
        self.store = store
        self.client = client
        self.clients: list[Store] = []

    def _client(self) -> Store:
        if self.client is None:
            return self.store
        store = self.client()
        self.clients.append(store)
        return store

    def connect(self) -> RendezvousBackend:
        return C10dRendezvousBackend(self._client(), "run1")

    def connect_other_run(self) -> RendezvousBackend:
        return C10dRendezvousBackend(self._client(), "run2")

    def corrupt_state(self) -> None:
        key = "rdzv.backend/run1/state"
        self.store.set(key, b"\x80\x04garbage")
        # torch's SET has no reply: a read on the same connection makes sure
        # the server applied it before other connections look.
        assert self.store.get(key) == b"\x80\x04garbage"

    def close(self) -> None:
        for store in self.clients:
            store.close()


@pytest.fixture(params=["watch", "poll", "tcp"])
def harness(request: pytest.FixtureRequest) -> Iterator[StoreHarness]:
    if request.param == "tcp":
        from rdzv.store.tcp import TCPStore

        host = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
        h = StoreHarness(host, lambda: TCPStore("127.0.0.1", host.port, timeout=10))
    else:
        store = HashStore(timeout=10) if request.param == "watch" else _NoWatchStore(timeout=10)
        host = store
        h = StoreHarness(store)
    try:
        yield h
    finally:
        h.close()
        host.close()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_store_backend_conformance(check: Check, harness: StoreHarness) -> None:
    check.run(harness)


def test_aliases_are_one_class() -> None:
    assert P10dRendezvousBackend is C10dRendezvousBackend
    assert TpRendezvousBackend is C10dRendezvousBackend
    assert C10dRendezvousBackend(HashStore(), "r").name == "c10d"


def test_run_id_is_validated() -> None:
    with pytest.raises(ValueError, match="'has space'"):
        C10dRendezvousBackend(HashStore(), "has space")


def test_corrupt_join_queue_raises_state_error() -> None:
    from rdzv.errors import RendezvousStateError

    store = HashStore()
    backend = C10dRendezvousBackend(store, "r")
    store.set("rdzv.backend/r/q/0", b"zz:abc")
    with pytest.raises(RendezvousStateError, match="round 0"):
        backend.queue_records(0)
    store.set("rdzv.backend/r/q/0", b"10:abc")
    with pytest.raises(RendezvousStateError, match="truncated"):
        backend.queue_records(0)


def test_store_failures_become_connection_errors() -> None:
    from rdzv.errors import RendezvousConnectionError

    class _Broken(HashStore):
        def compare_set(self, key: str, expected: object, desired: object) -> bytes:
            raise ConnectionResetError("peer reset")

    backend = C10dRendezvousBackend(_Broken(), "r")
    with pytest.raises(RendezvousConnectionError, match="peer reset") as info:
        backend.get_state()
    assert isinstance(info.value.__cause__, ConnectionResetError)
