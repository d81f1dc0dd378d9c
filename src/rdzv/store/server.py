"""The TCP store server: asyncio, speaking torch's TCPStore protocol.

Theory of operation
-------------------
One asyncio event loop serves every connection. The server runs its own
accept loop; each accepted socket becomes a :class:`_Connection` at once
(before any TLS handshake, so handshakes in progress are counted), which
owns a :class:`~rdzv.store.protocol.RequestParser`. ``data_received`` feeds
it and executes the complete requests, joining the replies of a burst into
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
is answered even if the ``STOP_WAITING`` crossed it on the wire. The
parser's ``allowed`` opcodes follow the table, so a request outside it is
refused when its opcode byte arrives, before any of it is buffered. The
timeout of rdzv's ``GET_WAIT`` and ``WATCH`` is a loop timer that drops the
request from the engine and sends the engine's timeout reply. A request
outside the current table, garbage, an over-limit length, a request the
engine refuses or a truncated frame at close ends the connection (and its
blocked request) with one log line; other connections are unaffected.

Limits against misbehaving peers
--------------------------------
Each limit has a named default and a constructor parameter (see
:class:`TCPStoreServer`).

* Two tiers of connections. A connection is in its handshake (TLS,
  ``VALIDATE``, authentication) until it finishes it; those are capped by
  ``max_handshakes``, where a newcomer closes the oldest (a real client
  finishes in milliseconds, a stalling one is what gets reclaimed), and by
  a deadline, ``handshake_timeout``. A handshake younger than
  :func:`handshake_grace` is never reclaimed: the newcomer is refused
  instead and retries (the client backs off). Without the grace, thousands
  of real clients connecting at once (every agent of a large job starting)
  closed each other's handshakes faster than any could finish. Only a finished handshake takes one of
  the ``max_connections`` slots, so peers without the secret never hold
  one. Without a secret anyone finishes the handshake with ``VALIDATE``, so
  one peer address may hold at most ``max_connections_per_address`` slots.
* Both caps are lowered at start to what the open-file limit leaves room
  for (with :data:`FD_HEADROOM` spare), so a refusal is a clean accept and
  close, not an ``EMFILE``; the accept loop backs off when accept fails
  anyway, and the log lines a flood repeats are throttled.
* Work per connection. A turn parses at most :data:`FEED_SLICE` received
  bytes (a large read waits in the connection's inbox for later turns) and
  executes at most :data:`REQUESTS_PER_TURN` requests; once the connection's unsent replies pass ``max_unsent_bytes``
  it executes nothing more, and reads nothing, until the peer has read; the
  engine refuses a reply past its own bound. Received bytes not executed
  yet (mostly incomplete requests) are counted over all connections, the
  keys already decoded from an incomplete request at their memory cost
  (:data:`~rdzv.store.protocol.DECODED_ITEM_OVERHEAD` more each); past
  ``max_buffered_bytes`` the slowest incomplete request's connection is
  closed. The parser refuses oversize
  keys, values and key counts as soon as their length is readable, and
  costs time linear in a request's size however it is split.
* Time. Kernel keepalive probes find a peer gone without a FIN, even one
  blocked in a long ``WAIT``; one sweeper task closes every connection that
  broke ``frame_timeout`` (a request still incomplete that long after its
  first byte, replies left unread that long), the handshake deadline, or
  ``idle_timeout`` (which a connection blocked in a request it asked for
  never is: it waits for the server).

The server runs either in a background thread of the current process
(:meth:`TCPStoreServer.start`, what ``TCPStore(is_master=True)`` does) or in
the foreground until a signal (:meth:`TCPStoreServer.serve`, what
``rdzv serve`` does). Its event loop is the standard library's, or uvloop's
with ``loop="uvloop"`` (the ``rdzv[fast]`` extra), which is imported only
then: the same protocol callbacks run on either.

Size: longer than the project's ~600-line guide: the connection and the
server that admits, sweeps and counts it share every limit's bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import os
import resource
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from types import MappingProxyType
from typing import Any, Final, cast

from rdzv.net import bind_listener, enable_keepalive, listen_backlog, server_tls_context
from rdzv.store.engine import BLOCKING_OPS, DEFAULT_MAX_WAITING_BYTES, StoreEngine, Woken
from rdzv.store.protocol import (
    CLIENT_AUTH_LABEL,
    DECODED_ITEM_OVERHEAD,
    FEATURE_AUTH_REQUIRED,
    MAX_MULTI_KEYS,
    MAX_REQUEST_BYTES,
    PROBE_NONCE,
    SERVER_AUTH_LABEL,
    SERVER_HELLO,
    VALIDATE_MAGIC,
    AuthStatus,
    Op,
    ProtocolError,
    RefusedOpcodeError,
    Request,
    RequestParser,
    auth_tag,
    encode_u32,
)
from rdzv.threads import start_thread

__all__ = [
    "ACCEPT_BACKLOG",
    "ACCEPT_BACKOFF",
    "DEFAULT_FRAME_TIMEOUT",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_ADDRESS",
    "DEFAULT_MAX_BUFFERED_BYTES",
    "DEFAULT_MAX_HANDSHAKES",
    "DEFAULT_MAX_UNSENT_BYTES",
    "DEFAULT_TCP_KEEPALIVE",
    "EVENT_LOOPS",
    "FD_HEADROOM",
    "FEED_SLICE",
    "RECEIVE_BUFFER_BYTES",
    "LOG_INTERVAL",
    "REQUESTS_PER_TURN",
    "HANDSHAKE_GRACE",
    "TCPStoreServer",
    "handshake_grace",
    "server_tls_context",
]

_log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS: Final = 4096
"""Most client connections past the handshake a server keeps open at once."""
DEFAULT_MAX_HANDSHAKES: Final = 128
"""Most connections in their handshake (TLS, ``VALIDATE``, authentication) at once."""
DEFAULT_HANDSHAKE_TIMEOUT: Final = 10.0
"""Seconds within which a new connection must finish its handshake."""
HANDSHAKE_GRACE: Final = 1.0
"""Seconds a handshake in progress is safe from a newcomer (see :func:`handshake_grace`)."""
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: Final[int | None] = None
"""None: three quarters of the connection cap without a secret, no cap with one."""
DEFAULT_MAX_UNSENT_BYTES: Final = 1 << 20
"""Bytes of replies a connection may leave unread before its requests wait."""
DEFAULT_MAX_BUFFERED_BYTES: Final = MAX_REQUEST_BYTES + 2 * MAX_MULTI_KEYS * DECODED_ITEM_OVERHEAD
"""Bytes held by received, unexecuted requests over every connection at once,
items already decoded from incomplete ones counted at their memory cost: one
request of the largest size, with the most items, fits."""
DEFAULT_FRAME_TIMEOUT: Final = 60.0
"""Seconds within which a started request (or the handshake) must arrive in full."""
DEFAULT_IDLE_TIMEOUT: Final[float | None] = None
"""Seconds a connection may sit with nothing pending; None never closes idle
connections (torch's client holds its connection idle for a whole job and
never reconnects, so the default keeps torch compatibility)."""
DEFAULT_TCP_KEEPALIVE: Final = 60.0
"""Seconds of silence before the kernel's first keepalive probe; dead after 6 more
probes 10 s apart, so a half-open peer is found in about two minutes."""
RECEIVE_BUFFER_BYTES: Final = 256 * 1024
"""The most one read takes from a connection (asyncio's own read size)."""
REQUESTS_PER_TURN: Final = 1024
"""Requests of one connection executed before the others get their turn: about
2 ms of cheap requests. At 64, a client pipelining ``set``s made the loop turn
once per 64 requests, and the server took a quarter fewer of them a second."""
FEED_SLICE: Final = RECEIVE_BUFFER_BYTES
"""Received bytes of one connection parsed before the others get their turn:
one read, so ordinary traffic is parsed in the turn that read it. Parsing the
worst case (32 Ki empty keys) takes about 10 ms."""
ACCEPT_BACKLOG: Final = 512
"""The largest listen backlog used (the kernel's ``somaxconn`` when smaller)."""
ACCEPT_BACKOFF: Final = 0.1
"""Longest pause of the accept loop while it lacks file descriptors or memory."""
FD_HEADROOM: Final = 64
"""File descriptors kept free of connections, for the process's other needs."""
LOG_INTERVAL: Final = 10.0
"""Seconds between two log lines of one kind that a flood of connections can repeat."""

EVENT_LOOPS: Final = ("asyncio", "uvloop")
"""The event loops a server can run on (``loop=``); the first is the default."""

_ACCEPT_OUT_OF_RESOURCES: Final = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
)


def handshake_grace(handshake_timeout: float) -> float:
    """Return how long a handshake in progress is safe from being reclaimed by a newcomer.

    :data:`HANDSHAKE_GRACE`, or a quarter of the handshake deadline when
    that is shorter: a stalling peer is still reclaimed well before it
    would expire.

    Args:
        handshake_timeout: Seconds within which a handshake must finish.

    Returns:
        Seconds.
    """
    return min(HANDSHAKE_GRACE, handshake_timeout / 4)


class _Disconnect(Exception):  # noqa: N818 - control flow, not an error report
    """Raised by a handler to send a last reply and close the connection."""

    def __init__(self, reason: str, last_reply: bytes, *, logged: bool = False) -> None:
        super().__init__(reason)
        self.last_reply = last_reply
        self.logged = logged
        """Whether the reason was logged already (the server throttles some)."""


class _ThrottledLog:
    """Warnings of one kind at most once per interval, counting those held back.

    A flood of connections must not become a flood of log lines: the kinds
    that a peer can repeat at the rate it connects (refusals, reclaimed and
    expired handshakes, accept errors, any disconnect before the handshake
    is done) go through here.
    """

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        if held:
            message += " (and %d more like it since the last such line)"
            args = (*args, held)
        _log.warning(message, *args)


_Handler = Callable[["_Connection", Request], "bytes | None"]
_StoreHandler = Callable[["_Connection", Request], "tuple[bytes | None, Woken[_Connection]]"]
_NO_HANDLERS: Mapping[int, _StoreHandler] = MappingProxyType({})


class _Connection(asyncio.BufferedProtocol):
    """One client connection, from its accept to its close.

    It receives into the server's one receive buffer (the loop runs one
    callback at a time, and the bytes are copied out at once), so a read
    allocates nothing: a plain protocol gets a new 256 KiB ``bytes`` per
    read from asyncio, which glibc may serve with ``mmap``, doubling the
    server's CPU time per request.
    """

    def __init__(self, server: TCPStoreServer, address: str, peer: str) -> None:
        self.server = server
        self.engine = server.engine
        self.parser = RequestParser()
        self.parser.allowed = _BEFORE_VALIDATE
        self.parser.on_count = self._on_count
        self.table: dict[int, _Handler] = _BEFORE_VALIDATE
        self.transport: asyncio.Transport | None = None
        self.attaching: asyncio.Task[None] | None = None
        """Makes the transport (the TLS handshake, on a TLS server); None once done."""
        self.address = address
        self.peer = peer
        self.is_open = False
        """Whether the handshake is done (the connection counts in ``max_connections``)."""
        self.released = False
        self.waiting = False
        """Whether a request of this connection is blocked in the engine."""
        self.store_handlers: Mapping[int, _StoreHandler] = _NO_HANDLERS
        """The engine's handlers this connection may use: all of them once the
        handshake is done, none while a request of its own is blocked."""
        self.timer: asyncio.TimerHandle | None = None
        """Ends the blocked request when its own timeout passes (WATCH, GET_WAIT)."""
        self.server_nonce: bytes | None = None
        self.opened_at = time.monotonic()
        self.last_activity = self.opened_at
        self.frame_started: float | None = None
        self.write_blocked_since: float | None = None
        self.stalled = False
        """Whether execution stopped with requests buffered (reply budget or turn spent)."""
        self.buffered = 0
        """The bytes of received, unexecuted requests counted in the server's total."""
        self.inbox = bytearray()
        """Received bytes not fed to the parser yet: a large read is parsed
        :data:`FEED_SLICE` bytes per turn, other connections' turns between."""

    def _on_count(self, op: Op, count: int) -> None:
        """Count a ``WAIT`` against the waiting budget before its keys arrive."""
        if op == Op.WAIT:
            self.engine.reserve_wait(self, count)

    # -- asyncio callbacks -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an asyncio.Transport subclass
        # (uvloop's implement the interface without deriving from it).
        self.transport = cast("asyncio.Transport", transport)
        budget = self.server.max_unsent_bytes
        self.transport.set_write_buffer_limits(high=budget, low=budget // 4)

    def connection_lost(self, exc: Exception | None) -> None:
        self.engine.drop(self)
        self._stop_waiting()
        if self.parser.pending and self.is_open:
            self.server.throttled.warning(
                "partial",
                "store client %s disconnected in the middle of a request (%d bytes unparsed)",
                self.peer,
                self.parser.pending,
            )
        self.server.release(self)
        self._drop_received()
        self.transport = None

    def pause_writing(self) -> None:
        self.write_blocked_since = time.monotonic()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_blocked_since = None
        if self.stalled:
            self._resume()
        elif self.transport is not None:
            self.transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.server.receive_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self.server.receive_buffer[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        if self.inbox or len(data) > FEED_SLICE:
            self.inbox += data
        else:
            self.parser.feed(data)
        now = self.last_activity = time.monotonic()
        if self.frame_started is None:
            self.frame_started = now
        if not self.stalled:
            self._serve(now)
        self.server.account(self)

    # -- serving -----------------------------------------------------------

    def _serve(self, now: float) -> None:
        """Execute buffered requests until none is complete or this turn is spent.

        A turn ends after :data:`REQUESTS_PER_TURN` requests, or once the
        replies not yet taken by the peer pass ``max_unsent_bytes``; the
        connection then stops reading and executes nothing more until the
        peer has read (``resume_writing``) or, when the kernel took the
        replies at once, until the loop has served everyone else.
        """
        parser = self.parser
        transport = self.transport
        if transport is None:
            return
        inbox = self.inbox
        if inbox:
            parser.feed(inbox[:FEED_SLICE])
            del inbox[:FEED_SLICE]
        budget = self.server.max_unsent_bytes - transport.get_write_buffer_size()
        replies: list[bytes] = []
        size = 0
        turn = REQUESTS_PER_TURN
        try:
            while True:
                if sets := parser.next_sets(turn):
                    self.frame_started = now
                    self.server.requests += len(sets)
                    for conn, answer in self.engine.set_many(sets):
                        conn.answer(answer)
                    turn -= len(sets)
                    if not turn:
                        self.stalled = True
                        transport.pause_reading()
                        break
                request = parser.next_request()
                if request is None:
                    if inbox:
                        self.stalled = True
                        transport.pause_reading()
                    elif not parser.pending:
                        self.frame_started = None
                    break
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
                        self._refuse(request.op, replies)
                        return
                    reply = handler(self, request)
                if reply is not None:
                    replies.append(reply)
                    size += len(reply)
                turn -= 1
                if size > budget or not turn:
                    self.stalled = True
                    transport.pause_reading()
                    break
        except RefusedOpcodeError as exc:
            self._refuse(exc.op, replies)
            return
        except ProtocolError as exc:
            self._warn(
                "bad-handshake", "store client %s sent a bad request, disconnecting: %s", exc
            )
            self._close(replies)
            return
        except _Disconnect as exc:
            if not exc.logged:
                self._warn("handshake-failed", "store client %s disconnected: %s", exc)
            replies.append(exc.last_reply)
            self._close(replies)
            return
        if replies:
            self.write(b"".join(replies) if len(replies) > 1 else replies[0])
        if self.stalled and self.write_blocked_since is None:
            asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        """Go on executing the requests a spent turn left buffered."""
        transport = self.transport
        if transport is None or not self.stalled or self.write_blocked_since is not None:
            return
        self.stalled = False
        self._serve(time.monotonic())
        self.server.account(self)
        if not self.stalled and self.write_blocked_since is None and self.transport is not None:
            self.transport.resume_reading()

    # -- helpers -----------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.last_activity = time.monotonic()
            self.transport.write(data)

    def expired(self, now: float) -> str | None:
        """Return why this connection broke a time limit, or None if it did not."""
        server = self.server
        if not self.is_open:
            if now - self.opened_at > server.handshake_deadline:
                return f"the handshake was not completed within {server.handshake_deadline:g} s"
            return None
        started = self.frame_started
        if not self.stalled and started is not None and now - started > server.frame_timeout:
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
        idle = server.idle_timeout
        if idle is not None and not self.waiting and now - self.last_activity > idle:
            return f"the connection was idle for {idle:g} s (idle_timeout)"
        return None

    def _drop_received(self) -> None:
        """Free at once what was received and not executed.

        The parser refers back to this connection (``on_count``): left to the
        garbage collector, a dropped request's decoded keys could outlive the
        connection by many requests.
        """
        self.parser = RequestParser()
        self.inbox.clear()

    def abort(self) -> None:
        """Close at once, whatever stage the connection is in.

        What it had received is dropped now (:meth:`_drop_received`).
        """
        self._drop_received()
        if self.transport is not None:
            self.transport.abort()
        elif self.attaching is not None:
            self.attaching.cancel()

    def _close(self, replies: list[bytes]) -> None:
        if self.transport is None:
            return
        if replies:
            self.transport.write(b"".join(replies))
        self._drop_received()
        self.transport.close()

    def _refuse(self, op: int, replies: list[bytes]) -> None:
        if self.waiting:
            why = "it sent a request other than CANCEL_WAIT while a wait was pending"
        elif self.table is _BEFORE_VALIDATE:
            why = "its first request was not VALIDATE"
        elif self.table is _BEFORE_AUTH:
            why = "it sent a request before authenticating"
        else:
            why = "the request is not allowed here"
        self._warn(
            "early-request", "store client %s sent opcode %d and was disconnected: %s", op, why
        )
        self._close(replies)

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """Log why this connection is closed; ``message`` names the peer first.

        Before its handshake is done anyone who reaches the port can repeat
        the cause at the rate it connects (a request before ``VALIDATE`` or
        before authenticating, garbage, a wrong secret), so the line goes
        through the server's throttle (``kind``); an open connection's is
        logged every time.
        """
        if self.is_open:
            _log.warning(message, self.peer, *args)
        else:
            self.server.throttled.warning(kind, message, self.peer, *args)

    # -- handshake and authentication --------------------------------------

    def h_validate(self, request: Request) -> bytes | None:
        if request.number != VALIDATE_MAGIC:
            raise ProtocolError(f"bad VALIDATE magic {request.number:#x}")
        if self.is_open:
            return None
        if self.server.secret is not None:
            self.table = _BEFORE_AUTH
            self.parser.allowed = _BEFORE_AUTH
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
        """Finish the handshake: every request is allowed from now on.

        Raises:
            _Disconnect: The server has no slot left for another client.
        """
        if not self.server.admit(self):
            raise _Disconnect("no connection slot left", b"", logged=True)
        self.table = _FULL
        self.parser.allowed = None
        self.store_handlers = self.engine.handlers

    def _start_waiting(self) -> None:
        self.waiting = True
        self.store_handlers = _NO_HANDLERS
        self.parser.allowed = _WHILE_WAITING
        timeout_ms = self.engine.timeout_ms(self)
        if timeout_ms is not None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(timeout_ms / 1000.0, self._time_out)

    def _stop_waiting(self) -> None:
        if self.waiting:
            self.waiting = False
            self.store_handlers = self.engine.handlers
            self.parser.allowed = None
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
        max_connections: Most connections past the handshake open at once; a
            connection past it is closed as soon as it is accepted (or, if
            the slots filled during its handshake, once that is done), with
            a log line. Lowered at start to what the open-file limit allows.
        max_handshakes: Most connections still in their handshake (TLS,
            ``VALIDATE``, authentication) at once, apart from
            ``max_connections``; when they are all taken, a new connection
            closes the oldest of them.
        handshake_timeout: Seconds within which a new connection must finish
            its handshake (at most ``frame_timeout``).
        max_connections_per_address: Most connections past the handshake
            from one peer address. None (the default) is three quarters of
            the connection cap on a server without a secret, where anyone
            can finish the handshake, and no per-address cap with one.
        max_unsent_bytes: Replies a connection may leave unread before the
            server stops executing its requests until it reads.
        max_waiting_bytes: Bytes the blocked requests (``WAIT``, ``BARRIER``,
            ``GET_WAIT``, ``WATCH``) of all connections may hold together,
            counted as each key's length plus
            :data:`~rdzv.store.engine.WAITED_KEY_OVERHEAD`; a request that
            would pass it closes its connection with a warning naming the
            limit (default :data:`~rdzv.store.engine.DEFAULT_MAX_WAITING_BYTES`).
        max_buffered_bytes: Bytes held by requests not executed yet
            (mostly incomplete ones) over all connections: their received
            bytes, plus :data:`~rdzv.store.protocol.DECODED_ITEM_OVERHEAD`
            for each key or value already decoded from an incomplete one;
            past it, the connection whose incomplete request has been
            arriving the longest is closed, and so on until under. The
            default lets one request of the largest size (and the most
            items) through.
        frame_timeout: Seconds within which a request must arrive in full once
            its first byte has, and for which a peer may leave its replies
            unread; a slower peer is disconnected.
        idle_timeout: Seconds after which a connection with nothing pending is
            closed; a connection blocked in a request it asked for (``WAIT``,
            ``WATCH``, ``BARRIER``...) is never idle. None (the default) keeps
            idle connections, as torch's clients expect.
        tcp_keepalive: Seconds of silence before the kernel probes a peer
            (then every 10 s; 6 unanswered probes close the connection), so
            half-open connections go away; None turns keepalive off.
        loop: The event loop, one of :data:`EVENT_LOOPS`: ``"asyncio"`` (the
            default, the standard library's) or ``"uvloop"`` (needs the
            ``uvloop`` package, the ``rdzv[fast]`` extra).

    Raises:
        ValueError: ``port`` is out of range, ``auth_token`` is empty, a
            limit is not positive or ``loop`` is unknown (the message names it).
        ImportError: ``loop="uvloop"`` and uvloop is not installed.
    """

    def __init__(
        self,
        host: str | None = None,
        port: int = 0,
        *,
        auth_token: str | bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        max_connections_per_address: int | None = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
        max_unsent_bytes: int = DEFAULT_MAX_UNSENT_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        max_waiting_bytes: int = DEFAULT_MAX_WAITING_BYTES,
        frame_timeout: float = DEFAULT_FRAME_TIMEOUT,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        tcp_keepalive: float | None = DEFAULT_TCP_KEEPALIVE,
        loop: str = EVENT_LOOPS[0],
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if auth_token is not None and not auth_token:
            raise ValueError("auth_token must not be empty")
        for name, count in (
            ("max_connections", max_connections),
            ("max_handshakes", max_handshakes),
            ("max_connections_per_address", max_connections_per_address),
            ("max_unsent_bytes", max_unsent_bytes),
            ("max_buffered_bytes", max_buffered_bytes),
            ("max_waiting_bytes", max_waiting_bytes),
        ):
            if count is not None and count < 1:
                raise ValueError(f"{name} must be at least 1, got {count}")
        for name, value in (
            ("handshake_timeout", handshake_timeout),
            ("frame_timeout", frame_timeout),
            ("idle_timeout", idle_timeout),
            ("tcp_keepalive", tcp_keepalive),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self._run = _loop_runner(loop)
        self.loop = loop
        """The event loop's name (one of :data:`EVENT_LOOPS`)."""
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.max_connections_per_address = max_connections_per_address
        self.max_unsent_bytes = max_unsent_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.buffered = 0
        """Bytes of received requests not executed yet, over every connection."""
        self.receive_buffer = memoryview(bytearray(RECEIVE_BUFFER_BYTES))
        """Where every connection receives (see :class:`_Connection`)."""
        self.handshake_timeout = float(handshake_timeout)
        self.frame_timeout = float(frame_timeout)
        self.handshake_deadline = min(self.handshake_timeout, self.frame_timeout)
        """Seconds a connection may spend in its handshake."""
        self.idle_timeout = None if idle_timeout is None else float(idle_timeout)
        self.tcp_keepalive = None if tcp_keepalive is None else float(tcp_keepalive)
        self.connection_cap = max_connections
        """The connection cap in force: ``max_connections``, or less when the
        open-file limit does not allow it (set when the server starts)."""
        self.handshake_cap = max_handshakes
        """The cap on connections in their handshake in force (likewise)."""
        self.handshake_grace = handshake_grace(handshake_timeout)
        """Seconds a handshake in progress is safe from a newcomer."""
        self.address_cap = self._address_cap(max_connections, auth_token is not None)
        """The per-address cap in force, or None."""
        self.refused_connections = 0
        """Connections closed at once because a connection cap was reached."""
        self.reclaimed_connections = 0
        """Connections in their handshake closed to make room for a newer one."""
        self.shed_connections = 0
        """Connections closed because incomplete requests passed ``max_buffered_bytes``."""
        self.expired_connections = 0
        """Connections closed for breaking ``frame_timeout``, ``idle_timeout``
        or the handshake deadline."""
        self.accepted_connections = 0
        """Connections given a slot (not refused) since the server started."""
        self.requests = 0
        """Requests parsed since the server started."""
        self._host = host
        self._requested_port = port
        self.secret = auth_token.encode() if isinstance(auth_token, str) else auth_token
        self._ssl_context = ssl_context
        self.engine: StoreEngine[_Connection] = StoreEngine(max_waiting_bytes)
        self.connections: set[_Connection] = set()
        """Connections past the handshake."""
        self.handshaking: dict[_Connection, None] = {}
        """Connections in their handshake, oldest first."""
        self._per_address: dict[str, int] = {}
        self.throttled = _ThrottledLog(LOG_INTERVAL)
        """The log of the warnings a flood of connections could repeat."""
        self._port: int | None = None
        self._bound_host = host or "::"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _address_cap(self, cap: int, has_secret: bool) -> int | None:
        if self.max_connections_per_address is not None:
            return self.max_connections_per_address
        if has_secret:
            return None
        return max(1, cap - cap // 4)

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
        self._thread = start_thread(lambda: self._run(self._main(None)), name="rdzv-store-server")
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
        self._run(self._main(on_ready, install_signals=True))
        if self._error is not None:
            raise self._error

    def waiter_count(self) -> int:
        """Return the number of blocked requests (for tests and monitoring)."""
        return self._call(lambda: self.engine.waiter_count)

    def connection_count(self) -> int:
        """Return the number of open client connections, handshakes included."""
        return self._call(lambda: len(self.connections) + len(self.handshaking))

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

    # -- admission (on the loop's thread) --------------------------------------

    def _refusal(self, address: str) -> str | None:
        """Return why a connection from ``address`` cannot have a slot, or None."""
        if len(self.connections) >= self.connection_cap:
            return (
                f"the server already has {len(self.connections)} connections "
                f"(max_connections={self.connection_cap})"
            )
        cap = self.address_cap
        if cap is not None and self._per_address.get(address, 0) >= cap:
            return f"{address} already has {cap} connections (max_connections_per_address={cap})"
        return None

    def _refuse(self, peer: str, why: str) -> None:
        self.refused_connections += 1
        self.throttled.warning("refused", "store client %s refused: %s", peer, why)

    def admit(self, conn: _Connection) -> bool:
        """Move ``conn``, whose handshake is done, into a connection slot.

        Returns:
            Whether it has a slot; if not, it was counted and logged, and
            must be closed.
        """
        if conn.is_open:
            return True
        self.handshaking.pop(conn, None)
        why = self._refusal(conn.address)
        if why is not None:
            self._refuse(conn.peer, why)
            return False
        conn.is_open = True
        self.connections.add(conn)
        self.accepted_connections += 1
        self._per_address[conn.address] = self._per_address.get(conn.address, 0) + 1
        return True

    def release(self, conn: _Connection) -> None:
        """Give back the slot of a connection that ended (idempotent)."""
        if conn.released:
            return
        conn.released = True
        self.buffered -= conn.buffered
        conn.buffered = 0
        self.handshaking.pop(conn, None)
        if conn.is_open:
            self.connections.discard(conn)
            left = self._per_address[conn.address] - 1
            if left:
                self._per_address[conn.address] = left
            else:
                del self._per_address[conn.address]

    def account(self, conn: _Connection) -> None:
        """Count what ``conn`` buffers now; shed the oldest partial requests past the total."""
        if conn.released:
            return
        held = conn.parser.held + len(conn.inbox)
        if held != conn.buffered:
            self.buffered += held - conn.buffered
            conn.buffered = held
            if self.buffered > self.max_buffered_bytes:
                self._shed()

    def _shed(self) -> None:
        """Close the connections whose incomplete requests started first until under the total."""
        while self.buffered > self.max_buffered_bytes:
            started = [
                conn
                for conn in [*self.handshaking, *self.connections]
                if conn.buffered and conn.frame_started is not None and not conn.stalled
            ]
            if not started:
                return
            oldest = min(started, key=lambda conn: conn.frame_started or 0.0)
            held = oldest.buffered
            self.release(oldest)
            oldest.abort()
            self.shed_connections += 1
            self.throttled.warning(
                "shed",
                "store client %s disconnected: the server held more than %d bytes of "
                "incomplete requests (max_buffered_bytes), and its %d bytes had been "
                "arriving the longest",
                oldest.peer,
                self.max_buffered_bytes,
                held,
            )

    def _accepted(self, sock: socket.socket, address: str, peer: str) -> None:
        """Take in a connection just accepted, or refuse it (close it at once)."""
        why = self._refusal(address)
        if why is not None:
            self._refuse(peer, why)
            sock.close()
            return
        while len(self.handshaking) >= self.handshake_cap:
            oldest = next(iter(self.handshaking))
            if time.monotonic() - oldest.opened_at < self.handshake_grace:
                self._refuse(
                    peer,
                    f"all {self.handshake_cap} handshake slots (max_handshakes) hold handshakes "
                    f"started less than {self.handshake_grace:g} s ago; it may retry",
                )
                sock.close()
                return
            self.release(oldest)
            oldest.abort()
            self.reclaimed_connections += 1
            self.throttled.warning(
                "reclaimed",
                "store client %s disconnected: its handshake was the oldest unfinished one "
                "when %s connected and all %d handshake slots were taken (max_handshakes)",
                oldest.peer,
                peer,
                self.handshake_cap,
            )
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tcp_keepalive is not None:
            enable_keepalive(sock, self.tcp_keepalive)
        conn = _Connection(self, address, peer)
        self.handshaking[conn] = None
        conn.attaching = asyncio.get_running_loop().create_task(self._attach(conn, sock))

    async def _attach(self, conn: _Connection, sock: socket.socket) -> None:
        """Give ``conn`` its transport, after the TLS handshake on a TLS server."""
        loop = asyncio.get_running_loop()
        context = self._ssl_context
        try:
            if context is None:
                await loop.connect_accepted_socket(lambda: conn, sock)
            else:
                await loop.connect_accepted_socket(
                    lambda: conn,
                    sock,
                    ssl=context,
                    ssl_handshake_timeout=self.handshake_deadline,
                )
        except asyncio.CancelledError:
            self.release(conn)
            sock.close()
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            self.release(conn)
            sock.close()
            self.throttled.warning(
                "tls", "store client %s disconnected: TLS handshake failed: %s", conn.peer, exc
            )
        finally:
            conn.attaching = None

    async def _accept(self, listener: socket.socket) -> None:
        """Accept connections until cancelled, backing off when out of files.

        Every accepted connection is taken in or refused (closed) at once,
        which costs a few microseconds, and the loop yields to the
        connections after each. An accept that fails for lack of file
        descriptors or memory waits twice as long as the last one did (up
        to :data:`ACCEPT_BACKOFF`) before the next, and is logged at most
        once per :data:`LOG_INTERVAL`: no busy loop, no flood of log lines.
        """
        loop = asyncio.get_running_loop()
        delay = 0.0
        while True:
            try:
                sock, addr = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno not in _ACCEPT_OUT_OF_RESOURCES:
                    continue  # the peer went away between SYN and accept
                delay = min(ACCEPT_BACKOFF, max(0.01, delay * 2))
                self.throttled.warning(
                    "accept",
                    "store server cannot accept connections (%s); retrying in %.2f s",
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            delay = 0.0
            address = str(addr[0])
            self._accepted(sock, address, f"{address}:{addr[1]}")
            await asyncio.sleep(0)  # accepting must not starve the connections

    def _apply_descriptor_limit(self) -> None:
        """Lower the caps to what the open-file limit leaves room for."""
        room = _descriptor_room()
        wanted = self.max_connections + self.max_handshakes
        if room is None or wanted <= room:
            return
        self.handshake_cap = max(1, min(self.max_handshakes, room // 8))
        self.connection_cap = max(1, min(self.max_connections, room - self.handshake_cap))
        self.address_cap = self._address_cap(self.connection_cap, self.secret is not None)
        _log.warning(
            "store server: max_connections=%d lowered to %d and max_handshakes=%d to %d: "
            "the open-file limit (RLIMIT_NOFILE) leaves room for %d sockets; raise it "
            "(ulimit -n) to serve more clients",
            self.max_connections,
            self.connection_cap,
            self.max_handshakes,
            self.handshake_cap,
            room,
        )

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
            sock.listen(min(listen_backlog(), ACCEPT_BACKLOG))
            sock.setblocking(False)
        except (OSError, ValueError) as exc:
            self._error = exc
            self._ready.set()
            return
        self._apply_descriptor_limit()
        address = sock.getsockname()
        self._bound_host = str(address[0])
        self._port = int(address[1])
        self._loop = loop
        if install_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self._stop.set)
        self._ready.set()
        tasks = [loop.create_task(self._sweep()), loop.create_task(self._accept(sock))]
        try:
            if on_ready is not None:
                on_ready(self)
            await self._stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            sock.close()
            for conn in [*self.handshaking, *self.connections]:
                conn.abort()
            for _ in range(3):
                await asyncio.sleep(0)
            if install_signals:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(signum)
            self._port = None
            self._loop = None

    async def _sweep(self) -> None:
        """Close, periodically, every connection that broke a time limit."""
        limits = [self.frame_timeout, self.handshake_deadline]
        if self.idle_timeout is not None:
            limits.append(self.idle_timeout)
        period = min(1.0, max(0.05, min(limits) / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in [*self.handshaking, *self.connections]:
                reason = conn.expired(now)
                if reason is not None:
                    self.expired_connections += 1
                    if conn.is_open:
                        _log.warning("store client %s disconnected: %s", conn.peer, reason)
                    else:
                        self.throttled.warning(
                            "handshake", "store client %s disconnected: %s", conn.peer, reason
                        )
                    conn.abort()


def _loop_runner(loop: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    """Return what runs the server's main coroutine on the event loop named ``loop``.

    Raises:
        ValueError: ``loop`` is not one of :data:`EVENT_LOOPS`.
        ImportError: ``loop`` is ``"uvloop"`` and uvloop is not installed.
    """
    if loop == "asyncio":
        return asyncio.run
    if loop != "uvloop":
        raise ValueError(f"loop must be one of {', '.join(EVENT_LOOPS)}, got {loop!r}")
    try:
        import uvloop  # noqa: PLC0415 - an optional extra, imported only when asked for
    except ImportError as exc:
        raise ImportError(
            "loop 'uvloop' needs the uvloop package (the rdzv[fast] extra), which is not "
            "installed: pip install uvloop"
        ) from exc
    return uvloop.run


def _descriptor_room() -> int | None:
    """Return how many more sockets the open-file limit allows, keeping headroom.

    Returns:
        The soft ``RLIMIT_NOFILE`` minus the descriptors open now and
        :data:`FD_HEADROOM`; None when there is no limit.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 0
    return max(2, soft - open_now - FD_HEADROOM)
