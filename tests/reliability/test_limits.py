"""Each limit of the TCP store server holds against a misbehaving peer on real
loopback sockets, and the server keeps serving everyone else meanwhile."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import uuid
from contextlib import ExitStack

import pytest

from rdzv.store.protocol import MAX_KEY_BYTES, MAX_VALUE_BYTES, encode_bytes
from rdzv.store.server import (
    DEFAULT_FRAME_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TCP_KEEPALIVE,
    TCPStoreServer,
)
from rdzv.store.tcp import TCPStore
from tests.procs import wait_until
from tests.reliability.sockets import connect, pinged, served
from tests.store.hostile import VALIDATE, closed_by_server

pytestmark = pytest.mark.timeout(60)


def test_defaults_are_named_and_sane() -> None:
    server = TCPStoreServer("127.0.0.1", 0)
    assert server.max_connections == DEFAULT_MAX_CONNECTIONS >= 1024
    assert server.frame_timeout == DEFAULT_FRAME_TIMEOUT > 0
    assert server.idle_timeout is DEFAULT_IDLE_TIMEOUT is None
    assert server.tcp_keepalive == DEFAULT_TCP_KEEPALIVE > 0


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_connections", 0), ("frame_timeout", 0), ("idle_timeout", -1.0), ("tcp_keepalive", 0)],
)
def test_a_limit_that_is_not_positive_is_refused_by_name(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=option):
        TCPStoreServer("127.0.0.1", 0, **{option: value})  # type: ignore[arg-type]  # one option by name


def test_connections_past_the_maximum_are_closed_at_once_with_a_log_line(
    make_server: type[TCPStoreServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server("127.0.0.1", 0, max_connections=2).start()
    with ExitStack() as stack:
        first = stack.enter_context(connect(server.port))
        second = stack.enter_context(connect(server.port))
        assert pinged(first)
        assert pinged(second)
        with caplog.at_level(logging.WARNING, logger="rdzv.store.server"):
            extra = stack.enter_context(connect(server.port, validate=False))
            assert closed_by_server(extra)
        assert server.refused_connections == 1
        assert "max_connections=2" in caplog.text
        # The two admitted connections are untouched; a freed slot is reusable.
        assert pinged(first)
        assert pinged(second)
        second.close()
        wait_until(lambda: server.connection_count() == 1, timeout=15)
        assert served(server.port)
        assert pinged(first)


def test_a_slow_writer_is_dropped_after_the_frame_timeout_however_steady(
    make_server: type[TCPStoreServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server("127.0.0.1", 0, frame_timeout=0.5).start()
    frame = b"\x01" + encode_bytes(b"/slow") + encode_bytes(b"x" * 1000)
    stop = threading.Event()
    with connect(server.port) as slow, caplog.at_level(logging.WARNING):
        assert pinged(slow)

        def dribble() -> None:
            # One byte every 50 ms: always active, never finishing a frame.
            for byte in frame:
                if stop.is_set():
                    return
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.05)

        writer = threading.Thread(target=dribble)
        writer.start()
        try:
            assert served(server.port)  # others are served while it dribbles
            wait_until(lambda: server.expired_connections == 1, timeout=15)
            assert closed_by_server(slow)
        finally:
            stop.set()
            writer.join(30)
    assert "frame_timeout" in caplog.text
    assert served(server.port)


def test_a_stalled_half_frame_is_dropped(make_server: type[TCPStoreServer]) -> None:
    server = make_server("127.0.0.1", 0, frame_timeout=0.5).start()
    with connect(server.port) as stalled:
        stalled.sendall(b"\x01" + struct.pack("<Q", 100) + b"/only-part")
        assert closed_by_server(stalled)
    assert server.expired_connections == 1
    assert served(server.port)


def test_complete_requests_spread_over_time_are_not_a_slow_frame(
    make_server: type[TCPStoreServer],
) -> None:
    server = make_server("127.0.0.1", 0, frame_timeout=0.3).start()
    with connect(server.port) as sock:
        for _ in range(8):  # 8 x 0.1 s: longer than the frame timeout in total
            assert pinged(sock)
            time.sleep(0.1)
        assert pinged(sock)
    assert server.expired_connections == 0


def test_a_reader_that_leaves_its_replies_unread_is_dropped(
    make_server: type[TCPStoreServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server("127.0.0.1", 0, frame_timeout=0.5).start()
    set_big = b"\x01" + encode_bytes(b"/big") + encode_bytes(b"x" * (1 << 20))
    get_big = b"\x03" + encode_bytes(b"/big")
    with socket.socket() as lazy, caplog.at_level(logging.WARNING):
        lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        lazy.settimeout(15)
        lazy.connect(("127.0.0.1", server.port))
        lazy.sendall(VALIDATE + set_big + get_big * 16)  # 16 MiB of replies it never reads
        wait_until(lambda: server.expired_connections == 1, timeout=15)
        assert served(server.port)
    assert "did not read its replies" in caplog.text


@pytest.mark.parametrize("auth", [False, True], ids=["no-auth", "auth"])
def test_a_handshake_not_finished_in_time_is_dropped(
    make_server: type[TCPStoreServer], auth: bool
) -> None:
    token = "s3cret" if auth else None
    server = make_server("127.0.0.1", 0, frame_timeout=0.5, auth_token=token).start()
    # Without auth: connected but never validated. With auth: validated, never authenticated.
    with connect(server.port, validate=auth) as silent:
        assert closed_by_server(silent)
    assert server.expired_connections == 1
    assert served(server.port, auth_token=token)


@pytest.mark.slow
def test_idle_connections_are_closed_but_long_waits_and_watches_are_not(
    make_server: type[TCPStoreServer], caplog: pytest.LogCaptureFixture
) -> None:
    idle = 0.4
    server = make_server("127.0.0.1", 0, idle_timeout=idle).start()
    key = f"late-{uuid.uuid4().hex}"
    results: dict[str, object] = {}

    def wait_for_key() -> None:
        with TCPStore("127.0.0.1", server.port, timeout=30) as waiter:
            waiter.wait([key])
            results["wait"] = waiter.get(key)

    def watch_key() -> None:
        with TCPStore("127.0.0.1", server.port, timeout=30) as watcher:
            results["watch"] = watcher.watch(key, None, timeout=30)

    threads = [threading.Thread(target=wait_for_key), threading.Thread(target=watch_key)]
    with connect(server.port) as lazy, caplog.at_level(logging.WARNING):
        assert pinged(lazy)
        for thread in threads:
            thread.start()
        wait_until(lambda: server.waiter_count() == 2, timeout=15)
        assert closed_by_server(lazy)  # idle: closed
        time.sleep(idle * 4)  # the blocked requests outlive the idle timeout ...
        assert server.waiter_count() == 2
        with TCPStore("127.0.0.1", server.port, timeout=10) as writer:
            writer.set(key, "here")
        for thread in threads:
            thread.join(30)
    assert results["wait"] == b"here"  # ... and are answered normally
    assert results["watch"] == b"here"
    assert "idle_timeout" in caplog.text
    assert server.expired_connections == 1


def test_accepted_sockets_get_tcp_keepalive(make_server: type[TCPStoreServer]) -> None:
    server = make_server("127.0.0.1", 0, tcp_keepalive=7).start()
    with connect(server.port) as sock:
        assert pinged(sock)

        def option(level: int, name: int) -> int:
            (conn,) = server.connections
            assert conn.transport is not None
            server_side: socket.socket = conn.transport.get_extra_info("socket")
            return int(server_side.getsockopt(level, name))

        assert server._call(lambda: option(socket.SOL_SOCKET, socket.SO_KEEPALIVE)) == 1
        assert server._call(lambda: option(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)) == 7


def test_keepalive_can_be_turned_off(make_server: type[TCPStoreServer]) -> None:
    server = make_server("127.0.0.1", 0, tcp_keepalive=None).start()
    with connect(server.port) as sock:
        assert pinged(sock)

        def keepalive() -> int:
            (conn,) = server.connections
            assert conn.transport is not None
            server_side: socket.socket = conn.transport.get_extra_info("socket")
            return int(server_side.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))

        assert server._call(keepalive) == 0


@pytest.mark.parametrize(
    ("frame", "limit"),
    [
        (b"\x01" + struct.pack("<Q", MAX_KEY_BYTES + 1), f"limit of {MAX_KEY_BYTES} bytes"),
        (
            b"\x01" + encode_bytes(b"/k") + struct.pack("<Q", MAX_VALUE_BYTES + 1),
            f"limit of {MAX_VALUE_BYTES} bytes",
        ),
    ],
    ids=["key", "value"],
)
def test_oversize_keys_and_values_are_refused_naming_the_limit(
    make_server: type[TCPStoreServer],
    caplog: pytest.LogCaptureFixture,
    frame: bytes,
    limit: str,
) -> None:
    server = make_server("127.0.0.1", 0).start()
    with connect(server.port) as liar, caplog.at_level(logging.WARNING):
        liar.sendall(frame)  # only the length prefix: refused before any buffering
        assert closed_by_server(liar)
    assert limit in caplog.text
    with TCPStore("127.0.0.1", server.port, timeout=10) as client:
        with pytest.raises(ValueError, match=str(MAX_KEY_BYTES)):
            client.set("k" * (MAX_KEY_BYTES + 1), "v")
        with pytest.raises(ValueError, match=str(MAX_VALUE_BYTES)):
            client.set("k", b"v" * (MAX_VALUE_BYTES + 1))
        client.set("k", "still fine")
        assert client.get("k") == b"still fine"
