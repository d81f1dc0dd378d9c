"""The TCP store server: asyncio, speaking torch's TCPStore protocol.

Theory of operation
-------------------
One asyncio event loop serves every connection. Each connection owns a
:class:`~rdzv.store.protocol.RequestParser`; ``data_received`` feeds it and
answers every complete request at once, joining the replies of a burst of
requests into one write. The store itself (:class:`_StoreState`) is a pair of
dicts touched only from the loop's thread, so no locks are needed.

A connection moves through three dispatch tables: before ``VALIDATE`` only
``VALIDATE`` is accepted; on a server with a secret, only the handshake and
authentication requests until the client proves it knows the secret; then
everything. A request outside the current table, garbage, an over-limit
length or a truncated frame at close ends the connection with one log line;
other connections are unaffected.

Blocking requests (``WAIT``, ``BARRIER`` and rdzv's ``GET_WAIT`` and
``WATCH``) that cannot be answered at once become a :class:`_Waiter`
registered under each key it depends on. Every write (set, add, append,
multi-set, compare-set, delete, queue push) re-checks the waiters of the keys
it touched; a satisfied waiter writes its reply and leaves the index. A
connection has at most one waiter (torch's client sends one request at a
time); while it waits, the only request it may send is ``CANCEL_WAIT``, which
drops the waiter and answers ``WAIT_CANCELED``. torch's client sends
``CANCEL_WAIT`` after its own timeout, so the ``STOP_WAITING`` may already be
on its way: the cancel is answered even when no waiter is left. A waiter also
leaves the index when its connection closes, and the rdzv-only waiters carry
their own timeout.

Limits against misbehaving peers
--------------------------------
Each limit has a named default and a constructor parameter. A connection past
``max_connections`` is closed as soon as it is accepted. Accepted TCP sockets
get kernel keepalive probes (``tcp_keepalive`` seconds of silence before the
first), so a peer that vanished without a FIN (half-open) is found even while
it is blocked in a long ``WAIT``. One sweeper task checks every connection
periodically: a request whose first byte arrived more than ``frame_timeout``
seconds ago and is still incomplete (a slow writer, one byte a second) ends
the connection, as do a handshake not finished within ``frame_timeout`` and
a peer that leaves its replies unread that long (a slow reader: its writes
stay paused, and with them its reads);
with ``idle_timeout`` set, a connection that has no request pending, no
partial frame buffered and no blocked request of its own for that long is
closed too. A connection blocked in a ``WAIT``/``WATCH``/``BARRIER`` it asked
for is never idle: it is waiting for the server, not the other way round.
Oversize keys, values and key counts are refused by the parser as soon as
their length prefix is readable.

The server runs either in a background thread of the current process
(:meth:`TCPStoreServer.start`, what ``TCPStore(is_master=True)`` does) or in
the foreground until a signal (:meth:`TCPStoreServer.serve`, what
``rdzv serve`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Final

from rdzv.auth import resolve_auth_token
from rdzv.net import bind_listener, enable_keepalive, listen_backlog
from rdzv.store.protocol import (
    CLIENT_AUTH_LABEL,
    FEATURE_AUTH_REQUIRED,
    PROBE_NONCE,
    SERVER_AUTH_LABEL,
    SERVER_HELLO,
    VALIDATE_MAGIC,
    AuthStatus,
    CheckResult,
    GetWaitStatus,
    Op,
    ProtocolError,
    Request,
    RequestParser,
    WaitResult,
    WatchStatus,
    auth_tag,
    encode_bytes,
    encode_i64,
    encode_u32,
)

__all__ = [
    "DEFAULT_FRAME_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_TCP_KEEPALIVE",
    "TCPStoreServer",
    "serve_main",
]

_log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS: Final = 4096
"""Most client connections a server keeps open at once; more are closed at once."""
DEFAULT_FRAME_TIMEOUT: Final = 60.0
"""Seconds within which a started request (or the handshake) must arrive in full."""
DEFAULT_IDLE_TIMEOUT: Final[float | None] = None
"""Seconds a connection may sit with nothing pending; None never closes idle
connections (torch's client holds its connection idle for a whole job and
never reconnects, so the default keeps torch compatibility)."""
DEFAULT_TCP_KEEPALIVE: Final = 60.0
"""Seconds of silence before the kernel's first keepalive probe; dead after 6 more
probes 10 s apart, so a half-open peer is found in about two minutes."""

_STOP_WAITING: Final = bytes([WaitResult.STOP_WAITING])
_WAIT_CANCELED: Final = bytes([WaitResult.WAIT_CANCELED])
_READY: Final = bytes([CheckResult.READY])
_NOT_READY: Final = bytes([CheckResult.NOT_READY])
_FOUND: Final = bytes([GetWaitStatus.FOUND])
_TIMED_OUT: Final = bytes([GetWaitStatus.TIMED_OUT])
_WATCH_ABSENT: Final = bytes([WatchStatus.ABSENT])
_WATCH_PRESENT: Final = bytes([WatchStatus.PRESENT])
_WATCH_UNCHANGED: Final = bytes([WatchStatus.UNCHANGED])
_ONE: Final = encode_i64(1)
_ZERO: Final = encode_i64(0)


class _Disconnect(Exception):  # noqa: N818 - control flow, not an error report
    """Raised by a handler to send a last reply and close the connection."""

    def __init__(self, reason: str, last_reply: bytes) -> None:
        super().__init__(reason)
        self.last_reply = last_reply


class _Waiter:
    """A blocked request: the keys it depends on, how to answer, when to give up."""

    __slots__ = ("check", "conn", "keys", "timer")

    def __init__(
        self,
        conn: _Connection,
        keys: tuple[bytes, ...],
        check: Callable[[], bytes | None],
    ) -> None:
        self.conn = conn
        self.keys = keys
        self.check = check
        self.timer: asyncio.TimerHandle | None = None


class _StoreState:
    """The keys, queues and waiters of one server (loop thread only)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque[bytes]] = {}
        self.waiters: dict[bytes, set[_Waiter]] = {}
        self.active: set[_Waiter] = set()

    def exists(self, key: bytes) -> bool:
        return key in self.data or bool(self.queues.get(key))

    def notify(self, key: bytes) -> None:
        """Re-check the waiters of ``key`` after it changed."""
        waiting = self.waiters.get(key)
        if not waiting:
            return
        for waiter in list(waiting):
            if waiter in self.active:
                reply = waiter.check()
                if reply is not None:
                    self.finish(waiter, reply)

    def add_waiter(self, waiter: _Waiter, timeout_ms: int | None, on_timeout: bytes) -> None:
        self.active.add(waiter)
        for key in waiter.keys:
            self.waiters.setdefault(key, set()).add(waiter)
        waiter.conn.waiter = waiter
        if timeout_ms is not None:
            loop = asyncio.get_running_loop()
            waiter.timer = loop.call_later(timeout_ms / 1000.0, self.finish, waiter, on_timeout)

    def drop(self, waiter: _Waiter) -> None:
        """Remove ``waiter`` from every index without answering it."""
        if waiter not in self.active:
            return
        self.active.discard(waiter)
        for key in waiter.keys:
            waiting = self.waiters.get(key)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self.waiters[key]
        if waiter.timer is not None:
            waiter.timer.cancel()
        if waiter.conn.waiter is waiter:
            waiter.conn.waiter = None

    def finish(self, waiter: _Waiter, reply: bytes) -> None:
        """Answer ``waiter`` and remove it."""
        if waiter not in self.active:
            return
        self.drop(waiter)
        waiter.conn.write(reply)


_Handler = Callable[["_Connection", Request], "bytes | None"]


class _Connection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: TCPStoreServer) -> None:
        self.server = server
        self.state = server.state
        self.parser = RequestParser()
        self.table: dict[int, _Handler] = _BEFORE_VALIDATE
        self.transport: asyncio.Transport | None = None
        self.waiter: _Waiter | None = None
        self.server_nonce: bytes | None = None
        self.peer = "?"
        self.opened_at = time.monotonic()
        self.last_activity = self.opened_at
        self.frame_started: float | None = None
        self.write_blocked_since: float | None = None

    # -- asyncio callbacks -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"
        if len(self.server.connections) >= self.server.max_connections:
            _log.warning(
                "store client %s refused: the server already has %d connections "
                "(max_connections=%d)",
                self.peer,
                len(self.server.connections),
                self.server.max_connections,
            )
            self.server.refused_connections += 1
            transport.abort()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.server.tcp_keepalive is not None:
                enable_keepalive(sock, self.server.tcp_keepalive)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None:
            self.state.drop(self.waiter)
        if self.parser.pending:
            _log.warning(
                "store client %s disconnected in the middle of a request (%d bytes unparsed)",
                self.peer,
                self.parser.pending,
            )
        self.server.connections.discard(self)
        self.transport = None

    def pause_writing(self) -> None:
        self.write_blocked_since = time.monotonic()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_blocked_since = None
        if self.transport is not None:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        parser.feed(data)
        replies: list[bytes] = []
        now = self.last_activity = time.monotonic()
        if self.frame_started is None:
            self.frame_started = now
        try:
            while (request := parser.next_request()) is not None:
                self.frame_started = now
                table = self.table if self.waiter is None else _WHILE_WAITING
                handler = table.get(request.op)
                if handler is None:
                    self._refuse(request, replies)
                    return
                reply = handler(self, request)
                if reply is not None:
                    replies.append(reply)
            if not parser.pending:
                self.frame_started = None
        except ProtocolError as exc:
            _log.warning("store client %s sent a bad request, disconnecting: %s", self.peer, exc)
            self._close(replies)
            return
        except _Disconnect as exc:
            _log.warning("store client %s disconnected: %s", self.peer, exc)
            replies.append(exc.last_reply)
            self._close(replies)
            return
        if replies:
            self.write(b"".join(replies) if len(replies) > 1 else replies[0])

    # -- helpers -----------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.last_activity = time.monotonic()
            self.transport.write(data)

    def expired(self, now: float) -> str | None:
        """Return why this connection broke a time limit, or None if it did not."""
        server = self.server
        if self.frame_started is not None and now - self.frame_started > server.frame_timeout:
            return (
                f"a request was still incomplete after {server.frame_timeout:g} s "
                f"(frame_timeout; {self.parser.pending} bytes buffered)"
            )
        blocked = self.write_blocked_since
        if blocked is not None and now - blocked > server.frame_timeout:
            return (
                f"it did not read its replies for {server.frame_timeout:g} s "
                f"(frame_timeout; {self.transport.get_write_buffer_size() if self.transport else 0}"
                " bytes unsent)"
            )
        if self.table is not _FULL and now - self.opened_at > server.frame_timeout:
            return f"the handshake was not completed within {server.frame_timeout:g} s"
        idle = server.idle_timeout
        if idle is not None and self.waiter is None and now - self.last_activity > idle:
            return f"the connection was idle for {idle:g} s (idle_timeout)"
        return None

    def close_expired(self, reason: str) -> None:
        """Close this connection because it broke a time limit."""
        _log.warning("store client %s disconnected: %s", self.peer, reason)
        self.server.expired_connections += 1
        if self.transport is not None:
            self.transport.abort()

    def _close(self, replies: list[bytes]) -> None:
        if self.transport is None:
            return
        if replies:
            self.transport.write(b"".join(replies))
        self.parser = RequestParser()
        self.transport.close()

    def _refuse(self, request: Request, replies: list[bytes]) -> None:
        if self.waiter is not None:
            why = "it sent a request other than CANCEL_WAIT while a wait was pending"
        elif self.table is _BEFORE_VALIDATE:
            why = "its first request was not VALIDATE"
        elif self.table is _BEFORE_AUTH:
            why = "it sent a request before authenticating"
        else:
            why = "the request is not allowed here"
        _log.warning(
            "store client %s sent opcode %d and was disconnected: %s", self.peer, request.op, why
        )
        self._close(replies)

    # -- handshake and authentication --------------------------------------

    def h_validate(self, request: Request) -> bytes | None:
        if request.number != VALIDATE_MAGIC:
            raise ProtocolError(f"bad VALIDATE magic {request.number:#x}")
        self.table = _BEFORE_AUTH if self.server.secret is not None else _FULL
        return None

    def h_ping(self, request: Request) -> bytes | None:
        if request.number == PROBE_NONCE:
            features = FEATURE_AUTH_REQUIRED if self.server.secret is not None else 0
            return encode_u32(SERVER_HELLO | features)
        return encode_u32(request.number)

    def h_auth_challenge(self, _request: Request) -> bytes | None:
        if self.server.secret is None:
            raise ProtocolError("authentication is not enabled on this server")
        self.server_nonce = os.urandom(32)
        return self.server_nonce

    def h_auth_response(self, request: Request) -> bytes | None:
        secret = self.server.secret
        server_nonce, self.server_nonce = self.server_nonce, None
        if secret is None or server_nonce is None:
            raise ProtocolError("AUTH_RESPONSE without a preceding AUTH_CHALLENGE")
        client_nonce, tag = request.values
        expected = auth_tag(secret, CLIENT_AUTH_LABEL, server_nonce, client_nonce)
        if not hmac.compare_digest(tag, expected):
            raise _Disconnect("authentication failed", bytes([AuthStatus.REFUSED]))
        self.table = _FULL
        proof = auth_tag(secret, SERVER_AUTH_LABEL, server_nonce, client_nonce)
        return bytes([AuthStatus.OK]) + proof

    # -- torch's operations ------------------------------------------------

    def h_set(self, request: Request) -> bytes | None:
        key = request.keys[0]
        self.state.data[key] = request.values[0]
        if self.state.waiters:
            self.state.notify(key)
        return None

    def h_get(self, request: Request) -> bytes | None:
        return encode_bytes(self.state.data.get(request.keys[0], b""))

    def h_compare_set(self, request: Request) -> bytes | None:
        state = self.state
        key = request.keys[0]
        expected, desired = request.values
        current = state.data.get(key)
        if current is None:
            if expected:
                return encode_bytes(expected)
        elif current != expected:
            return encode_bytes(current)
        state.data[key] = desired
        if state.waiters:
            state.notify(key)
        return encode_bytes(desired)

    def _add(self, key: bytes, amount: int) -> int:
        state = self.state
        current = state.data.get(key)
        try:
            value = amount if current is None else int(current) + amount
        except ValueError:
            raise ProtocolError(f"ADD on key {key!r} whose value is not an integer") from None
        state.data[key] = str(value).encode()
        if state.waiters:
            state.notify(key)
        return value

    def h_add(self, request: Request) -> bytes | None:
        return encode_i64(self._add(request.keys[0], request.number))

    def h_check(self, request: Request) -> bytes | None:
        exists = self.state.exists
        return _READY if all(exists(key) for key in request.keys) else _NOT_READY

    def h_wait(self, request: Request) -> bytes | None:
        state = self.state
        keys = request.keys

        def ready() -> bytes | None:
            return _STOP_WAITING if all(state.exists(key) for key in keys) else None

        reply = ready()
        if reply is None:
            missing = tuple(key for key in keys if not state.exists(key))
            state.add_waiter(_Waiter(self, missing, ready), None, b"")
        return reply

    def h_num_keys(self, _request: Request) -> bytes | None:
        return encode_i64(len(self.state.data))

    def h_delete_key(self, request: Request) -> bytes | None:
        key = request.keys[0]
        if self.state.data.pop(key, None) is None:
            return _ZERO
        if self.state.waiters:
            self.state.notify(key)
        return _ONE

    def h_append(self, request: Request) -> bytes | None:
        key = request.keys[0]
        data = self.state.data
        data[key] = data.get(key, b"") + request.values[0]
        if self.state.waiters:
            self.state.notify(key)
        return None

    def h_multi_get(self, request: Request) -> bytes | None:
        data = self.state.data
        return b"".join(encode_bytes(data.get(key, b"")) for key in request.keys)

    def h_multi_set(self, request: Request) -> bytes | None:
        state = self.state
        state.data.update(zip(request.keys, request.values, strict=True))
        if state.waiters:
            for key in request.keys:
                state.notify(key)
        return None

    def h_cancel_wait(self, _request: Request) -> bytes | None:
        if self.waiter is not None:
            self.state.drop(self.waiter)
        return _WAIT_CANCELED

    def h_queue_push(self, request: Request) -> bytes | None:
        key = request.keys[0]
        self.state.queues.setdefault(key, deque()).append(request.values[0])
        if self.state.waiters:
            self.state.notify(key)
        return None

    def h_queue_pop(self, request: Request) -> bytes | None:
        key = request.keys[0]
        queue = self.state.queues.get(key)
        if not queue:
            return _ZERO
        item = queue.popleft()
        if not queue:
            del self.state.queues[key]
        return _ONE + encode_bytes(item)

    def h_queue_len(self, request: Request) -> bytes | None:
        return encode_i64(len(self.state.queues.get(request.keys[0], ())))

    def h_list_keys(self, _request: Request) -> bytes | None:
        keys = list(self.state.data)
        return encode_i64(len(keys)) + b"".join(encode_bytes(key) for key in keys)

    def h_barrier(self, request: Request) -> bytes | None:
        key = request.keys[0]
        world_size = request.number
        state = self.state

        def ready() -> bytes | None:
            try:
                arrived = int(state.data.get(key, b"0"))
            except ValueError:
                return None
            return _STOP_WAITING if arrived >= world_size else None

        self._add(key, 1)
        reply = ready()
        if reply is None:
            state.add_waiter(_Waiter(self, (key,), ready), None, b"")
        return reply

    # -- rdzv's extensions -------------------------------------------------

    def h_get_wait(self, request: Request) -> bytes | None:
        key = request.keys[0]
        data = self.state.data
        value = data.get(key)
        if value is not None:
            return _FOUND + encode_bytes(value)
        if request.number == 0:
            return _TIMED_OUT

        def ready() -> bytes | None:
            found = data.get(key)
            return None if found is None else _FOUND + encode_bytes(found)

        self.state.add_waiter(_Waiter(self, (key,), ready), request.number, _TIMED_OUT)
        return None

    def h_watch(self, request: Request) -> bytes | None:
        key = request.keys[0]
        previous = request.values[0] if request.values else None
        data = self.state.data

        def changed() -> bytes | None:
            current = data.get(key)
            if current == previous:
                return None
            return _WATCH_ABSENT if current is None else _WATCH_PRESENT + encode_bytes(current)

        reply = changed()
        if reply is not None:
            return reply
        if request.number == 0:
            return _WATCH_UNCHANGED
        self.state.add_waiter(_Waiter(self, (key,), changed), request.number, _WATCH_UNCHANGED)
        return None

    def h_multi_try_get(self, request: Request) -> bytes | None:
        data = self.state.data
        parts = []
        for key in request.keys:
            value = data.get(key)
            parts.append(b"\x00" if value is None else b"\x01" + encode_bytes(value))
        return b"".join(parts)


_BEFORE_VALIDATE: dict[int, _Handler] = {Op.VALIDATE: _Connection.h_validate}
_WHILE_WAITING: dict[int, _Handler] = {Op.CANCEL_WAIT: _Connection.h_cancel_wait}
_BEFORE_AUTH: dict[int, _Handler] = {
    Op.PING: _Connection.h_ping,
    Op.AUTH_CHALLENGE: _Connection.h_auth_challenge,
    Op.AUTH_RESPONSE: _Connection.h_auth_response,
}
_FULL: dict[int, _Handler] = {
    Op.VALIDATE: _Connection.h_validate,
    Op.SET: _Connection.h_set,
    Op.COMPARE_SET: _Connection.h_compare_set,
    Op.GET: _Connection.h_get,
    Op.ADD: _Connection.h_add,
    Op.CHECK: _Connection.h_check,
    Op.WAIT: _Connection.h_wait,
    Op.GETNUMKEYS: _Connection.h_num_keys,
    Op.DELETE_KEY: _Connection.h_delete_key,
    Op.APPEND: _Connection.h_append,
    Op.MULTI_GET: _Connection.h_multi_get,
    Op.MULTI_SET: _Connection.h_multi_set,
    Op.CANCEL_WAIT: _Connection.h_cancel_wait,
    Op.PING: _Connection.h_ping,
    Op.QUEUE_PUSH: _Connection.h_queue_push,
    Op.QUEUE_POP: _Connection.h_queue_pop,
    Op.QUEUE_LEN: _Connection.h_queue_len,
    Op.LIST_KEYS: _Connection.h_list_keys,
    Op.BARRIER: _Connection.h_barrier,
    Op.WATCH: _Connection.h_watch,
    Op.GET_WAIT: _Connection.h_get_wait,
    Op.MULTI_TRY_GET: _Connection.h_multi_try_get,
}
# Dict lookups hash ints faster than IntEnum members: key the tables by int.
for _table in (_BEFORE_VALIDATE, _WHILE_WAITING, _BEFORE_AUTH, _FULL):
    for _op in list(_table):
        _table[int(_op)] = _table.pop(_op)


class TCPStoreServer:
    """A TCP store server speaking torch's TCPStore protocol.

    Args:
        host: The address to listen on; None (the default) listens on every
            address, IPv6 and IPv4 (dual stack), falling back to IPv4 only.
        port: The port; 0 picks a free one (see :attr:`port`).
        auth_token: A shared secret; when given, clients must authenticate
            (rdzv clients only: torch's client cannot).
        ssl_context: A server-side TLS context; when given, connections use TLS.
        max_connections: Most client connections open at once; a connection
            past it is closed as soon as it is accepted, with a log line.
        frame_timeout: Seconds within which a request must arrive in full once
            its first byte has, within which a new connection must finish
            the handshake (and authentication), and for which a peer may
            leave its replies unread; a slower peer is disconnected.
        idle_timeout: Seconds after which a connection with nothing pending is
            closed; a connection blocked in a request it asked for (``WAIT``,
            ``WATCH``, ``BARRIER``...) is never idle. None (the default) keeps
            idle connections, as torch's clients expect.
        tcp_keepalive: Seconds of silence before the kernel probes a peer
            (then every 10 s; 6 unanswered probes close the connection), so
            half-open connections go away; None turns keepalive off.

    Raises:
        ValueError: ``port`` is out of range, ``auth_token`` is empty or a
            limit is not positive.
    """

    def __init__(
        self,
        host: str | None = None,
        port: int = 0,
        *,
        auth_token: str | bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        frame_timeout: float = DEFAULT_FRAME_TIMEOUT,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        tcp_keepalive: float | None = DEFAULT_TCP_KEEPALIVE,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if auth_token is not None and not auth_token:
            raise ValueError("auth_token must not be empty")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        for name, value in (
            ("frame_timeout", frame_timeout),
            ("idle_timeout", idle_timeout),
            ("tcp_keepalive", tcp_keepalive),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.max_connections = max_connections
        self.frame_timeout = float(frame_timeout)
        self.idle_timeout = None if idle_timeout is None else float(idle_timeout)
        self.tcp_keepalive = None if tcp_keepalive is None else float(tcp_keepalive)
        self.refused_connections = 0
        """Connections closed at once because ``max_connections`` was reached."""
        self.expired_connections = 0
        """Connections closed for breaking ``frame_timeout`` or ``idle_timeout``."""
        self._host = host
        self._requested_port = port
        self.secret = auth_token.encode() if isinstance(auth_token, str) else auth_token
        self._ssl_context = ssl_context
        self.state = _StoreState()
        self.connections: set[_Connection] = set()
        self._port: int | None = None
        self._bound_host = host or "::"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        """The port the server listens on.

        Raises:
            RuntimeError: The server is not running.
        """
        if self._port is None:
            raise RuntimeError("the store server is not running")
        return self._port

    @property
    def host(self) -> str:
        """The address the server listens on (``::`` for every address)."""
        return self._bound_host

    @property
    def running(self) -> bool:
        """Whether the server is listening."""
        return self._port is not None

    def start(self) -> TCPStoreServer:
        """Start serving in a background (daemon) thread; returns once bound.

        Returns:
            This server.

        Raises:
            OSError: The address could not be bound.
            RuntimeError: The server was already started.
        """
        if self._thread is not None:
            raise RuntimeError("the store server was already started")
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main(None)), name="rdzv-store-server", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise self._error
        return self

    def stop(self) -> None:
        """Stop serving, close every connection and join the thread (idempotent)."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
            self._thread = None

    def serve(self, on_ready: Callable[[TCPStoreServer], None] | None = None) -> None:
        """Serve in the current thread until SIGTERM or SIGINT (or :meth:`stop`).

        Args:
            on_ready: Called once the server is bound, e.g. to print the address.

        Raises:
            OSError: The address could not be bound.
        """
        asyncio.run(self._main(on_ready, install_signals=True))
        if self._error is not None:
            raise self._error

    def waiter_count(self) -> int:
        """Return the number of blocked requests (for tests and monitoring)."""
        return self._call(lambda: len(self.state.active))

    def connection_count(self) -> int:
        """Return the number of open client connections."""
        return self._call(lambda: len(self.connections))

    def _call(self, func: Callable[[], int]) -> int:
        loop = self._loop
        if loop is None:
            return func()
        if self._thread is threading.current_thread():
            return func()

        async def run() -> int:
            return func()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=30)

    def __enter__(self) -> TCPStoreServer:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _main(
        self,
        on_ready: Callable[[TCPStoreServer], None] | None,
        *,
        install_signals: bool = False,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            sock = bind_listener(self._host, self._requested_port)
            server = await loop.create_server(
                lambda: _Connection(self),
                sock=sock,
                backlog=listen_backlog(),
                ssl=self._ssl_context,
            )
        except (OSError, ValueError) as exc:
            self._error = exc
            self._ready.set()
            return
        address = sock.getsockname()
        self._bound_host = str(address[0])
        self._port = int(address[1])
        self._loop = loop
        if install_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self._stop.set)
        self._ready.set()
        sweeper = loop.create_task(self._sweep())
        try:
            if on_ready is not None:
                on_ready(self)
            await self._stop.wait()
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            server.close()
            for conn in list(self.connections):
                if conn.transport is not None:
                    conn.transport.abort()
            await server.wait_closed()
            for _ in range(3):
                await asyncio.sleep(0)
            if install_signals:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(signum)
            self._port = None
            self._loop = None

    async def _sweep(self) -> None:
        """Close, periodically, every connection that broke a time limit."""
        limits = [self.frame_timeout]
        if self.idle_timeout is not None:
            limits.append(self.idle_timeout)
        period = min(1.0, max(0.05, min(limits) / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.connections):
                reason = conn.expired(now)
                if reason is not None:
                    conn.close_expired(reason)


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """Build the TLS context a store server serves ``cert`` with.

    Args:
        cert: A PEM certificate chain.
        key: The PEM private key of ``cert``.

    Returns:
        A server-side context (TLS 1.2 or later, no client certificates asked).

    Raises:
        OSError: A file cannot be read.
        ssl.SSLError: The files do not hold a matching certificate and key.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def serve_main(
    host: str | None,
    port: int,
    *,
    auth_token_file: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    frame_timeout: float = DEFAULT_FRAME_TIMEOUT,
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
) -> int:
    """Run a store server in the foreground: the ``rdzv serve`` command.

    Prints ``rdzv store listening on HOST:PORT`` once bound and stops cleanly
    on SIGTERM or SIGINT.

    Args:
        host: The address to listen on; None for every address.
        port: The port (0 picks a free one).
        auth_token_file: A file holding the shared secret (surrounding
            whitespace is stripped); without it the secret is read from the
            ``RDZV_AUTH_TOKEN`` environment variable, if set.
        tls_cert: A PEM certificate chain; enables TLS together with ``tls_key``.
        tls_key: The PEM private key of ``tls_cert``.
        max_connections: See :class:`TCPStoreServer`.
        frame_timeout: See :class:`TCPStoreServer`.
        idle_timeout: See :class:`TCPStoreServer`.

    Returns:
        The exit status.

    Raises:
        ValueError: Only one of ``tls_cert`` and ``tls_key`` was given, the
            token file is empty or a limit is not positive.
        OSError: A file could not be read or the address could not be bound.
    """
    token = resolve_auth_token(auth_token_file)
    context: ssl.SSLContext | None = None
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("--tls-cert and --tls-key must be given together")
    if tls_cert is not None and tls_key is not None:
        context = server_tls_context(tls_cert, tls_key)
    server = TCPStoreServer(
        host,
        port,
        auth_token=token,
        ssl_context=context,
        max_connections=max_connections,
        frame_timeout=frame_timeout,
        idle_timeout=idle_timeout,
    )

    def announce(srv: TCPStoreServer) -> None:
        shown = f"[{srv.host}]" if ":" in srv.host else srv.host
        extras = [name for name, on in (("auth", token), ("tls", context)) if on is not None]
        suffix = f" ({', '.join(extras)})" if extras else ""
        print(f"rdzv store listening on {shown}:{srv.port}{suffix}", flush=True)

    server.serve(announce)
    return 0
