"""One connection of the TCP store client: connecting, the handshake, and each exchange.

Theory of operation
-------------------
A :class:`StoreLink` holds one blocking socket, guarded by a lock so that
threads take turns (the protocol allows one request in flight per
connection), and the :class:`~rdzv.store.protocol.ReplyReader` of its
replies.

Connecting sends torch's handshake (``VALIDATE`` with the magic, then
``PING``); the ping nonce is :data:`~rdzv.store.protocol.PROBE_NONCE`, which
torch's server echoes and rdzv's server answers with its hello and feature
bits. That is how the client learns, on the same connection and without
upsetting a torch server, whether it may use rdzv's extensions (one-round-trip
``get``, ``watch``, ``try_multi_get``) and whether it must authenticate.
Connecting is retried with capped exponential backoff and jitter until the
store timeout, on the caller's clock (:class:`rdzv.retry.Retry`); an authentication or certificate failure is final, and so is
a peer that is not a store: one that answers the handshake with bytes no
store sends, or, on a first connection, stays silent for
:data:`HANDSHAKE_TIMEOUT` (a program holding the port that is not a store).

A caller's deadline (:func:`rdzv.retry.deadline_within`, under which the
dynamic handler and its keep-alive make every call) bounds each read of a
reply and each connection attempt, as it does the etcd and Redis clients:
a reply that has not come by then drops the connection (its stream
position is unknown) and raises
:class:`~rdzv.errors.RendezvousConnectionError`. A call made at or past the
deadline still gets :data:`~rdzv.retry.LAST_ATTEMPT`. Without a deadline the
store timeout alone bounds them, as in torch. The cap moves in steps
(:func:`capped`), so that a client whose deadline is nearer than its store
timeout does not change the socket option on every call.

A connection that breaks while a request is in flight raises
:class:`~rdzv.errors.RendezvousConnectionError` (the socket is dropped; its
stream position is unknown) and the next call connects again.
"""

from __future__ import annotations

import math
import os
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import TypeVar, overload

from rdzv.errors import (
    RendezvousConnectionError,
    RendezvousStateError,
    StoreAuthenticationError,
    StoreTimeoutError,
)
from rdzv.retry import LAST_ATTEMPT, Retry, time_left
from rdzv.store.protocol import (
    AUTH_MAC_BYTES,
    AUTH_NONCE_BYTES,
    CLIENT_AUTH_LABEL,
    FEATURE_AUTH_REQUIRED,
    PROBE_NONCE,
    SERVER_AUTH_LABEL,
    SERVER_HELLO,
    SERVER_HELLO_MASK,
    VALIDATE_MAGIC,
    AuthStatus,
    Decoder,
    Op,
    ProtocolError,
    ReplyReader,
    Request,
    auth_tag,
    decode_raw,
    decode_u8,
    decode_u32,
    encode_request,
)

__all__ = ["HANDSHAKE_TIMEOUT", "RECONNECT_TIMEOUT", "StoreLink", "capped"]

_T = TypeVar("_T")

_REPLY_GRACE = 5.0
"""Seconds a reply may take beyond the store timeout."""
RECONNECT_TIMEOUT = 3.0
"""Seconds a call retries a dropped connection, once it was connected (the
store timeout still bounds it): the host most likely died, and a caller with
a deadline must hear so in seconds, not after the read timeout."""
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a server that accepted a first connection has to answer the
handshake. Both rdzv's and torch's servers answer at once (rdzv's drops a
connection whose handshake lasts longer than this); a peer that stays silent
is not serving a store, so the client says so instead of retrying until its
timeout. A reconnection that meets silence retries as before: that store
answered once and may be stalled."""
_BACKOFF_FIRST = 0.01
_BACKOFF_MAX = 1.0
_CAP_STEP = 0.25
"""The finest step, in seconds, of a caller's deadline's cap on a read (see :func:`capped`)."""


class _NotAStoreError(Exception):
    """The peer accepted the connection but does not speak the store protocol."""


def capped(limit: float) -> float:
    """Return ``limit``, or less when the caller's deadline comes sooner (see the module).

    The time left is rounded down to a step of :data:`_CAP_STEP` doubled
    until it is at least a sixteenth of the time left (0.25 s in the last
    4 s, 8 s two minutes ahead); never below :data:`~rdzv.retry.LAST_ATTEMPT`,
    nor above ``limit``.
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


class StoreLink:
    """The connection of one TCP store client, made again after it broke.

    ``timeout`` is the store timeout, in seconds; without ``secret`` the
    client does not authenticate, without ``ssl_context`` it speaks plain TCP.
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        secret: bytes | None,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.host = host
        self.port = port
        self.secret = secret
        self.ssl_context = ssl_context
        self.lock = threading.RLock()
        """Held for a whole call: one request in flight at a time."""
        self.sock: socket.socket | None = None
        self.reader = ReplyReader()
        self.rdzv_server: bool | None = None
        """Whether the server is rdzv's (None until the first handshake)."""
        self.closed = False
        self._was_connected = False
        self._recv_timeout: float | None = None
        self.set_timeout(timeout)

    def set_timeout(self, seconds: float) -> None:
        """Take a new store timeout, in seconds."""
        self.timeout = seconds
        self.reply_timeout = seconds + _REPLY_GRACE
        """How long a reply may take: the store timeout and a grace."""

    @property
    def address(self) -> str:
        """``host:port``, for messages."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def _connect_once(self, remaining: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=remaining)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
            self.sock = sock
            self.reader.clear()
            self._recv_timeout = None
            if self.ssl_context is None:
                # Blocking mode with kernel timeouts: Python's own socket
                # timeout polls before every send and recv, doubling the
                # system calls of a round trip.
                sock.settimeout(None)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(remaining))
            self._set_recv_timeout(remaining)
            self._handshake(min(remaining, HANDSHAKE_TIMEOUT))
        except BaseException:
            self.sock = None
            sock.close()
            raise
        return sock

    def _handshake(self, timeout: float) -> None:
        self.send(Request(Op.VALIDATE, number=VALIDATE_MAGIC))
        self.send(Request(Op.PING, number=PROBE_NONCE))
        try:
            hello = self.read(decode_u32, timeout)
        except TimeoutError:
            if self._was_connected:
                raise  # a store that answered before: stalled, maybe back soon
            raise _NotAStoreError(
                f"{self.address} accepted the connection but sent no reply to the store "
                f"handshake within {timeout:g} s"
            ) from None
        if hello == PROBE_NONCE:
            self.rdzv_server = False
            if self.secret is not None:
                raise StoreAuthenticationError(
                    f"authentication impossible: the store at {self.address} is not an rdzv "
                    "server (torch's server cannot authenticate); drop auth_token"
                )
        elif hello & SERVER_HELLO_MASK == SERVER_HELLO:
            self.rdzv_server = True
            self._authenticate(bool(hello & FEATURE_AUTH_REQUIRED))
        else:
            raise _NotAStoreError(
                f"{self.address} answered the store handshake with {hello:#010x}, "
                "which no TCP store sends"
            )

    def _authenticate(self, required: bool) -> None:
        if not required:
            if self.secret is not None:
                raise StoreAuthenticationError(
                    f"authentication failed: the store at {self.address} does not require "
                    "authentication, so it cannot prove it knows auth_token"
                )
            return
        if self.secret is None:
            raise StoreAuthenticationError(
                f"authentication required: the store at {self.address} needs a shared "
                "secret; pass auth_token"
            )
        self.send(Request(Op.AUTH_CHALLENGE))
        server_nonce = self.read(decode_raw(AUTH_NONCE_BYTES))
        client_nonce = os.urandom(AUTH_NONCE_BYTES)
        tag = auth_tag(self.secret, CLIENT_AUTH_LABEL, server_nonce, client_nonce)
        self.send(Request(Op.AUTH_RESPONSE, values=(client_nonce, tag)))
        # A refusal is a REFUSED byte before a clean close; a connection cut
        # here (a handshake the server reclaimed) is connection trouble, and
        # retried, not a refused secret.
        status = self.read(decode_u8)
        if status != AuthStatus.OK:
            raise StoreAuthenticationError(
                f"authentication failed: the store at {self.address} refused auth_token"
            )
        proof = self.read(decode_raw(AUTH_MAC_BYTES))
        expected = auth_tag(self.secret, SERVER_AUTH_LABEL, server_nonce, client_nonce)
        if proof != expected:
            raise StoreAuthenticationError(
                f"authentication failed: the store at {self.address} does not know auth_token"
            )

    def connect(self) -> socket.socket:
        """Return the connected socket, connecting (with retries) if there is none.

        Raises:
            RendezvousConnectionError: The link is closed, the server could
                not be reached in time, is no store, or its certificate did
                not verify.
            StoreAuthenticationError: Authentication failed or was impossible.
        """
        if self.closed:
            raise RendezvousConnectionError(f"the store client of {self.address} is closed")
        if self.sock is not None:
            return self.sock
        budget = self.timeout
        if self._was_connected:
            budget = min(budget, RECONNECT_TIMEOUT)
        budget = capped(budget)
        retry = Retry(budget, first=_BACKOFF_FIRST, cap=_BACKOFF_MAX)
        while True:
            timeout = max(retry.remaining(), 0.001)
            try:
                sock = self._connect_once(timeout)
                self._was_connected = True
                return sock
            except _NotAStoreError as exc:
                raise RendezvousConnectionError(str(exc)) from None
            except (StoreAuthenticationError, ssl.SSLCertVerificationError) as exc:
                if isinstance(exc, ssl.SSLCertVerificationError):
                    raise RendezvousConnectionError(
                        f"TLS certificate of the store at {self.address} did not verify: {exc}"
                    ) from exc
                raise
            except (OSError, ProtocolError, EOFError) as exc:
                if not retry.pause():
                    raise RendezvousConnectionError(
                        f"could not connect to the store at {self.address} within "
                        f"{budget:g} s: {exc}"
                    ) from exc

    def drop(self) -> None:
        """Close the socket, if any, and forget what was received on it."""
        sock, self.sock = self.sock, None
        self.reader.clear()
        if sock is not None:
            sock.close()

    def _broken(self, exc: BaseException) -> RendezvousConnectionError:
        """Drop the connection that failed with ``exc``; return the error to raise."""
        self.drop()
        return RendezvousConnectionError(
            f"the connection to the store at {self.address} failed: {exc}"
        )

    def call(self, operation: Callable[[], _T]) -> _T:
        """Run ``operation`` on a connected socket, translating transport errors."""
        with self.lock:
            self.connect()
            try:
                return operation()
            except (OSError, EOFError, ProtocolError) as exc:
                raise self._broken(exc) from exc
            except (StoreTimeoutError, NotImplementedError):
                raise  # answered cleanly: the connection is still in step
            except BaseException:
                self.drop()
                raise

    @overload
    def exchange(self, frame: bytes) -> None: ...

    @overload
    def exchange(self, frame: bytes, decode: Decoder[_T]) -> _T: ...

    def exchange(self, frame: bytes, decode: Decoder[_T] | None = None) -> _T | None:
        """Send one encoded request and return its reply (None: a request without one).

        :meth:`call` of a ``sendall`` and a read, written out for the
        frequent requests: the whole call is a few microseconds of Python,
        so each call saved is a measurable share of it. When nothing is
        buffered and the socket's timeout is the default (as capped by a
        caller's deadline, :func:`capped`), one ``recv`` usually brings
        exactly the reply, which ``decode`` decodes in place; anything else
        (part of a reply, more than one) is read from the buffer as
        :meth:`read_value` does. Without ``decode`` (``set``, ``append``...),
        nothing is read.
        """
        with self.lock:
            sock = self.sock
            if sock is None:
                sock = self.connect()
            try:
                sock.sendall(frame)
                if decode is None:
                    return None
                if self._recv_timeout == capped(self.reply_timeout) and not self.reader.pending:
                    data = _receive(sock)
                    try:
                        found = decode(data, 0)
                    except ProtocolError as exc:
                        raise self._wrong_value(exc) from exc
                    if found is not None and found[1] == len(data):
                        return found[0]
                    self.reader.feed(data)
                return self.read_value(decode)
            except (OSError, EOFError, ProtocolError) as exc:
                raise self._broken(exc) from exc
            except BaseException:
                self.drop()
                raise

    def send(self, request: Request) -> None:
        """Send ``request`` on the connected socket (lock held)."""
        assert self.sock is not None
        self.sock.sendall(encode_request(request))

    def _set_recv_timeout(self, seconds: float) -> None:
        if seconds == self._recv_timeout:
            return
        sock = self.sock
        assert sock is not None
        if self.ssl_context is None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        else:
            sock.settimeout(seconds)
        self._recv_timeout = seconds

    def read(self, decode: Decoder[_T], timeout: float | None = None) -> _T:
        """Read the next reply field (lock held), waiting at most ``timeout`` (capped) for it."""
        value = self.reader.read(decode)
        if value is not None:
            return value
        sock = self.sock
        assert sock is not None
        if timeout is None:
            # One default for every reply, including GET_WAIT's (answered by
            # the server within the store timeout), so that the common path
            # never changes the socket option.
            timeout = self.reply_timeout
        self._set_recv_timeout(capped(timeout))
        while True:
            self.reader.feed(_receive(sock))
            value = self.reader.read(decode)
            if value is not None:
                return value

    def read_value(self, decode: Decoder[_T], timeout: float | None = None) -> _T:
        """:meth:`read` a reply holding a value: one over the limit is the server's fault.

        Raises:
            RendezvousStateError: The value's length is over the limit.
        """
        try:
            return self.read(decode, timeout)
        except ProtocolError as exc:
            raise self._wrong_value(exc) from exc

    def _wrong_value(self, exc: ProtocolError) -> RendezvousStateError:
        """Drop the connection that announced a value over the limit; return the error to raise.

        What the server serves is wrong, not the connection: retrying reads it again.
        """
        self.drop()
        return RendezvousStateError(f"the store at {self.address} sent {exc}")

    def close(self) -> None:
        """Close the connection; every later call raises (idempotent)."""
        with self.lock:
            self.closed = True
            self.drop()
