"""What a backend or store serves is checked against named limits: over them is a state error.

A forged state listing more participants than ``MAX_PARTICIPANTS``, and a
store reply longer than the 8 MiB value limit, are
:class:`~rdzv.errors.RendezvousStateError` (final, naming the limit and
where the record lives), not a retryable connection error, and they are
reported on the first read, not after the join timeout.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from rdzv.api import RendezvousParameters
from rdzv.backends.redis import create_backend
from rdzv.dynamic.handler import create_handler
from rdzv.dynamic.state import MAX_PARTICIPANTS, RendezvousState, encode_state
from rdzv.errors import RendezvousStateError
from rdzv.store.protocol import MAX_VALUE_BYTES, PROBE_NONCE, WaitResult, encode_u32
from rdzv.store.tcp import TCPStore
from tests.engines.servers import RedisServer

pytestmark = pytest.mark.timeout(60)


def test_a_stored_state_over_the_participant_cap_fails_the_join_at_once(
    redis_srv: RedisServer,
) -> None:
    params = RendezvousParameters("redis", redis_srv.endpoint, "cap", 1, 1, join_timeout="30")
    backend, store = create_backend(params)
    forged = RendezvousState(0, tuple(f"10.0.0.1#{i}#ab" for i in range(100_000)))
    assert backend.set_state(encode_state(forged)) is not None
    handler = create_handler(store, backend, params)
    try:
        started = time.monotonic()
        with pytest.raises(RendezvousStateError) as info:
            handler.next_rendezvous()
        # one read, not the join timeout (30 s) nor one mark read per member
        assert time.monotonic() - started < 10
        message = str(info.value)
        assert f"MAX_PARTICIPANTS = {MAX_PARTICIPANTS}" in message
        assert "100000 participants" in message
        assert "key 'rdzv:cap'" in message
    finally:
        handler.close()


@contextmanager
def _oversized_store() -> Iterator[int]:
    """A torch-like store server that answers every value read with a length past the limit."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        accepted.append(conn)
        conn.recv(64)  # VALIDATE and PING
        conn.sendall(encode_u32(PROBE_NONCE))  # "I am torch's server"
        conn.recv(64)  # WAIT for the key (a get waits for it first)
        conn.sendall(bytes([WaitResult.STOP_WAITING]))
        conn.recv(64)  # GET
        conn.sendall((MAX_VALUE_BYTES + 1).to_bytes(8, "little"))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        listener.close()
        thread.join(10)
        for conn in accepted:
            conn.close()


def test_a_reply_over_the_value_limit_is_a_state_error() -> None:
    with _oversized_store() as port:
        store = TCPStore("127.0.0.1", port, timeout=5)
        try:
            with pytest.raises(
                RendezvousStateError, match=f"exceeds the limit of {MAX_VALUE_BYTES}"
            ):
                store.get("key")
        finally:
            store.close()


def test_a_poisoned_redis_heartbeat_is_repaired_by_its_owners_next_beat(
    redis_srv: RedisServer,
) -> None:
    params = RendezvousParameters("redis", redis_srv.endpoint, "poison", 1, 1)
    backend, store = create_backend(params)
    node = "10.0.0.1#1#aa"
    try:
        backend.beat(node)
        backend.client.set(f"{backend.key}:alive:{node}", b"not a number")
        poisoned = backend.heartbeat_mark(node)
        backend.beat(node)  # INCR alone fails on a non-integer: every beat would fail
        repaired = backend.heartbeat_mark(node)
        assert repaired is not None
        assert repaired != poisoned
        backend.beat(node)
        assert backend.heartbeat_mark(node) != repaired
    finally:
        backend.close()
        store.close()
