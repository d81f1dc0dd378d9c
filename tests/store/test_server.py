"""The server on real loopback sockets: robustness, waiters, limits, leaks."""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdzv.net import listen_backlog
from rdzv.store.protocol import (
    FEATURE_AUTH_REQUIRED,
    PROBE_NONCE,
    SERVER_HELLO,
    SERVER_HELLO_MASK,
    VALIDATE_MAGIC,
    Op,
    Request,
    encode_bytes,
    encode_request,
)
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore
from tests.procs import subprocess_env, wait_until

pytestmark = pytest.mark.timeout(60)

VALIDATE = encode_request(Request(Op.VALIDATE, number=VALIDATE_MAGIC))


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    srv = TCPStoreServer("127.0.0.1", 0).start()
    try:
        yield srv
    finally:
        srv.stop()


def raw(port: int, validate: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if validate:
        sock.sendall(VALIDATE)
    return sock


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError(data)
        data += chunk
    return data


def closed_by_peer(sock: socket.socket) -> bool:
    """True if the peer closed the connection without sending anything more."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def healthy(port: int) -> bool:
    key = f"health-{uuid.uuid4().hex}"
    with TCPStore("127.0.0.1", port, timeout=5) as client:
        client.set(key, "ok")
        return client.get(key) == b"ok" and client.add(f"{key}-n", 1) == 1


@pytest.mark.parametrize(
    ("payload", "logged"),
    [
        (b"\x99garbage", "unknown opcode 153"),
        (b"\x03" + struct.pack("<Q", 1 << 40), "exceeds the limit"),
        (b"\x01" + encode_bytes(b"/k") + struct.pack("<Q", 9 << 20), "value of"),
        (b"\x0a" + struct.pack("<Q", (128 << 10) + 1), "keys in one request"),
    ],
    ids=["garbage", "huge-key-length", "huge-value-length", "too-many-keys"],
)
def test_bad_client_is_disconnected_with_one_log_line_and_others_are_served(
    server: TCPStoreServer, caplog: pytest.LogCaptureFixture, payload: bytes, logged: str
) -> None:
    with TCPStore("127.0.0.1", server.port, timeout=5) as good:
        good.set("k", "before")
        with caplog.at_level(logging.WARNING, logger="rdzv.store.server"), raw(server.port) as bad:
            bad.sendall(payload)
            assert closed_by_peer(bad)
            wait_until(lambda: server.connection_count() == 1)
        lines = [r for r in caplog.records if r.name == "rdzv.store.server"]
        assert len(lines) == 1
        assert logged in lines[0].getMessage()
        assert good.get("k") == b"before"
        good.set("k", "after")
        assert good.get("k") == b"after"


def test_truncated_frame_then_close_is_logged(
    server: TCPStoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rdzv.store.server"):
        with raw(server.port) as bad:
            bad.sendall(encode_request(Request(Op.SET, (b"/k",), (b"value",)))[:-2])
            time.sleep(0.05)
        wait_until(lambda: server.connection_count() == 0)
    assert any("middle of a request" in r.getMessage() for r in caplog.records)
    assert healthy(server.port)


def test_first_request_must_be_validate(server: TCPStoreServer) -> None:
    with raw(server.port, validate=False) as sock:
        sock.sendall(encode_request(Request(Op.GETNUMKEYS)))
        assert closed_by_peer(sock)
    with raw(server.port, validate=False) as sock:
        sock.sendall(encode_request(Request(Op.VALIDATE, number=0x1234)))
        assert closed_by_peer(sock)


def test_probe_ping_identifies_the_server_and_other_nonces_echo(server: TCPStoreServer) -> None:
    with raw(server.port) as sock:
        sock.sendall(encode_request(Request(Op.PING, number=PROBE_NONCE)))
        (hello,) = struct.unpack("<I", recv_exact(sock, 4))
        assert hello & SERVER_HELLO_MASK == SERVER_HELLO
        assert not hello & FEATURE_AUTH_REQUIRED
        sock.sendall(encode_request(Request(Op.PING, number=31337)))
        assert struct.unpack("<I", recv_exact(sock, 4)) == (31337,)


def test_pipelined_requests_are_answered_in_order(server: TCPStoreServer) -> None:
    requests = [
        Request(Op.SET, (b"/p",), (b"1",)),
        Request(Op.ADD, (b"/n",), (), 2),
        Request(Op.GET, (b"/p",)),
        Request(Op.ADD, (b"/n",), (), 3),
        Request(Op.GET, (b"/missing",)),
        Request(Op.QUEUE_POP, (b"/q",)),
    ]
    with raw(server.port) as sock:
        sock.sendall(b"".join(encode_request(r) for r in requests))
        expected = (
            struct.pack("<q", 2)
            + encode_bytes(b"1")
            + struct.pack("<q", 5)
            + encode_bytes(b"")
            + struct.pack("<q", 0)
        )
        assert recv_exact(sock, len(expected)) == expected


def test_wait_then_cancel_removes_the_waiter(server: TCPStoreServer) -> None:
    with raw(server.port) as sock:
        sock.sendall(encode_request(Request(Op.WAIT, (b"/never",))))
        wait_until(lambda: server.waiter_count() == 1)
        sock.sendall(encode_request(Request(Op.CANCEL_WAIT)))
        assert recv_exact(sock, 1) == b"\x01"
        assert server.waiter_count() == 0
        sock.sendall(encode_request(Request(Op.GETNUMKEYS)))
        assert len(recv_exact(sock, 8)) == 8


def test_cancel_after_stop_waiting_is_still_answered(server: TCPStoreServer) -> None:
    """torch's race: the STOP_WAITING crossed the CANCEL_WAIT on the wire."""
    with raw(server.port) as sock, TCPStore("127.0.0.1", server.port, timeout=5) as writer:
        sock.sendall(encode_request(Request(Op.WAIT, (b"/soon",))))
        wait_until(lambda: server.waiter_count() == 1)
        writer.set("soon", "x")
        sock.sendall(encode_request(Request(Op.CANCEL_WAIT)))
        assert recv_exact(sock, 2) == b"\x00\x01"
        assert server.waiter_count() == 0


def test_other_request_during_a_wait_disconnects(server: TCPStoreServer) -> None:
    with raw(server.port) as sock:
        sock.sendall(encode_request(Request(Op.WAIT, (b"/never",))))
        wait_until(lambda: server.waiter_count() == 1)
        sock.sendall(encode_request(Request(Op.GETNUMKEYS)))
        assert closed_by_peer(sock)
    wait_until(lambda: server.waiter_count() == 0)


def test_barrier_releases_at_world_size(server: TCPStoreServer) -> None:
    barrier = encode_request(Request(Op.BARRIER, (b"/bar",), (), 2))
    with raw(server.port) as first, raw(server.port) as second:
        first.sendall(barrier)
        wait_until(lambda: server.waiter_count() == 1)
        second.sendall(barrier)
        assert recv_exact(second, 1) == b"\x00"
        assert recv_exact(first, 1) == b"\x00"
    with TCPStore("127.0.0.1", server.port, timeout=5) as client:
        assert client.get("bar") == b"2"
        client.barrier("solo", 1)


def test_waiters_of_a_closed_connection_are_dropped(server: TCPStoreServer) -> None:
    blocking = [
        Request(Op.WAIT, (b"/never", b"/other")),
        Request(Op.WAIT, (b"/never",)),
        Request(Op.BARRIER, (b"/bar",), (), 10),
        Request(Op.WATCH, (b"/never",), (), 60_000),
        Request(Op.GET_WAIT, (b"/never",), (), 60_000),
    ]
    socks = [raw(server.port) for _ in blocking]
    try:
        for sock, request in zip(socks, blocking, strict=True):
            sock.sendall(encode_request(request))
        wait_until(lambda: server.waiter_count() == 5)
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: server.waiter_count() == 0)
    assert server.engine.indexed_keys == 0


@pytest.mark.parametrize(
    "write",
    [
        lambda s: s.set("w", "new"),
        lambda s: s.add("w", 1),
        lambda s: s.append("w", "+"),
        lambda s: s.multi_set(["x", "w"], ["1", "2"]),
        lambda s: s.compare_set("w", "5", "swapped"),
        lambda s: s.delete_key("w"),
    ],
    ids=["set", "add", "append", "multi_set", "compare_set", "delete_key"],
)
def test_every_write_wakes_a_watcher(
    server: TCPStoreServer, write: Callable[[TCPStore], object]
) -> None:
    with TCPStore("127.0.0.1", server.port, timeout=5) as writer:
        writer.set("w", "5")
        with raw(server.port) as sock:
            sock.sendall(encode_request(Request(Op.WATCH, (b"/w",), (b"5",), 30_000)))
            wait_until(lambda: server.waiter_count() == 1)
            write(writer)
            status = recv_exact(sock, 1)
            assert status in (b"\x00", b"\x01")
        assert server.waiter_count() == 0


def test_watch_and_get_wait_time_out_on_the_server(server: TCPStoreServer) -> None:
    with raw(server.port) as sock:
        sock.sendall(encode_request(Request(Op.WATCH, (b"/w",), (), 50)))
        assert recv_exact(sock, 1) == b"\x02"
        sock.sendall(encode_request(Request(Op.GET_WAIT, (b"/g",), (), 50)))
        assert recv_exact(sock, 1) == b"\x01"
    assert server.waiter_count() == 0


def test_client_killed_during_wait_leaves_no_waiter(server: TCPStoreServer) -> None:
    code = (
        "import sys\n"
        "from rdzv.store.tcp import TCPStore\n"
        "s = TCPStore('127.0.0.1', int(sys.argv[1]), timeout=60)\n"
        "print('ready', flush=True)\n"
        "s.wait(['never-set'])\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(server.port)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        wait_until(lambda: server.waiter_count() == 1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: server.waiter_count() == 0)
        wait_until(lambda: server.connection_count() == 0)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(90)
def test_a_thousand_connections_opened_and_dropped_leave_no_leak(server: TCPStoreServer) -> None:
    assert healthy(server.port)
    wait_until(lambda: server.connection_count() == 0)
    fds_before = open_fds()
    for i in range(1000):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        if i % 3 == 0:
            sock.sendall(VALIDATE)
        if i % 3 == 1:
            sock.sendall(VALIDATE + encode_request(Request(Op.WAIT, (b"/never",))))
        sock.close()
    wait_until(lambda: server.connection_count() == 0, timeout=30)
    wait_until(lambda: server.waiter_count() == 0)
    wait_until(lambda: open_fds() <= fds_before, timeout=10)
    assert healthy(server.port)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(junk=st.binary(min_size=1, max_size=200), validate_first=st.booleans())
def test_random_bytes_never_stop_the_server_serving_others(
    rdzv_server: TCPStoreServer, junk: bytes, validate_first: bool
) -> None:
    with socket.create_connection(("127.0.0.1", rdzv_server.port), timeout=5) as sock:
        sock.sendall((VALIDATE if validate_first else b"") + junk)
    assert healthy(rdzv_server.port)


def test_dual_stack_wildcard_bind_accepts_ipv4_and_ipv6() -> None:
    with TCPStoreServer(None, 0) as srv:
        assert srv.host in ("::", "0.0.0.0")
        with TCPStore("127.0.0.1", srv.port, timeout=5) as v4:
            v4.set("family", "both")
        if srv.host == "::":
            with TCPStore("::1", srv.port, timeout=5) as v6:
                assert v6.get("family") == b"both"


def test_busy_port_raises_and_backlog_is_somaxconn(server: TCPStoreServer) -> None:
    with pytest.raises(OSError, match="in use"):
        TCPStoreServer("127.0.0.1", server.port).start()
    with open("/proc/sys/net/core/somaxconn") as handle:
        assert listen_backlog() == int(handle.read())


def test_stop_is_idempotent_and_port_unavailable_after() -> None:
    srv = TCPStoreServer("127.0.0.1", 0).start()
    started = srv.running  # a name: mypy would keep srv.running narrowed past stop()
    assert started
    srv.stop()
    srv.stop()
    assert not srv.running
    with pytest.raises(RuntimeError, match="not running"):
        _ = srv.port
