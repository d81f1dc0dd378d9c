"""The c10d backend's own behaviour beyond the shared suite (tests/conformance)."""

import pytest

from rdzv.backends.store import C10dRendezvousBackend, P10dRendezvousBackend, TpRendezvousBackend
from rdzv.store.memory import HashStore


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
