"""One connection of the TCP store server: an asyncio protocol, its dispatch and handshake.

Each accepted socket becomes a :class:`Connection` at once (before any TLS
handshake, so handshakes in progress are counted), which owns a
:class:`~rdzv.store.protocol.RequestParser`. ``data_received`` feeds it and
executes the complete requests, joining the replies of a burst into one
write. A connection hands each store request to the server's
:class:`~rdzv.store.engine.StoreEngine` and writes the replies it returns,
to the sender and to the connections whose blocked requests the request
answered. It sees of its server only a :class:`Host`, which the server
builds once: the engine, the :class:`Slots` it takes and gives back (the
server's admission), the :class:`ConnectionLimits`, the log and the
receive buffer.

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

Work per turn. A turn parses at most :data:`FEED_SLICE` received bytes (a
large read waits in the connection's inbox for later turns) and executes at
most :data:`REQUESTS_PER_TURN` requests; once the connection's unsent
replies pass ``max_unsent_bytes`` it executes nothing more, and reads
nothing, until the peer has read; the engine refuses a reply past its own
bound.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Protocol, cast

from rdzv.store.engine import BLOCKING_OPS, StoreEngine, Woken
from rdzv.store.protocol import (
    CLIENT_AUTH_LABEL,
    FEATURE_AUTH_REQUIRED,
    MAX_WILL_BYTES,
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
from rdzv.store.throttle import ThrottledLog

__all__ = [
    "FEED_SLICE",
    "RECEIVE_BUFFER_BYTES",
    "REQUESTS_PER_TURN",
    "Connection",
    "ConnectionLimits",
    "Host",
    "Slots",
]

RECEIVE_BUFFER_BYTES: Final = 256 * 1024
"""The most one read takes from a connection (asyncio's own read size)."""
REQUESTS_PER_TURN: Final = 1024
"""Requests of one connection executed before the others get their turn: a
few milliseconds of cheap requests, so that a client pipelining ``set`` s
costs few turns of the loop while the others still get theirs."""
FEED_SLICE: Final = 16 * 1024
"""Received bytes of one connection parsed before the others get their turn:
ordinary requests are parsed in the turn that read them, and a request of
many keys (a key costs a microsecond or so to decode, whatever its size)
is parsed a few milliseconds per turn; a larger read waits in the inbox."""


@dataclass(frozen=True)
class ConnectionLimits:
    """The server's limits and secret, as its connections apply them."""

    max_unsent_bytes: int
    """Replies a connection may leave unread before its requests wait."""
    handshake_deadline: float
    """Seconds a connection may spend in its handshake."""
    frame_timeout: float
    """Seconds a started request may take to arrive, and replies may stay unread."""
    idle_timeout: float | None
    """Seconds a connection with nothing pending may stay open; None: forever."""
    secret: bytes | None
    """The shared secret clients must prove they know, or None."""


class Slots(Protocol):
    """The connection slots a connection takes and gives back (the server's admission)."""

    def admit(self, conn: Connection, /) -> bool:
        """Give ``conn``, whose handshake is done, a slot; return whether it has one."""

    def release(self, conn: Connection, /) -> None:
        """Give back the slot of ``conn``, which ended."""

    def account(self, conn: Connection, /) -> None:
        """Count what ``conn`` buffers now."""


@dataclass
class Host:
    """What a connection uses of its server, and nothing more; one per server."""

    engine: StoreEngine[Connection]
    slots: Slots
    limits: ConnectionLimits
    throttled: ThrottledLog
    """The server's warnings, the kinds a flood can repeat throttled."""
    receive_buffer: memoryview
    """Where every connection receives (see :class:`Connection`)."""
    requests: int = 0
    """Requests parsed by every connection since the server started."""


class _Disconnect(Exception):  # noqa: N818 - control flow, not an error report
    """Raised by a handler to send a last reply and close the connection."""

    def __init__(self, reason: str, last_reply: bytes, *, logged: bool = False) -> None:
        super().__init__(reason)
        self.last_reply = last_reply
        self.logged = logged
        """Whether the reason was logged already (the server throttles some)."""


_Handler = Callable[["Connection", Request], "bytes | None"]
_StoreHandler = Callable[["Connection", Request], "tuple[bytes | None, Woken[Connection]]"]
_NO_HANDLERS: Mapping[int, _StoreHandler] = MappingProxyType({})


class Connection(asyncio.BufferedProtocol):
    """One client connection, from its accept to its close.

    It receives into the server's one receive buffer (the loop runs one
    callback at a time, and the bytes are copied out at once), so a read
    allocates nothing: a plain protocol gets a new 256 KiB ``bytes`` per
    read from asyncio, which glibc may serve with ``mmap``, an expensive
    allocation repeated for every read.
    """

    def __init__(self, host: Host, address: str, peer: str) -> None:
        self.host = host
        self.engine = host.engine
        self.slots = host.slots
        self.limits = host.limits
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
        self.will: tuple[bytes, bytes] | None = None
        """The key and value set when this connection closes (``WILL``)."""
        self.requests = 0
        """Requests parsed from this connection."""
        self.requests_at_open = 0
        """:attr:`requests` when the handshake was done."""
        self.admitted_at = 0.0
        """When the handshake was done (``time.monotonic()``)."""

    @property
    def used(self) -> bool:
        """Whether a request arrived since the handshake was done."""
        return self.requests > self.requests_at_open

    def _on_count(self, op: Op, count: int) -> None:
        """Count a ``WAIT`` against the waiting budget before its keys arrive."""
        if op == Op.WAIT:
            self.engine.reserve_wait(self, count)

    # -- asyncio callbacks -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an asyncio.Transport subclass
        # (uvloop's implement the interface without deriving from it).
        self.transport = cast("asyncio.Transport", transport)
        budget = self.limits.max_unsent_bytes
        self.transport.set_write_buffer_limits(high=budget, low=budget // 4)

    def connection_lost(self, exc: Exception | None) -> None:
        self.engine.drop(self)
        self._stop_waiting()
        will, self.will = self.will, None
        if will is not None:
            for conn, answer in self.engine.set_many((will,)):
                conn.answer(answer)
        if self.parser.pending and self.is_open:
            self.host.throttled.warning(
                "partial",
                "store client %s disconnected in the middle of a request (%d bytes unparsed)",
                self.peer,
                self.parser.pending,
            )
        self.slots.release(self)
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
        return self.host.receive_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self.host.receive_buffer[:nbytes])

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
        self.slots.account(self)

    # -- serving -----------------------------------------------------------

    def _serve(self, now: float) -> None:
        """Execute buffered requests until none is complete or this turn is spent (see the module).

        A spent turn resumes once the peer read (``resume_writing``) or, when
        the kernel took the replies at once, once the loop served the others.
        """
        parser = self.parser
        transport = self.transport
        if transport is None:
            return
        inbox = self.inbox
        if inbox:
            parser.feed(inbox[:FEED_SLICE])
            del inbox[:FEED_SLICE]
        budget = self.limits.max_unsent_bytes - transport.get_write_buffer_size()
        replies: list[bytes] = []
        size = 0
        turn = REQUESTS_PER_TURN
        try:
            while True:
                if sets := parser.next_sets(turn):
                    self.frame_started = now
                    self.requests += len(sets)
                    self.host.requests += len(sets)
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
                self.requests += 1
                self.host.requests += 1
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
        self.slots.account(self)
        if not self.stalled and self.write_blocked_since is None and self.transport is not None:
            self.transport.resume_reading()

    # -- helpers -----------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.last_activity = time.monotonic()
            self.transport.write(data)

    def expired(self, now: float) -> str | None:
        """Return why this connection broke a time limit, or None if it did not."""
        limits = self.limits
        if not self.is_open:
            if now - self.opened_at > limits.handshake_deadline:
                return f"the handshake was not completed within {limits.handshake_deadline:g} s"
            return None
        started = self.frame_started
        if not self.stalled and started is not None and now - started > limits.frame_timeout:
            return (
                f"a request was still incomplete after {limits.frame_timeout:g} s "
                f"(frame_timeout; {self.parser.pending} bytes buffered)"
            )
        blocked = self.write_blocked_since
        if blocked is not None and now - blocked > limits.frame_timeout:
            return (
                f"it did not read its replies for {limits.frame_timeout:g} s "
                f"(frame_timeout; {self.transport.get_write_buffer_size() if self.transport else 0}"
                " bytes unsent)"
            )
        idle = limits.idle_timeout
        held = self.waiting or self.will is not None
        if idle is not None and not held and now - self.last_activity > idle:
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
        """Close at once, whatever stage the connection is in; what it received is dropped now."""
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
        self.host.throttled.warning(None if self.is_open else kind, message, self.peer, *args)

    # -- handshake and authentication --------------------------------------

    def h_validate(self, request: Request) -> bytes | None:
        if request.number != VALIDATE_MAGIC:
            raise ProtocolError(f"bad VALIDATE magic {request.number:#x}")
        if self.is_open:
            return None
        if self.limits.secret is not None:
            self.table = _BEFORE_AUTH
            self.parser.allowed = _BEFORE_AUTH
        else:
            self._open()
        return None

    def h_ping(self, request: Request) -> bytes | None:
        if request.number == PROBE_NONCE:
            features = FEATURE_AUTH_REQUIRED if self.limits.secret is not None else 0
            return encode_u32(SERVER_HELLO | features)
        return encode_u32(request.number)

    def h_auth_challenge(self, _request: Request) -> bytes | None:
        if self.limits.secret is None:
            raise ProtocolError("authentication is not enabled on this server")
        self.server_nonce = os.urandom(32)
        return self.server_nonce

    def h_auth_response(self, request: Request) -> bytes | None:
        secret = self.limits.secret
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

    def h_will(self, request: Request) -> bytes | None:
        """Hold (or, with an empty key, withdraw) what is set when this connection closes."""
        key, value = request.keys[0], request.values[0]
        if len(value) > MAX_WILL_BYTES:
            raise ProtocolError(
                f"a will of {len(value)} bytes exceeds the limit of {MAX_WILL_BYTES} bytes"
            )
        self.will = (key, value) if key else None
        return b"\x00"

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
        self.requests_at_open = self.requests
        if not self.slots.admit(self):
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


_BEFORE_VALIDATE: dict[int, _Handler] = {Op.VALIDATE: Connection.h_validate}
_WHILE_WAITING: dict[int, _Handler] = {Op.CANCEL_WAIT: Connection.h_cancel_wait}
_BEFORE_AUTH: dict[int, _Handler] = {
    Op.PING: Connection.h_ping,
    Op.AUTH_CHALLENGE: Connection.h_auth_challenge,
    Op.AUTH_RESPONSE: Connection.h_auth_response,
}
_FULL: dict[int, _Handler] = {
    Op.VALIDATE: Connection.h_validate,
    Op.PING: Connection.h_ping,
    Op.WILL: Connection.h_will,
}
# Dict lookups hash ints faster than IntEnum members: key the tables by int.
for _table in (_BEFORE_VALIDATE, _WHILE_WAITING, _BEFORE_AUTH, _FULL):
    for _op in list(_table):
        _table[int(_op)] = _table.pop(_op)
