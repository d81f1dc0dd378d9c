"""Raw-socket helpers of the reliability tests (loopback only, every wait bounded);
the ones the hostile-client tests share are in tests/store/hostile.py."""

from __future__ import annotations

import socket
import uuid

from rdzv.store.protocol import Op, Request, encode_request
from rdzv.store.tcp import TCPStore
from tests.store.hostile import VALIDATE

PING = encode_request(Request(Op.PING, number=7))


def connect(port: int, validate: bool = True) -> socket.socket:
    """Open a raw connection to the server, sending ``VALIDATE`` first by default."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    if validate:
        sock.sendall(VALIDATE)
    return sock


def pinged(sock: socket.socket) -> bool:
    """Return whether a ``PING`` on ``sock`` is echoed (the connection is served)."""
    sock.sendall(PING)
    return sock.recv(4) == (7).to_bytes(4, "little")


def served(port: int, auth_token: str | None = None) -> bool:
    """Return whether a fresh client can write and read a key."""
    key = f"served-{uuid.uuid4().hex}"
    with TCPStore("127.0.0.1", port, timeout=10, auth_token=auth_token) as client:
        client.set(key, "ok")
        return client.get(key) == b"ok"
