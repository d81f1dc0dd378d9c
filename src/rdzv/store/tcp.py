"""The TCP store client, :class:`TCPStore`, with torch's constructor shape.

Theory of operation
-------------------
Each call encodes its request with the encoder :mod:`rdzv.store.protocol`
makes from the opcode's layout (through
:func:`~rdzv.store.protocol.encode_request`, or, for the frequent requests,
straight from their fields), sends it on the client's
:class:`~rdzv.store.link.StoreLink`, and decodes each field of the reply
with the protocol's decoder of that field: from the link's
:class:`~rdzv.store.protocol.ReplyReader`, or from the received bytes
themselves when one ``recv`` brought exactly the reply. The link connects,
shakes hands, authenticates, and bounds every read by the caller's
deadline (see :mod:`rdzv.store.link`); a ``wait`` that a deadline or its
own timeout cuts short follows torch's cancel exchange: send
``CANCEL_WAIT`` and read up to two bytes, since the server's
``STOP_WAITING`` may have crossed the cancel on the wire, then raise
:class:`~rdzv.errors.StoreTimeoutError`.

Keys follow torch's client: user key ``k`` is ``/k`` on the wire, so rdzv and
torch clients on one server see each other's keys.

The encoding lives in :mod:`rdzv.store.protocol`, the connection in
:mod:`rdzv.store.link` and the server in :mod:`rdzv.store.server`.
"""

from __future__ import annotations

import math
import select
import ssl
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rdzv.errors import StoreTimeoutError
from rdzv.retry import Deadline, current_clock
from rdzv.store.base import (
    DEFAULT_STORE_TIMEOUT,
    Store,
    Timeout,
    Value,
    check_multi_set,
    to_bytes,
    to_seconds,
)
from rdzv.store.link import HANDSHAKE_TIMEOUT, RECONNECT_TIMEOUT, StoreLink, capped
from rdzv.store.protocol import (
    MAX_KEY_BYTES,
    MAX_MULTI_KEYS,
    MAX_REPLY_ITEMS,
    MAX_VALUE_BYTES,
    MAX_WILL_BYTES,
    CheckResult,
    GetWaitStatus,
    Op,
    ProtocolError,
    Request,
    WaitResult,
    WatchStatus,
    decode_bytes,
    decode_get_wait,
    decode_i64,
    decode_u8,
    encode_request,
    request_encoder,
)

if TYPE_CHECKING:
    from rdzv.store.server import TCPStoreServer
    from rdzv.store.will import Will

__all__ = ["HANDSHAKE_TIMEOUT", "RECONNECT_TIMEOUT", "TCPStore"]

_KEY_PREFIX = b"/"
_INIT_KEY = b"init/"


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
        listen: The addresses the hosted server listens on (``is_master``
            only; see :func:`~rdzv.net.listen_addresses`); None, the
            default, every address, as torch's server.

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
        listen: Sequence[str] | None = None,
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
        secret = auth_token.encode() if isinstance(auth_token, str) else auth_token
        self._multi_tenant = multi_tenant
        self._server: TCPStoreServer | None = None
        if is_master:
            from rdzv.store.serve import ServerSecurity, hosted_server  # noqa: PLC0415 - hosts only

            secure = ServerSecurity(secret, server_ssl_context)
            self._server = hosted_server(port, multi_tenant, secure, max_connections, listen)
            port = self._server.port
        link = StoreLink(host_name, port, self.timeout.total_seconds(), secret, ssl_context)
        self._link = link
        self._call, self._exchange, self._send = link.call, link.exchange, link.send
        self._read, self._read_value = link.read, link.read_value
        try:
            with link.lock:
                link.connect()
            if world_size is not None and wait_for_workers:
                self._join_workers(world_size, is_master)
        except BaseException:
            self.close()
            raise

    # -- properties ----------------------------------------------------------

    @property
    def host(self) -> str:
        """The server's host name, as given."""
        return self._link.host

    @property
    def port(self) -> int:
        """The server's port (the one picked when constructed with port 0)."""
        return self._link.port

    @property
    def server(self) -> TCPStoreServer | None:
        """The server this store hosts (``is_master=True``), else None."""
        return self._server

    def set_timeout(self, timeout: Timeout) -> None:  # noqa: D102 - documented on Store
        super().set_timeout(timeout)
        self._link.set_timeout(self.timeout.total_seconds())

    @property
    def supports_watch(self) -> bool:
        """True when the server is an rdzv server, which implements ``watch``."""
        with self._link.lock:
            if self._link.rdzv_server is None:
                self._call(lambda: None)
            return bool(self._link.rdzv_server)

    def clone(self) -> TCPStore:
        """Return a new client of the same server, with its own connection.

        Blocking calls (``get``, ``wait``, ``watch``, ...) hold this client's
        connection until they return; a thread that must not wait behind
        them uses a clone. The clone has the same timeout, secret and TLS
        context, and never hosts a server.
        """
        return TCPStore(
            self._link.host,
            self._link.port,
            timeout=self.timeout,
            auth_token=self._link.secret,
            ssl_context=self._link.ssl_context,
        )

    def close(self) -> None:
        """Close the connection and stop the hosted server, if any (idempotent)."""
        with self._link.lock:
            self._link.close()
            server, self._server = self._server, None
        if server is not None:
            from rdzv.store.serve import release_server  # noqa: PLC0415 - loaded by hosting

            release_server(server, self._multi_tenant)

    def _join_workers(self, world_size: int, is_master: bool) -> None:
        self._add_wire(_INIT_KEY, 1)
        if not is_master:
            return
        budget = self.timeout.total_seconds()
        clock = current_clock()
        deadline = Deadline.after(budget, clock)
        pause = 0.01
        while (joined := self._add_wire(_INIT_KEY, 0)) < world_size:
            if deadline.left() <= 0:
                raise StoreTimeoutError(
                    f"only {joined} of {world_size} workers connected to the store at "
                    f"{self._link.address} within {budget:g} s"
                )
            clock.sleep(pause)
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
        seconds = capped(max(seconds, 0.0001))
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

        if self._link.rdzv_server:
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

        The key's value counts the arrivals; ``timeout`` overrides the store
        timeout.

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
        deadline = Deadline.after(self.timeout.total_seconds(), current_clock())

        def queue_pop() -> bytes:
            while True:
                if block:
                    remaining = max(deadline.left(), 0.0)
                    self._wait_raw(Request(Op.WAIT, (wire,)), remaining, f"queue {key!r}")
                self._send(Request(Op.QUEUE_POP, (wire,)))
                if self._read(decode_i64) > 0:
                    return self._read_value(decode_bytes)
                if not block or deadline.left() <= 0:
                    raise StoreTimeoutError(f"queue {key!r} is empty")

        return self._call(queue_pop)

    def queue_len(self, key: str) -> int:  # noqa: D102
        return self._exchange(encode_request(Request(Op.QUEUE_LEN, (_wire_key(key),))), decode_i64)

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:
        """Block until the value of ``key`` differs from ``previous`` (rdzv servers only).

        See :meth:`Store.watch <rdzv.store.base.Store.watch>`.

        Raises:
            NotImplementedError: The server is torch's, which cannot watch.
        """
        wire = _wire_key(key)
        seconds = to_seconds(timeout)
        values = () if previous is None else (_value(previous),)
        request = Request(Op.WATCH, (wire,), values, self._ms(seconds))

        def watch() -> bytes | None:
            if not self._link.rdzv_server:
                raise NotImplementedError(
                    f"the store at {self._link.address} is not an rdzv server and cannot watch"
                )
            self._send(request)
            # The server ends the wait at its timeout; its reply may then
            # take as long as any reply may, on top of it.
            status = self._read(decode_u8, seconds + self._link.reply_timeout)
            if status == WatchStatus.PRESENT:
                return self._read_value(decode_bytes)
            if status == WatchStatus.ABSENT:
                return None
            if status == WatchStatus.UNCHANGED:
                return previous
            raise ProtocolError(f"unexpected WATCH status {status}")

        return self._call(watch)

    def set_will(self, key: str, value: Value | None) -> None:
        """Have the server set ``key`` to ``value`` when this client's connection closes.

        The will belongs to the connection: one that breaks and is made
        again has none. ``value`` None withdraws it (a clean close sets
        nothing). See :class:`rdzv.store.will.Will`, which keeps one.

        Raises:
            NotImplementedError: The server is torch's, which holds no wills.
            ValueError: ``value`` is longer than the server holds.
        """
        wire = _wire_key(key) if value is not None else b""
        data = b"" if value is None else _value(value)
        if len(data) > MAX_WILL_BYTES:
            raise ValueError(f"a will of {len(data)} bytes exceeds {MAX_WILL_BYTES} bytes")
        request = Request(Op.WILL, (wire,), (data,))

        def will() -> None:
            if not self._link.rdzv_server:
                raise NotImplementedError(
                    f"the store at {self._link.address} is not an rdzv server and holds no will"
                )
            self._send(request)
            self._read(decode_u8)

        self._call(will)

    def keep_will(self, key: str, value: Value, on_restored: Callable[[], None]) -> Will | None:
        """Keep a will on a connection of its own (:class:`rdzv.store.will.Will`); rdzv servers only.

        See :meth:`Store.keep_will <rdzv.store.base.Store.keep_will>`.
        """
        if not self.supports_watch:
            return None
        from rdzv.store.will import Will  # noqa: PLC0415 - the will imports no client

        return Will(self.clone, key, value, on_restored)

    def wait_closed(self, wake: int, timeout: float) -> bool:
        """Block until the server ends this client's connection, ``wake`` is readable, or timeout.

        For a connection that sends nothing but holds a will. Returns True
        when the connection is gone (closed, reset, or it sent a byte it
        owed nobody; it is dropped, and the next call connects again).
        """
        with self._link.lock:
            sock = self._link.sock
            if sock is None:
                return True
            readable, _, _ = select.select([sock.fileno(), wake], [], [], max(timeout, 0.0))
            if sock.fileno() not in readable:
                return False
            previous = sock.gettimeout()
            try:
                sock.setblocking(False)
                sock.recv(1)
            except (BlockingIOError, ssl.SSLWantReadError):
                # Nothing for the caller (a TLS record such as a session
                # ticket): the connection stays, with its timeout as it was.
                sock.settimeout(previous)
                return False
            except OSError:
                pass
            self._link.drop()
            return True

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Return the values of several keys without waiting; None for a missing key.

        One round trip on an rdzv server; on torch's server, the portable
        :meth:`Store.try_multi_get`.
        """
        wire = self._wire_keys(keys)

        def try_multi_get() -> list[bytes | None] | None:
            if not self._link.rdzv_server:
                return None
            self._send(Request(Op.MULTI_TRY_GET, wire))
            return [self._read_value(decode_bytes) if self._read(decode_u8) else None for _ in wire]

        with self._link.lock:
            found = self._call(try_multi_get)
            if found is not None:
                return found
            return super().try_multi_get(keys)

    def __repr__(self) -> str:
        kind = {None: "unknown", True: "rdzv", False: "torch"}[self._link.rdzv_server]
        return f"TCPStore({self._link.address}, server={kind})"
