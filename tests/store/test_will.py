"""Wills: a key the server sets when a connection closes, and the thread that keeps one."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from rdzv.store.protocol import MAX_WILL_BYTES, VALIDATE_MAGIC, Op
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore
from rdzv.store.will import Will
from tests.procs import subprocess_env, wait_until

# Real seconds that only catch a hang.
_HANG = 30.0


_CLIENTS: list[TCPStore] = []


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    srv = TCPStoreServer("127.0.0.1", 0, idle_timeout=0.2).start()
    try:
        yield srv
    finally:
        while _CLIENTS:
            _CLIENTS.pop().close()
        srv.stop()


def _client(server: TCPStoreServer | int) -> TCPStore:
    port = server if isinstance(server, int) else server.port
    client = TCPStore("127.0.0.1", port, timeout=10)
    _CLIENTS.append(client)
    return client


def test_a_killed_process_s_will_is_written_when_the_kernel_closes_its_connection(
    server: TCPStoreServer,
) -> None:
    code = (
        "import sys, time; from rdzv.store.tcp import TCPStore; "
        f"s = TCPStore('127.0.0.1', {server.port}, timeout=10); "
        "s.set_will('node/a', b'gone'); print('ready', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        observer = _client(server)
        assert observer.try_multi_get(["node/a"]) == [None]
        os.kill(proc.pid, signal.SIGKILL)
        assert observer.watch("node/a", None, _HANG) == b"gone"
    finally:
        proc.kill()
        proc.wait(timeout=_HANG)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_withdrawn_will_writes_nothing_and_a_new_one_replaces_the_old(
    server: TCPStoreServer,
) -> None:
    observer = _client(server)
    withdrawn = _client(server)
    withdrawn.set_will("w/1", b"gone")
    withdrawn.set_will("w/1", None)
    withdrawn.close()
    replaced = _client(server)
    replaced.set_will("w/2", b"first")
    replaced.set_will("w/3", b"second")
    replaced.close()
    assert observer.watch("w/3", None, _HANG) == b"second"
    assert observer.try_multi_get(["w/1", "w/2"]) == [None, None]


def test_a_connection_holding_a_will_is_never_closed_as_idle(server: TCPStoreServer) -> None:
    holder = _client(server)
    holder.set_will("idle/held", b"gone")
    idle = _client(server)
    idle.set("idle/x", b"1")
    read, write = os.pipe()
    try:
        # idle_timeout is 0.2 s: the idle client is cut, the holder is not.
        wait_until(lambda: idle.wait_closed(read, 0.05), timeout=_HANG, what="an idle cut")
        assert not holder.wait_closed(read, 0.5)
        assert _client(server).try_multi_get(["idle/held"]) == [None]
    finally:
        os.close(read)
        os.close(write)


def _raw_will(port: int, key: bytes, value: bytes) -> bytes:
    """Send VALIDATE then a WILL on a raw socket; return what the server sent until it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=_HANG) as sock:
        frame = bytes([Op.VALIDATE]) + struct.pack("<I", VALIDATE_MAGIC)
        frame += bytes([Op.WILL]) + struct.pack("<Q", len(key)) + key
        frame += struct.pack("<Q", len(value)) + value
        sock.sendall(frame)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
        return received


def test_a_will_over_its_bound_ends_the_connection_and_holds_nothing(
    server: TCPStoreServer,
) -> None:
    assert _raw_will(server.port, b"/big", b"x" * (MAX_WILL_BYTES + 1)) == b""
    assert _raw_will(server.port, b"/ok", b"x" * MAX_WILL_BYTES) == b"\x00"
    observer = _client(server)
    assert observer.watch("ok", None, _HANG) == b"x" * MAX_WILL_BYTES
    assert observer.try_multi_get(["big"]) == [None]
    with pytest.raises(ValueError, match="will of"):
        observer.set_will("big", b"x" * (MAX_WILL_BYTES + 1))


def test_a_kept_will_is_made_again_after_the_server_dropped_its_connection(
    server: TCPStoreServer,
) -> None:
    """The server restarts on the same port: the will returns and on_restored runs."""
    first = TCPStoreServer("127.0.0.1", 0).start()
    port = first.port
    restored = threading.Event()
    will = Will(lambda: _client(port), "k/a", b"gone", restored.set)
    second: TCPStoreServer | None = None
    try:
        wait_until(lambda: first.connection_count() >= 1, timeout=_HANG, what="the will's client")
        first.stop()
        second = TCPStoreServer("127.0.0.1", port).start()
        assert restored.wait(_HANG)
        will.stop()  # withdrawn: nothing is written
        assert _client(port).try_multi_get(["k/a"]) == [None]
    finally:
        will.stop()
        first.stop()
        if second is not None:
            second.stop()
