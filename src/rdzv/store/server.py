"""The TCP store server: asyncio, speaking torch's TCPStore protocol.

Theory of operation
-------------------
One asyncio event loop serves every connection. Each connection owns a
:class:`~rdzv.store.protocol.RequestParser`; ``data_received`` feeds it and
answers every complete request at once, joining the replies of a burst into
one write. The store itself is a :class:`~rdzv.store.engine.StoreEngine`,
touched only from the loop's thread (no locks); a connection hands it each
store request and writes the replies it returns, to the sender and to the
connections whose blocked requests the request answered.

A connection moves through three dispatch tables: before ``VALIDATE`` only
``VALIDATE``; on a server with a secret, only the handshake and
authentication until the client proves it knows the secret; then everything,
store requests going straight to the engine's handlers. While a request of
its own is blocked (``WAIT``, ``BARRIER``, ``GET_WAIT``, ``WATCH``), only
``CANCEL_WAIT``, which torch's client sends after its own timeout and which
is answered even if the ``STOP_WAITING`` crossed it on the wire. The timeout of rdzv's ``GET_WAIT`` and ``WATCH`` is a loop timer that
drops the request from the engine and sends the engine's timeout reply. A
request outside the current table, garbage, an over-limit length, a request
the engine refuses or a truncated frame at close ends the connection (and
its blocked request) with one log line; other connections are unaffected.

Limits against misbehaving peers
--------------------------------
Each limit has a named default and a constructor parameter (see
:class:`TCPStoreServer`). Connections past ``max_connections`` are closed as
soon as they are accepted; kernel keepalive probes find a peer gone without
a FIN, even one blocked in a long ``WAIT``; one sweeper task closes every
connection that broke ``frame_timeout`` (a request still incomplete that long
after its first byte, an unfinished handshake, replies left unread: a slow
writer or reader) or ``idle_timeout`` (which a connection blocked in a
request it asked for never is: it waits for the server). The parser refuses
oversize keys, values and key counts as soon as their length is readable.

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
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from rdzv.net import bind_listener, enable_keepalive, listen_backlog, server_tls_context
from rdzv.store.engine import BLOCKING_OPS, StoreEngine, Woken
from rdzv.store.protocol import (
    CLIENT_AUTH_LABEL,
    FEATURE_AUTH_REQUIRED,
    PROBE_NONCE,
    SERVER_AUTH_LABEL,
    SERVER_HELLO,
    VALIDATE_MAGIC,
    AuthStatus,
    Op,
    ProtocolError,
    Request,
    RequestParser,
    auth_tag,
    encode_u32,
)

__all__ = [
    "DEFAULT_FRAME_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_TCP_KEEPALIVE",
    "TCPStoreServer",
    "server_tls_context",
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


class _Disconnect(Exception):  # noqa: N818 - control flow, not an error report
    """Raised by a handler to send a last reply and close the connection."""

    def __init__(self, reason: str, last_reply: bytes) -> None:
        super().__init__(reason)
        self.last_reply = last_reply


_Handler = Callable[["_Connection", Request], "bytes | None"]
_StoreHandler = Callable[["_Connection", Request], "tuple[bytes | None, Woken[_Connection]]"]
_NO_HANDLERS: Mapping[int, _StoreHandler] = MappingProxyType({})


class _Connection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: TCPStoreServer) -> None:
        self.server = server
        self.engine = server.engine
        self.parser = RequestParser()
        self.table: dict[int, _Handler] = _BEFORE_VALIDATE
        self.transport: asyncio.Transport | None = None
        self.waiting = False
        """Whether a request of this connection is blocked in the engine."""
        self.store_handlers: Mapping[int, _StoreHandler] = _NO_HANDLERS
        """The engine's handlers this connection may use: all of them once the
        handshake is done, none while a request of its own is blocked."""
        self.timer: asyncio.TimerHandle | None = None
        """Ends the blocked request when its own timeout passes (WATCH, GET_WAIT)."""
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
        self.server.accepted_connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.engine.drop(self)
        self._stop_waiting()
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
                self.server.requests += 1
                run = self.store_handlers.get(request.op)
                if run is not None:
                    reply, woken = run(self, request)
                    if woken:
                        for conn, answer in woken:
                            conn.answer(answer)
                    if reply is None and request.op in BLOCKING_OPS:
                        self._start_waiting()
                else:
                    table = _WHILE_WAITING if self.waiting else self.table
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
        if idle is not None and not self.waiting and now - self.last_activity > idle:
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
        if self.waiting:
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
        if self.server.secret is not None:
            self.table = _BEFORE_AUTH
        else:
            self._open()
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
        self._open()
        proof = auth_tag(secret, SERVER_AUTH_LABEL, server_nonce, client_nonce)
        return bytes([AuthStatus.OK]) + proof

    # -- blocked requests --------------------------------------------------

    def h_cancel_wait(self, request: Request) -> bytes | None:
        self._stop_waiting()
        reply, _ = self.engine.apply(self, request)
        return reply

    def answer(self, reply: bytes) -> None:
        """Send the reply that ends this connection's blocked request."""
        self._stop_waiting()
        self.write(reply)

    def _open(self) -> None:
        """Finish the handshake: every request is allowed from now on."""
        self.table = _FULL
        self.store_handlers = self.engine.handlers

    def _start_waiting(self) -> None:
        self.waiting = True
        self.store_handlers = _NO_HANDLERS
        timeout_ms = self.engine.timeout_ms(self)
        if timeout_ms is not None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(timeout_ms / 1000.0, self._time_out)

    def _stop_waiting(self) -> None:
        if self.waiting:
            self.waiting = False
            self.store_handlers = self.engine.handlers
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _time_out(self) -> None:
        self._stop_waiting()
        reply = self.engine.drop(self)
        if reply is not None:
            self.write(reply)


_BEFORE_VALIDATE: dict[int, _Handler] = {Op.VALIDATE: _Connection.h_validate}
_WHILE_WAITING: dict[int, _Handler] = {Op.CANCEL_WAIT: _Connection.h_cancel_wait}
_BEFORE_AUTH: dict[int, _Handler] = {
    Op.PING: _Connection.h_ping,
    Op.AUTH_CHALLENGE: _Connection.h_auth_challenge,
    Op.AUTH_RESPONSE: _Connection.h_auth_response,
}
_FULL: dict[int, _Handler] = {Op.VALIDATE: _Connection.h_validate, Op.PING: _Connection.h_ping}
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
        self.accepted_connections = 0
        """Connections accepted (not refused) since the server started."""
        self.requests = 0
        """Requests parsed since the server started."""
        self._host = host
        self._requested_port = port
        self.secret = auth_token.encode() if isinstance(auth_token, str) else auth_token
        self._ssl_context = ssl_context
        self.engine: StoreEngine[_Connection] = StoreEngine()
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
        return self._call(lambda: self.engine.waiter_count)

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
