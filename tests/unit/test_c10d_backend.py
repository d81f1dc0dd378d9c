"""The c10d backend's own behaviour beyond the shared suite (tests/conformance)."""

import time
from collections.abc import Sequence
from datetime import timedelta

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


def test_reading_a_queue_never_waits_for_a_key_dropped_meanwhile() -> None:
    class _DroppedAfterCheck(HashStore):
        """The queue is dropped right after anyone finds it present."""

        def check(self, keys: Sequence[str]) -> bool:
            found = super().check(keys)
            for key in keys:
                self.delete_key(key)
            return found

    store = _DroppedAfterCheck(timeout=timedelta(seconds=30))
    backend = C10dRendezvousBackend(store, "r")
    backend.enqueue(0, b"a#1#x -1")
    started = time.monotonic()
    assert backend.queue_records(0) == [b"a#1#x -1"]  # one read: nothing lost either
    # A hang-catching bound: a get that waits for the dropped key takes the
    # store's whole 30 s timeout.
    assert time.monotonic() - started < 10


def test_store_failures_become_connection_errors() -> None:
    from rdzv.errors import RendezvousConnectionError

    class _Broken(HashStore):
        def compare_set(self, key: str, expected: object, desired: object) -> bytes:
            raise ConnectionResetError("peer reset")

    backend = C10dRendezvousBackend(_Broken(), "r")
    with pytest.raises(RendezvousConnectionError, match="peer reset") as info:
        backend.get_state()
    assert isinstance(info.value.__cause__, ConnectionResetError)


@pytest.mark.timeout(60)
def test_the_side_channel_writes_while_a_watch_holds_the_main_client() -> None:
    import threading
    import time

    from rdzv.store.tcp import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    client = master.clone()
    backend = C10dRendezvousBackend(client, "r", liveness_store=client.clone())
    try:
        created = backend.set_state(b"one")
        assert created is not None
        token = created[1]
        watch = threading.Thread(target=backend.wait_for_state, args=(token, 20.0))
        watch.start()  # holds the main client until the state changes (or 20 s)
        side = backend.side_channel()
        assert side is not backend
        started = time.monotonic()
        written = side.set_state(b"two", token)  # would wait behind the watch on `client`
        assert written is not None
        assert written[2]
        assert time.monotonic() - started < 10  # generous: behind the watch it takes 20 s
        watch.join(10)
        assert not watch.is_alive()  # the watch saw the side channel's write
        assert backend.get_state() is not None
        assert C10dRendezvousBackend(client, "r").side_channel().name == "c10d"
    finally:
        backend.close()
        client.close()
        master.close()
