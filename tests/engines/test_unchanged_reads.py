"""Reading an unchanged state costs O(1) bytes on every backend, and a change is still seen.

Members poll the state (``num_nodes_waiting``, every 0.1 s under ``rdzv
run``); a state of thousands of participants read whole on every poll made
steady-state traffic grow as N² per second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from rdzv.backends.base import RendezvousBackend
from rdzv.backends.store import RETAIN_REPLACED, C10dRendezvousBackend
from rdzv.dynamic.state import RendezvousState, encode_state
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore
from rdzv.testing.clock import FakeClock
from tests.procs import CountingStore

pytestmark = pytest.mark.timeout(60)

NODES = 2048
_B = TypeVar("_B", bound=RendezvousBackend)


def _state(round_id: int) -> bytes:
    keys = tuple(f"10.0.{i // 256}.{i % 256}#{1000 + i}#abcdef01" for i in range(NODES))
    return encode_state(RendezvousState(round_id, keys))


class BytesRead:
    """A :class:`~tests.procs.CountingStore`'s count: adds up the bytes its calls return."""

    def __init__(self) -> None:
        self.read = 0

    def __call__(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        values = result if isinstance(result, list) else [result]
        self.read += sum(len(v) for v in values if isinstance(v, bytes))


@pytest.fixture
def tcp_store() -> Iterator[TCPStore]:
    server = TCPStoreServer("127.0.0.1", 0).start()
    store = TCPStore("127.0.0.1", server.port, timeout=10)
    try:
        yield store
    finally:
        store.close()
        server.stop()


def test_c10d_reads_an_unchanged_state_as_its_16_byte_head(tcp_store: TCPStore) -> None:
    clock = FakeClock()
    writer = C10dRendezvousBackend(tcp_store, "job", clock=clock)
    first = writer.set_state(_state(1))
    assert first is not None
    clone = tcp_store.clone()
    try:
        _poll_and_change(writer, first, clone, tcp_store, clock)
    finally:
        clone.close()


def _poll_and_change(
    writer: C10dRendezvousBackend,
    first: tuple[bytes, Any, bool],
    clone: TCPStore,
    tcp_store: TCPStore,
    clock: FakeClock,
) -> None:
    counting = BytesRead()
    reader = C10dRendezvousBackend(CountingStore(clone, counting), "job")
    assert reader.get_state() == first[:2]
    assert counting.read > len(first[0])  # the first read fetches the body
    counting.read = 0
    for _ in range(10):
        assert reader.get_state() == first[:2]
    assert counting.read <= 10 * 16
    second = writer.set_state(_state(2), first[1])
    assert second is not None
    assert second[2]
    counting.read = 0
    assert reader.get_state() == second[:2]
    assert counting.read > len(second[0])
    # The replaced body outlives its replacement (a reader of its head still
    # finds it) until the writer's first call after RETAIN_REPLACED seconds.
    assert _bodies(tcp_store) == {_body_key(first[1]), _body_key(second[1])}
    clock.advance(RETAIN_REPLACED)
    assert writer.read_token() == second[1]
    assert _bodies(tcp_store) == {_body_key(second[1])}


def _body_key(head: bytes) -> str:
    return f"rdzv.backend/job/state/{head[4:].hex()}"


def _bodies(store: TCPStore) -> set[str]:
    return {k for k in store.list_keys() if k.startswith("rdzv.backend/job/state/")}


def test_c10d_still_reads_and_replaces_a_record_of_the_one_key_layout(tcp_store: TCPStore) -> None:
    old = b"RDZ1" + (7).to_bytes(8, "big") + b"\x00\x01\x02\x03" + _state(1)
    tcp_store.set("rdzv.backend/job/state", old)
    backend = C10dRendezvousBackend(tcp_store, "job")
    found = backend.get_state()
    assert found == (_state(1), old)
    written = backend.set_state(_state(2), found[1])
    assert written is not None
    assert written[2]
    assert len(written[1]) == 16
    assert written[1].startswith(b"RDZ2")
    assert int.from_bytes(written[1][4:12], "big") == 8
    assert C10dRendezvousBackend(tcp_store, "job").get_state() == written[:2]


def _written_and_reader(
    make: Callable[[], _B],
) -> tuple[_B, _B, tuple[bytes, Any, bool]]:
    """Two backends of one run: the first writes a state of NODES participants."""
    writer, reader = make(), make()
    first = writer.set_state(_state(1))
    assert first is not None
    return writer, reader, first


def _etcd_written_and_reader(etcd_client: Any, unique: str) -> tuple[Any, Any, Any]:
    """:func:`_written_and_reader` of two etcd backends of one run under ``/test/``."""
    from rdzv.backends.etcd import EtcdRendezvousBackend

    return _written_and_reader(
        lambda: EtcdRendezvousBackend(etcd_client, unique, key_prefix="/test/")
    )


@pytest.mark.etcd
def test_etcd_reads_the_value_of_an_unchanged_state_once(
    etcd_client: Any, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader, first = _etcd_written_and_reader(etcd_client, unique)
    gets: list[bytes] = []
    real_get = etcd_client.get

    def counted_get(key: bytes) -> Any:
        gets.append(key)
        return real_get(key)

    monkeypatch.setattr(etcd_client, "get", counted_get)
    assert reader.get_state() == first[:2]
    assert len(gets) == 1
    for _ in range(10):
        assert reader.get_state() == first[:2]
    assert len(gets) == 1  # only revisions were read
    second = writer.set_state(_state(2), first[1])
    assert second is not None
    assert second[2]
    assert reader.wait_for_state(first[1], 5.0) == second[:2]
    assert len(gets) == 2


@pytest.mark.etcd
def test_an_etcd_waiter_is_woken_by_the_head_and_not_sent_the_state(
    etcd_client: Any, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    writer, reader, first = _etcd_written_and_reader(etcd_client, unique)
    assert reader.get_state() == first[:2]
    sent: list[int] = []  # the value bytes of each watch event a waiter got
    watching = threading.Event()
    real_watch = etcd_client.watch

    def counted_watch(*args: Any, **kwargs: Any) -> Any:
        watching.set()
        events, after = real_watch(*args, **kwargs)
        sent.extend(len(event.kv.value) for event in events)
        return events, after

    monkeypatch.setattr(etcd_client, "watch", counted_watch)
    woken: list[Any] = []
    waiter = threading.Thread(target=lambda: woken.append(reader.wait_for_state(first[1], 10.0)))
    waiter.start()
    try:
        # The watch starts at the revision after the waiter's read, so the
        # write is reported to it however soon after the call it lands.
        assert watching.wait(10)
        second = writer.set_state(_state(2), first[1])
    finally:
        waiter.join(30)
    assert second is not None
    assert second[2]
    assert woken == [second[:2]]
    assert max(sent, default=0) == 0, sent


@pytest.mark.redis
def test_redis_reads_the_value_of_an_unchanged_state_once(redis_client: Any, unique: str) -> None:
    from rdzv.backends.redis import RedisRendezvousBackend

    writer, reader, first = _written_and_reader(
        lambda: RedisRendezvousBackend(redis_client, unique, key_prefix="test:")
    )
    replies: list[Any] = []
    script = reader._read

    def counted(**kwargs: Any) -> Any:
        reply = script(**kwargs)
        replies.append(reply)
        return reply

    reader._read = counted  # type: ignore[assignment]
    assert reader.get_state() == first[:2]
    for _ in range(10):
        assert reader.get_state() == first[:2]
    sizes = [sum(len(x) for x in r if isinstance(x, bytes)) for r in replies]
    assert sizes[0] > len(first[0])
    assert max(sizes[1:]) < 64  # the token and the stream id, no value
    second = writer.set_state(_state(2), first[1])
    assert second is not None
    assert second[2]
    assert reader.wait_for_state(first[1], 5.0) == second[:2]
