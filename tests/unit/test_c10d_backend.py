"""The c10d backend's own behaviour beyond the shared suite (tests/conformance)."""

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import pytest

from rdzv.backends.store import (
    RETAIN_REPLACED,
    C10dRendezvousBackend,
    P10dRendezvousBackend,
    TpRendezvousBackend,
)
from rdzv.store.memory import HashStore, PrefixStore
from rdzv.testing.clock import FakeClock


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


def test_sixteen_writers_on_a_tcp_store_lose_no_update_and_raise_nothing() -> None:
    """Contention among honest writers never surfaces as an error, nor loses an update.

    Each writer reads, increments and writes back until 20 of its writes
    won, on a client of its own; a loser's read of the head that beat it
    and every plain read race the other 15 writers' deletions. Once all
    have closed, only the last body is left in the store.
    """
    from rdzv.store.server import TCPStoreServer
    from rdzv.store.tcp import TCPStore

    writers, wins = 16, 20
    server = TCPStoreServer("127.0.0.1", 0).start()
    clients = [TCPStore("127.0.0.1", server.port, timeout=30) for _ in range(writers)]
    try:
        backends = [C10dRendezvousBackend(client, "run") for client in clients]
        backends[0].set_state(b"0")
        errors: list[BaseException] = []
        barrier = threading.Barrier(writers)

        def increment(backend: C10dRendezvousBackend) -> None:
            try:
                barrier.wait(timeout=30)
                won = 0
                for _ in range(100_000):
                    read = backend.get_state()
                    assert read is not None
                    result = backend.set_state(str(int(read[0]) + 1).encode(), read[1])
                    won += bool(result is not None and result[2])
                    if won == wins:
                        return
                errors.append(AssertionError("a writer could not complete its increments"))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=increment, args=(b,), daemon=True) for b in backends]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a writer hung for 90 s"
        assert errors == []
        final = backends[0].get_state()
        assert final is not None
        assert int(final[0]) == writers * wins
        for backend in backends:
            backend.close()
        bodies = [k for k in clients[0].list_keys() if k.startswith("rdzv.backend/run/state/")]
        assert bodies == [f"rdzv.backend/run/state/{final[1][4:].hex()}"]
    finally:
        for client in clients:
            client.close()
        server.stop()


class _RivalBeforeEachRead(PrefixStore):
    """A view of ``inner`` (under ``view``) on which ``rival`` runs before every multi-key read."""

    def __init__(self, inner: HashStore, rival: Callable[[], None]) -> None:
        super().__init__("view", inner)
        self._rival = rival
        self.reads = 0

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        self.reads += 1
        self._rival()
        return super().try_multi_get(keys)


def test_a_reader_reads_in_one_round_trip_whatever_the_write_rate() -> None:
    """Five commits land between a reader's head and its body read, each time; it reads at once."""
    store = HashStore()
    clock = FakeClock()
    rival = C10dRendezvousBackend(PrefixStore("view", store), "r", clock=clock)
    rival.set_state(b"0")

    def five_commits() -> None:
        for _ in range(5):
            read = rival.get_state()
            assert read is not None
            assert rival.set_state(str(int(read[0]) + 1).encode(), read[1]) is not None

    view = _RivalBeforeEachRead(store, five_commits)
    reader = C10dRendezvousBackend(view, "r")
    for _ in range(3):
        view.reads = 0
        state, token = reader.get_state() or (b"", b"")
        assert view.reads == 1
        lost = reader.set_state(b"mine", token)
        assert lost is not None
        assert not lost[2]
        # The loser's answer is a committed pair: the body its head names.
        assert int(lost[0]) > int(state)
        assert store.get(f"view/rdzv.backend/r/state/{lost[1][4:].hex()}") == lost[0]
        assert view.reads == 2
    # The rival keeps every body it replaced until RETAIN_REPLACED has passed on its clock.
    replaced = 3 * 2 * 5
    assert store.num_keys() == 1 + replaced + 1
    clock.advance(RETAIN_REPLACED)
    assert rival.read_token() is not None
    assert store.num_keys() == 2  # the head and its body
