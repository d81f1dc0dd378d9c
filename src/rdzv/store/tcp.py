"""The TCP store client, :class:`TCPStore`, with torch's constructor shape.

Theory of operation
-------------------
One blocking socket per store, guarded by a lock so that threads take turns
(the protocol allows one request in flight per connection). Each call
encodes its request with the encoder :mod:`rdzv.store.protocol` makes from
the opcode's layout (through :func:`~rdzv.store.protocol.encode_request`,
or, for the frequent requests, straight from their fields), sends it, and
decodes each field of the reply with the protocol's decoder of that field:
from a :class:`~rdzv.store.protocol.ReplyReader`, or from the received
bytes themselves when one ``recv`` brought exactly the reply.

Connecting sends torch's handshake (``VALIDATE`` with the magic, then
``PING``); the ping nonce is :data:`~rdzv.store.protocol.PROBE_NONCE`, which
torch's server echoes and rdzv's server answers with its hello and feature
bits. That is how the client learns, on the same connection and without
upsetting a torch server, whether it may use rdzv's extensions (one-round-trip
``get``, ``watch``, ``try_multi_get``) and whether it must authenticate.
Connecting is retried with capped exponential backoff and jitter until the
store timeout; an authentication or certificate failure is final, and so is
a peer that is not a store: one that answers the handshake with bytes no
store sends, or, on a first connection, stays silent for
:data:`HANDSHAKE_TIMEOUT` (a program holding the port that is not a store).

A caller's deadline (:func:`rdzv.retry.deadline_within`, under which the
dynamic handler and its keep-alive make every call) bounds each read of a
reply and each connection attempt, as it does the etcd and Redis clients:
a reply that has not come by then drops the connection (its stream
position is unknown) and raises
:class:`~rdzv.errors.RendezvousConnectionError`; a ``wait`` it cuts short
is cancelled as below and raises :class:`~rdzv.errors.StoreTimeoutError`.
A call made at or past the deadline still gets
:data:`~rdzv.retry.LAST_ATTEMPT`. Without a deadline the store timeout
alone bounds them, as in torch. The cap moves in steps (:func:`_capped`),
so that a client whose deadline is nearer than its store timeout does not
change the socket option on every call.

A connection that breaks while a request is in flight raises
:class:`~rdzv.errors.RendezvousConnectionError` (the socket is dropped; its
stream position is unknown) and the next call connects again. A ``wait``
that times out follows torch's cancel exchange: send ``CANCEL_WAIT`` and read
up to two bytes, since the server's ``STOP_WAITING`` may have crossed the
cancel on the wire.

Keys follow torch's client: user key ``k`` is ``/k`` on the wire, so rdzv and
torch clients on one server see each other's keys.

Size: longer than the project's ~600-line guide because it carries torch's
whole ``TCPStore`` client API (each call with its documented error
contract) beside rdzv's extensions; the encoding lives in
:mod:`rdzv.store.protocol` and the server in :mod:`rdzv.store.server`.
"""

from __future__ import annotations

import math
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar, overload

from rdzv.errors import (
    RendezvousConnectionError,
    RendezvousStateError,
    StoreAuthenticationError,
    StoreTimeoutError,
)
from rdzv.retry import LAST_ATTEMPT, jitter, time_left
from rdzv.store.base import (
    DEFAULT_STORE_TIMEOUT,
    Store,
    Timeout,
    Value,
    check_multi_set,
    to_bytes,
    to_seconds,
)
from rdzv.store.protocol import (
    AUTH_MAC_BYTES,
    AUTH_NONCE_BYTES,
    CLIENT_AUTH_LABEL,
    FEATURE_AUTH_REQUIRED,
    MAX_KEY_BYTES,
    MAX_MULTI_KEYS,
    MAX_REPLY_ITEMS,
    MAX_VALUE_BYTES,
    PROBE_NONCE,
    SERVER_AUTH_LABEL,
    SERVER_HELLO,
    SERVER_HELLO_MASK,
    VALIDATE_MAGIC,
    AuthStatus,
    CheckResult,
    Decoder,
    GetWaitStatus,
    Op,
    ProtocolError,
    ReplyReader,
    Request,
    WaitResult,
    WatchStatus,
    auth_tag,
    decode_bytes,
    decode_get_wait,
    decode_i64,
    decode_raw,
    decode_u8,
    decode_u32,
    encode_request,
    request_encoder,
)

if TYPE_CHECKING:
    from rdzv.store.server import TCPStoreServer

__all__ = ["TCPStore"]

_T = TypeVar("_T")

_KEY_PREFIX = b"/"
_INIT_KEY = b"init/"
_REPLY_GRACE = 5.0
"""Seconds a reply may take beyond the store timeout."""
# Once connected, a dropped connection is retried for at most this long per
# call (the store timeout still bounds it): the host most likely died, and a
# caller with a deadline must hear so in seconds, not after the read timeout.
RECONNECT_TIMEOUT = 3.0
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a server that accepted a first connection has to answer the
handshake. Both rdzv's and torch's servers answer at once (rdzv's drops a
connection whose handshake lasts longer than this); a peer that stays silent
is not serving a store, so the client says so instead of retrying until its
timeout. A reconnection that meets silence retries as before: that store
answered once and may be stalled."""


class _NotAStoreError(Exception):
    """The peer accepted the connection but does not speak the store protocol."""


_BACKOFF_FIRST = 0.01
_BACKOFF_MAX = 1.0
_CAP_STEP = 0.25
"""The finest step, in seconds, of a caller's deadline's cap on a read (see :func:`_capped`)."""


def _capped(limit: float) -> float:
    """Return ``limit``, or less when the caller's deadline comes sooner (see the module).

    The time left is rounded down to a step of :data:`_CAP_STEP` doubled
    until it is at least a sixteenth of the time left (0.25 s in the last
    4 s, 8 s two minutes ahead), so that a client whose deadline is nearer
    than its store timeout changes its socket option every few calls, not
    on each; never below :data:`~rdzv.retry.LAST_ATTEMPT`, nor above
    ``limit``.
    """
    left = time_left(limit)
    if left >= limit:
        return limit
    step = _CAP_STEP
    while step * 16 < left:
        step *= 2
    return max(LAST_ATTEMPT, math.floor(left / step) * step)


def _timeval(seconds: float) -> bytes:
    """Encode a positive timeout as a ``struct timeval`` (0 would mean "never")."""
    micros = max(1000, math.ceil(seconds * 1_000_000))
    return struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)


def _wire_key(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"store keys must be str, not {type(key).__name__}")
    wire = _KEY_PREFIX + key.encode("utf-8")
    if len(wire) > MAX_KEY_BYTES:
        raise ValueError(
            f"key {key[:40]!r}... is {len(wire)} bytes on the wire; the limit is {MAX_KEY_BYTES}"
        )
    return wire


def _value(value: Value) -> bytes:
    data = value if type(value) is bytes else to_bytes(value)
    if len(data) > MAX_VALUE_BYTES:
        raise ValueError(f"a value of {len(data)} bytes exceeds the limit of {MAX_VALUE_BYTES}")
    return data


# The encoders of the frequent requests, which take their fields without a Request.
_SET = request_encoder(Op.SET)
_ADD = request_encoder(Op.ADD)
_GET_WAIT = request_encoder(Op.GET_WAIT)
_COMPARE_SET = request_encoder(Op.COMPARE_SET)
_TIMED_OUT = int(GetWaitStatus.TIMED_OUT)


def _decode_key(buf: bytes | bytearray, pos: int) -> tuple[bytes, int] | None:
    """Decode a key of a ``LIST_KEYS`` reply (a :data:`~rdzv.store.protocol.Decoder`)."""
    return decode_bytes(buf, pos, MAX_KEY_BYTES)


def _too_large(value: int, what: str) -> ValueError:
    """Return the error of a request's number that fits no ``i64`` (nothing was sent)."""
    return ValueError(f"{what} {value} does not fit a signed 64-bit integer")


def _receive(sock: socket.socket) -> bytes:
    """Return the next bytes from the server (on a socket with ``SO_RCVTIMEO``)."""
    try:
        data = sock.recv(65536)
    except BlockingIOError as exc:
        # SO_RCVTIMEO elapsed on the blocking socket.
        raise TimeoutError("timed out waiting for the server's reply") from exc
    if not data:
        raise EOFError("the server closed the connection")
    return data


class TCPStore(Store):
    """A client of a TCP store server (rdzv's or torch's), optionally hosting one.

    Args:
        host_name: The server's host name or address.
        port: The server's port; with ``is_master``, 0 picks a free port.
        world_size: The number of clients, master included, that will
            connect; with ``wait_for_workers`` the master waits for all.
        is_master: Start a server in a background thread of this process.
        timeout: The timeout of blocking operations and of the first
            connection (the server may start after the client). Once it was
            connected, a dropped connection is retried for at most
            :data:`RECONNECT_TIMEOUT` seconds per call.
        wait_for_workers: With ``world_size``, block in the constructor until
            every client connected (each adds 1 to torch's ``init/`` key).
        multi_tenant: Share one server per port among the masters of this
            process.
        auth_token: The shared secret of an authenticating rdzv server (and
            of the hosted server when ``is_master``).
        ssl_context: A client-side TLS context; connections use TLS when given.
        server_ssl_context: The server-side TLS context of the hosted server
            (``is_master`` only).
        max_connections: The hosted server's limit on open connections
            (``is_master`` only); None keeps the server's default.

    Raises:
        RendezvousConnectionError: The server could not be reached in time.
        StoreAuthenticationError: Authentication failed or was impossible.
        StoreTimeoutError: Not every worker connected within the timeout.
        ValueError: An argument is out of range.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = DEFAULT_STORE_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        *,
        auth_token: str | bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_ssl_context: ssl.SSLContext | None = None,
        max_connections: int | None = None,
    ) -> None:
        super().__init__(timeout)
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if port == 0 and not is_master:
            raise ValueError("port 0 is only valid with is_master=True")
        if world_size is not None and world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if auth_token is not None and not auth_token:
            raise ValueError("auth_token must not be empty")
        self._host = host_name
        self._secret = auth_token.encode() if isinstance(auth_token, str) else auth_token
        self._ssl_context = ssl_context
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._was_connected = False
        self._recv_timeout: float | None = None
        self._reply_timeout = self.timeout.total_seconds() + _REPLY_GRACE
        self._reader = ReplyReader()
        self._rdzv_server: bool | None = None
        self._closed = False
        self._multi_tenant = multi_tenant
        self._server: TCPStoreServer | None = None
        if is_master:
            from rdzv.store.serve import ServerSecurity, hosted_server  # noqa: PLC0415 - hosts only

            secure = ServerSecurity(self._secret, server_ssl_context)
            self._server = hosted_server(port, multi_tenant, secure, max_connections)
            port = self._server.port
        self._port = port
        try:
            with self._lock:
                self._ensure_connected()
            if world_size is not None and wait_for_workers:
                self._join_workers(world_size, is_master)
        except BaseException:
            self.close()
            raise

    # -- properties ----------------------------------------------------------

    @property
    def host(self) -> str:
        """The server's host name, as given."""
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the one picked when constructed with port 0)."""
        return self._port

    @property
    def server(self) -> TCPStoreServer | None:
        """The server this store hosts (``is_master=True``), else None."""
        return self._server

    def set_timeout(self, timeout: Timeout) -> None:  # noqa: D102 - documented on Store
        super().set_timeout(timeout)
        self._reply_timeout = self.timeout.total_seconds() + _REPLY_GRACE

    @property
    def supports_watch(self) -> bool:
        """True when the server is an rdzv server, which implements ``watch``."""
        with self._lock:
            if self._rdzv_server is None:
                self._call(lambda: None)
            return bool(self._rdzv_server)

    def clone(self) -> TCPStore:
        """Return a new client of the same server, with its own connection.

        Blocking calls (``get``, ``wait``, ``watch``, ...) hold this client's
        connection until they return; a thread that must not wait behind
        them uses a clone.

        Returns:
            A connected client with the same timeout, secret and TLS context
            (it never hosts a server).
        """
        return TCPStore(
            self._host,
            self._port,
            timeout=self.timeout,
            auth_token=self._secret,
            ssl_context=self._ssl_context,
        )

    # -- connection management -----------------------------------------------

    def _connect_once(self, remaining: float) -> socket.socket:
        sock = socket.create_connection((self._host, self._port), timeout=remaining)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl_context is not None:
                sock = self._ssl_context.wrap_socket(sock, server_hostname=self._host)
            self._sock = sock
            self._reader.clear()
            self._recv_timeout = None
            if self._ssl_context is None:
                # Blocking mode with kernel timeouts: Python's own socket
                # timeout polls before every send and recv, doubling the
                # system calls of a round trip.
                sock.settimeout(None)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(remaining))
            self._set_recv_timeout(remaining)
            self._handshake(min(remaining, HANDSHAKE_TIMEOUT))
        except BaseException:
            self._sock = None
            sock.close()
            raise
        return sock

    def _handshake(self, timeout: float) -> None:
        self._send(Request(Op.VALIDATE, number=VALIDATE_MAGIC))
        self._send(Request(Op.PING, number=PROBE_NONCE))
        try:
            hello = self._read(decode_u32, timeout)
        except TimeoutError:
            if self._was_connected:
                raise  # a store that answered before: stalled, maybe back soon
            raise _NotAStoreError(
                f"{self._address} accepted the connection but sent no reply to the store "
                f"handshake within {timeout:g} s"
            ) from None
        if hello == PROBE_NONCE:
            self._rdzv_server = False
            if self._secret is not None:
                raise StoreAuthenticationError(
                    f"authentication impossible: the store at {self._address} is not an rdzv "
                    "server (torch's server cannot authenticate); drop auth_token"
                )
        elif hello & SERVER_HELLO_MASK == SERVER_HELLO:
            self._rdzv_server = True
            self._authenticate(bool(hello & FEATURE_AUTH_REQUIRED))
        else:
            raise _NotAStoreError(
                f"{self._address} answered the store handshake with {hello:#010x}, "
                "which no TCP store sends"
            )

    def _authenticate(self, required: bool) -> None:
        if not required:
            if self._secret is not None:
                raise StoreAuthenticationError(
                    f"authentication failed: the store at {self._address} does not require "
                    "authentication, so it cannot prove it knows auth_token"
                )
            return
        if self._secret is None:
            raise StoreAuthenticationError(
                f"authentication required: the store at {self._address} needs a shared "
                "secret; pass auth_token"
            )
        self._send(Request(Op.AUTH_CHALLENGE))
        server_nonce = self._read(decode_raw(AUTH_NONCE_BYTES))
        client_nonce = os.urandom(AUTH_NONCE_BYTES)
        tag = auth_tag(self._secret, CLIENT_AUTH_LABEL, server_nonce, client_nonce)
        self._send(Request(Op.AUTH_RESPONSE, values=(client_nonce, tag)))
        # A refusal is a REFUSED byte before a clean close; a connection cut
        # here (a handshake the server reclaimed) is connection trouble, and
        # retried, not a refused secret.
        status = self._read(decode_u8)
        if status != AuthStatus.OK:
            raise StoreAuthenticationError(
                f"authentication failed: the store at {self._address} refused auth_token"
            )
        proof = self._read(decode_raw(AUTH_MAC_BYTES))
        expected = auth_tag(self._secret, SERVER_AUTH_LABEL, server_nonce, client_nonce)
        if proof != expected:
            raise StoreAuthenticationError(
                f"authentication failed: the store at {self._address} does not know auth_token"
            )

    @property
    def _address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    def _ensure_connected(self) -> socket.socket:
        if self._closed:
            raise RendezvousConnectionError(f"the store client of {self._address} is closed")
        if self._sock is not None:
            return self._sock
        budget = self.timeout.total_seconds()
        if self._was_connected:
            budget = min(budget, RECONNECT_TIMEOUT)
        budget = _capped(budget)
        deadline = time.monotonic() + budget
        backoff = _BACKOFF_FIRST
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = self._connect_once(max(remaining, 0.001))
                self._was_connected = True
                return sock
            except _NotAStoreError as exc:
                raise RendezvousConnectionError(str(exc)) from None
            except (StoreAuthenticationError, ssl.SSLCertVerificationError) as exc:
                if isinstance(exc, ssl.SSLCertVerificationError):
                    raise RendezvousConnectionError(
                        f"TLS certificate of the store at {self._address} did not verify: {exc}"
                    ) from exc
                raise
            except (OSError, ProtocolError, EOFError) as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RendezvousConnectionError(
                        f"could not connect to the store at {self._address} within "
                        f"{budget:g} s: {exc}"
                    ) from exc
                pause = min(remaining, jitter(backoff / 2, backoff))
                time.sleep(pause)
                backoff = min(backoff * 2, _BACKOFF_MAX)

    def _drop_connection(self) -> None:
        sock, self._sock = self._sock, None
        self._reader.clear()
        if sock is not None:
            sock.close()

    def _broken(self, exc: BaseException) -> RendezvousConnectionError:
        """Drop the connection that failed with ``exc``; return the error to raise."""
        self._drop_connection()
        return RendezvousConnectionError(
            f"the connection to the store at {self._address} failed: {exc}"
        )

    def _call(self, operation: Callable[[], _T]) -> _T:
        """Run ``operation`` on a connected socket, translating transport errors."""
        with self._lock:
            self._ensure_connected()
            try:
                return operation()
            except (OSError, EOFError, ProtocolError) as exc:
                raise self._broken(exc) from exc
            except (StoreTimeoutError, NotImplementedError):
                raise  # answered cleanly: the connection is still in step
            except BaseException:
                self._drop_connection()
                raise

    @overload
    def _exchange(self, frame: bytes) -> None: ...

    @overload
    def _exchange(self, frame: bytes, decode: Decoder[_T]) -> _T: ...

    def _exchange(self, frame: bytes, decode: Decoder[_T] | None = None) -> _T | None:
        """Send one encoded request and return its reply (None: a request without one).

        :meth:`_call` of a ``sendall`` and a read, written out for the
        frequent requests: the whole call is a few microseconds of Python,
        so each call saved is a measurable share of it. When nothing is
        buffered and the socket's timeout is the default (as capped by a
        caller's deadline, :func:`_capped`), one ``recv`` usually brings
        exactly the reply, which ``decode`` decodes in place; anything else
        (part of a reply, more than one) is read from the buffer as
        :meth:`_read_value` does. Without ``decode`` (``set``, ``append``...),
        nothing is read.
        """
        with self._lock:
            sock = self._sock
            if sock is None:
                sock = self._ensure_connected()
            try:
                sock.sendall(frame)
                if decode is None:
                    return None
                if self._recv_timeout == _capped(self._reply_timeout) and not self._reader.pending:
                    data = _receive(sock)
                    try:
                        found = decode(data, 0)
                    except ProtocolError as exc:
                        raise self._wrong_value(exc) from exc
                    if found is not None and found[1] == len(data):
                        return found[0]
                    self._reader.feed(data)
                return self._read_value(decode)
            except (OSError, EOFError, ProtocolError) as exc:
                raise self._broken(exc) from exc
            except BaseException:
                self._drop_connection()
                raise

    def _send(self, request: Request) -> None:
        assert self._sock is not None
        self._sock.sendall(encode_request(request))

    def _set_recv_timeout(self, seconds: float) -> None:
        if seconds == self._recv_timeout:
            return
        sock = self._sock
        assert sock is not None
        if self._ssl_context is None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        else:
            sock.settimeout(seconds)
        self._recv_timeout = seconds

    def _read(self, decode: Decoder[_T], timeout: float | None = None) -> _T:
        value = self._reader.read(decode)
        if value is not None:
            return value
        sock = self._sock
        assert sock is not None
        if timeout is None:
            # One default for every reply, including GET_WAIT's (answered by
            # the server within the store timeout), so that the common path
            # never changes the socket option.
            timeout = self._reply_timeout
        self._set_recv_timeout(_capped(timeout))
        while True:
            self._reader.feed(_receive(sock))
            value = self._reader.read(decode)
            if value is not None:
                return value

    def _read_value(self, decode: Decoder[_T], timeout: float | None = None) -> _T:
        """:meth:`_read` a reply holding a value, whose length over the limit is no broken connection."""
        try:
            return self._read(decode, timeout)
        except ProtocolError as exc:
            raise self._wrong_value(exc) from exc

    def _wrong_value(self, exc: ProtocolError) -> RendezvousStateError:
        """Drop the connection that announced a value over the limit; return the error to raise.

        What the server serves is wrong, not the connection: retrying reads it again.
        """
        self._drop_connection()
        return RendezvousStateError(f"the store at {self._address} sent {exc}")

    def close(self) -> None:
        """Close the connection and stop the hosted server, if any (idempotent)."""
        with self._lock:
            self._closed = True
            self._drop_connection()
            server, self._server = self._server, None
        if server is not None:
            from rdzv.store.serve import release_server  # noqa: PLC0415 - loaded by hosting

            release_server(server, self._multi_tenant)

    def _join_workers(self, world_size: int, is_master: bool) -> None:
        self._add_wire(_INIT_KEY, 1)
        if not is_master:
            return
        budget = self.timeout.total_seconds()
        deadline = time.monotonic() + budget
        pause = _BACKOFF_FIRST
        while (joined := self._add_wire(_INIT_KEY, 0)) < world_size:
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(
                    f"only {joined} of {world_size} workers connected to the store at "
                    f"{self._address} within {budget:g} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    # -- encoding helpers ----------------------------------------------------

    def _wire_keys(self, keys: Sequence[str]) -> tuple[bytes, ...]:
        if isinstance(keys, str):
            raise TypeError("keys must be a sequence of str, not a single str")
        if len(keys) > MAX_MULTI_KEYS:
            raise ValueError(f"{len(keys)} keys exceeds the limit of {MAX_MULTI_KEYS} per request")
        return tuple(_wire_key(k) for k in keys)

    def _seconds(self, timeout: Timeout | None) -> float:
        return self.timeout.total_seconds() if timeout is None else to_seconds(timeout)

    @staticmethod
    def _ms(seconds: float) -> int:
        return math.ceil(seconds * 1000)

    # -- raw operations (lock held, socket connected) ------------------------

    def _wait_raw(self, request: Request, seconds: float, what: str) -> None:
        """Send a WAIT or BARRIER and read its answer, cancelling on timeout."""
        self._send(request)
        seconds = _capped(max(seconds, 0.0001))
        try:
            answer = self._read(decode_u8, seconds)
        except TimeoutError:
            self._send(Request(Op.CANCEL_WAIT))
            answer = self._read(decode_u8)
            if answer == WaitResult.STOP_WAITING:
                # The server answered before it saw the cancel: done after all.
                if self._read(decode_u8) != WaitResult.WAIT_CANCELED:
                    raise ProtocolError("expected WAIT_CANCELED after STOP_WAITING") from None
                return
            if answer != WaitResult.WAIT_CANCELED:
                raise ProtocolError(f"unexpected reply {answer} to CANCEL_WAIT") from None
            raise StoreTimeoutError(f"timed out after {seconds:g} s waiting for {what}") from None
        if answer != WaitResult.STOP_WAITING:
            raise ProtocolError(f"unexpected reply {answer} to {Op(request.op).name}")

    # -- the Store API -------------------------------------------------------

    def set(self, key: str, value: Value) -> None:  # noqa: D102 - documented on Store
        wire = _wire_key(key)
        data = _value(value)
        self._exchange(_SET(wire, data))

    def get(self, key: str) -> bytes:  # noqa: D102
        wire = _wire_key(key)
        seconds = self.timeout.total_seconds()

        if self._rdzv_server:
            try:
                frame = _GET_WAIT(wire, self._ms(seconds))
            except struct.error:
                raise _too_large(self._ms(seconds), "the timeout in ms") from None
            status, value = self._exchange(frame, decode_get_wait)
            if status == _TIMED_OUT:
                raise StoreTimeoutError(f"timed out after {seconds:g} s waiting for key {key!r}")
            return value

        def get() -> bytes:
            self._wait_raw(Request(Op.WAIT, (wire,)), seconds, f"key {key!r}")
            self._send(Request(Op.GET, (wire,)))
            return self._read_value(decode_bytes)

        return self._call(get)

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        return self._add_wire(_wire_key(key), int(amount))

    def _add_wire(self, wire: bytes, amount: int) -> int:
        """``add`` of a key already in its wire form (``init/`` has no ``/`` prefix)."""
        try:
            frame = _ADD(wire, amount)
        except struct.error:
            raise _too_large(amount, "the amount to add") from None
        return self._exchange(frame, decode_i64)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:  # noqa: D102
        frame = _COMPARE_SET(_wire_key(key), _value(expected), _value(desired))
        return self._exchange(frame, decode_bytes)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:  # noqa: D102
        wire = self._wire_keys(keys)
        seconds = self._seconds(timeout)
        self._call(lambda: self._wait_raw(Request(Op.WAIT, wire), seconds, f"keys {list(keys)!r}"))

    def barrier(self, key: str, world_size: int, timeout: Timeout | None = None) -> None:
        """Block until ``world_size`` callers reached the barrier named ``key``.

        Args:
            key: The barrier's name; its value counts the arrivals.
            world_size: How many callers to wait for.
            timeout: Overrides the store timeout for this call.

        Raises:
            StoreTimeoutError: Fewer callers arrived within the timeout.
            ValueError: ``world_size`` is below 1 or beyond a signed 64-bit
                integer (nothing is sent).
        """
        world_size = int(world_size)
        if not 1 <= world_size < 1 << 63:
            raise ValueError(f"barrier world_size must be in 1..2**63-1, got {world_size}")
        request = Request(Op.BARRIER, (_wire_key(key),), (), world_size)
        seconds = self._seconds(timeout)
        self._call(lambda: self._wait_raw(request, seconds, f"barrier {key!r}"))

    def check(self, keys: Sequence[str]) -> bool:  # noqa: D102
        request = encode_request(Request(Op.CHECK, self._wire_keys(keys)))
        return self._exchange(request, decode_u8) == CheckResult.READY

    def delete_key(self, key: str) -> bool:  # noqa: D102
        request = encode_request(Request(Op.DELETE_KEY, (_wire_key(key),)))
        return self._exchange(request, decode_i64) > 0

    def num_keys(self) -> int:
        """Return the number of keys on the server (torch's ``init/`` key included)."""
        return self._exchange(encode_request(Request(Op.GETNUMKEYS)), decode_i64)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # noqa: D102
        wire = self._wire_keys(keys)
        seconds = self.timeout.total_seconds()

        def multi_get() -> list[bytes]:
            self._wait_raw(Request(Op.WAIT, wire), seconds, f"keys {list(keys)!r}")
            self._send(Request(Op.MULTI_GET, wire))
            return [self._read_value(decode_bytes) for _ in wire]

        return self._call(multi_get)

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:  # noqa: D102
        check_multi_set(keys, values)
        request = Request(Op.MULTI_SET, self._wire_keys(keys), tuple(map(_value, values)))
        self._call(lambda: self._send(request))

    def append(self, key: str, value: Value) -> None:  # noqa: D102
        self._exchange(encode_request(Request(Op.APPEND, (_wire_key(key),), (_value(value),))))

    def list_keys(self) -> list[str]:
        """Return every user key on the server (keys outside torch's ``/`` namespace are left out)."""

        def list_keys() -> list[str]:
            self._send(Request(Op.LIST_KEYS))
            count = self._read(decode_i64)
            if not 0 <= count <= MAX_REPLY_ITEMS:
                raise ProtocolError(f"LIST_KEYS announced {count} keys")
            raw = [self._read(_decode_key) for _ in range(count)]
            return [
                k[len(_KEY_PREFIX) :].decode("utf-8", "replace")
                for k in raw
                if k.startswith(_KEY_PREFIX)
            ]

        return self._call(list_keys)

    def queue_push(self, key: str, value: Value) -> None:  # noqa: D102
        self._exchange(encode_request(Request(Op.QUEUE_PUSH, (_wire_key(key),), (_value(value),))))

    def queue_pop(self, key: str, block: bool = True) -> bytes:  # noqa: D102
        wire = _wire_key(key)
        seconds = self.timeout.total_seconds()
        deadline = time.monotonic() + seconds

        def queue_pop() -> bytes:
            while True:
                if block:
                    remaining = max(deadline - time.monotonic(), 0.0)
                    self._wait_raw(Request(Op.WAIT, (wire,)), remaining, f"queue {key!r}")
                self._send(Request(Op.QUEUE_POP, (wire,)))
                if self._read(decode_i64) > 0:
                    return self._read_value(decode_bytes)
                if not block or time.monotonic() >= deadline:
                    raise StoreTimeoutError(f"queue {key!r} is empty")

        return self._call(queue_pop)

    def queue_len(self, key: str) -> int:  # noqa: D102
        return self._exchange(encode_request(Request(Op.QUEUE_LEN, (_wire_key(key),))), decode_i64)

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:
        """Block until the value of ``key`` differs from ``previous`` (rdzv servers only).

        Args:
            key: The key.
            previous: The value the caller last saw; None means "absent".
            timeout: How long to wait.

        Returns:
            The new value (None if the key is absent), or ``previous`` if it
            did not change within the timeout.

        Raises:
            NotImplementedError: The server is torch's, which cannot watch.
        """
        wire = _wire_key(key)
        seconds = to_seconds(timeout)
        values = () if previous is None else (_value(previous),)
        request = Request(Op.WATCH, (wire,), values, self._ms(seconds))

        def watch() -> bytes | None:
            if not self._rdzv_server:
                raise NotImplementedError(
                    f"the store at {self._address} is not an rdzv server and cannot watch"
                )
            self._send(request)
            # The server ends the wait at its timeout; its reply may then
            # take as long as any reply may, on top of it.
            status = self._read(decode_u8, seconds + self._reply_timeout)
            if status == WatchStatus.PRESENT:
                return self._read_value(decode_bytes)
            if status == WatchStatus.ABSENT:
                return None
            if status == WatchStatus.UNCHANGED:
                return previous
            raise ProtocolError(f"unexpected WATCH status {status}")

        return self._call(watch)

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Return the values of several keys without waiting; None for a missing key.

        One round trip on an rdzv server; on torch's server, the portable
        :meth:`Store.try_multi_get`.

        Args:
            keys: The keys.

        Returns:
            The values, in the order of ``keys``.
        """
        wire = self._wire_keys(keys)

        def try_multi_get() -> list[bytes | None] | None:
            if not self._rdzv_server:
                return None
            self._send(Request(Op.MULTI_TRY_GET, wire))
            return [self._read_value(decode_bytes) if self._read(decode_u8) else None for _ in wire]

        with self._lock:
            found = self._call(try_multi_get)
            if found is not None:
                return found
            return super().try_multi_get(keys)

    def __repr__(self) -> str:
        kind = {None: "unknown", True: "rdzv", False: "torch"}[self._rdzv_server]
        return f"TCPStore({self._address}, server={kind})"
