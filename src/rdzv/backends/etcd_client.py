"""A small etcd v3 client over etcd's JSON gateway, standard library only.

Theory of operation
-------------------
This module is the transport: connections, timeouts and failover. What goes
over the wire (base64 keys and values, int64 fields as strings, error bodies
with gRPC codes, watch-stream lines) is built and parsed by
:mod:`rdzv.backends.etcd_gateway`.

Unary calls (range, put, txn, leases) share a small pool of keep-alive
``http.client`` connections, one per call at a time, so the client is
thread-safe. Each call has a per-request socket timeout and an overall
deadline (a :class:`rdzv.retry.Retry`): the read timeout, or the caller's
deadline when that comes sooner (:func:`rdzv.retry.deadline_within`: the
handler bounds a join by its join timeout, a heartbeat by the keep-alive
interval). When a member is unreachable, or answers with a transient error
(no leader, leader changed, ...: an
:class:`~rdzv.backends.etcd_gateway.EtcdRetryableError`), the call moves on
to the next endpoint, with capped backoff between full passes over the
endpoint list, until the deadline; while no member accepts a connection at
all (every host down), it gives up after the connect timeout rather than
the read timeout. A call that was sent more than once reports it
(``attempts``), so a caller can recognise its own write when the reply to
the first attempt was lost.

A watch runs on its own connection: ``POST /v3/watch`` answers with a stream
of newline-delimited JSON objects. A watch from a compacted revision raises
:class:`EtcdCompactedError`, telling the caller to re-read and watch again
from the fresh revision. Every watch is bounded by a timeout: the socket
timeout is the time left, and the connection is closed when the watch
returns, so nothing can hang.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rdzv.backends.etcd_gateway import (
    LEASE_NOT_FOUND,
    EtcdCompactedError,
    EtcdRequestError,
    EtcdRetryableError,
    KeyValue,
    TxnResult,
    WatchEvent,
    decode_reply,
    decode_watch_line,
    delete_request,
    lease_grant_request,
    lease_id_request,
    mod_revision_compare,
    parse_count,
    parse_deleted,
    parse_keepalive,
    parse_lease_grant,
    parse_range,
    parse_revision,
    parse_txn,
    prefix_range_end,
    put_request,
    range_request,
    txn_range_kvs,
    watch_events,
    watch_request,
)
from rdzv.endpoint import format_endpoint
from rdzv.errors import RendezvousConnectionError
from rdzv.retry import Retry

__all__ = ["EtcdClient", "EtcdCompactedError", "KeyValue", "WatchEvent", "prefix_range_end"]


# The most bytes one line of a watch stream may take (a guard against garbage).
_MAX_WATCH_LINE = 64 * 1024 * 1024


class EtcdClient:
    """A thread-safe etcd v3 client over the JSON gateway.

    Args:
        endpoints: ``(host, port)`` of one or more cluster members.
        protocol: ``"http"`` or ``"https"``.
        read_timeout: Seconds one request (and a whole call with failover)
            may take.
        connect_timeout: Seconds to establish a connection to one member.
        ssl_cert: The client certificate file (PEM), for https.
        ssl_cert_key: The client certificate's key file (PEM).
        ca_cert: The CA bundle that verifies the servers (PEM); the system
            trust store when None.

    Raises:
        ValueError: No endpoint, an unknown protocol, TLS files without https,
            a certificate without its key, or a non-positive timeout.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        protocol: str = "http",
        read_timeout: float = 60.0,
        connect_timeout: float = 5.0,
        ssl_cert: str | None = None,
        ssl_cert_key: str | None = None,
        ca_cert: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("the etcd client needs at least one endpoint")
        protocol = protocol.strip().lower()
        if protocol not in ("http", "https"):
            raise ValueError(f"the etcd protocol must be 'http' or 'https', got {protocol!r}")
        if protocol == "http" and (ssl_cert or ssl_cert_key or ca_cert):
            raise ValueError(
                "ssl_cert, ssl_cert_key and ca_cert need protocol=https; got protocol=http"
            )
        if bool(ssl_cert) != bool(ssl_cert_key):
            raise ValueError("ssl_cert and ssl_cert_key must be given together")
        if not read_timeout > 0:
            raise ValueError(f"read_timeout must be positive, got {read_timeout!r}")
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout must be positive, got {connect_timeout!r}")
        self._endpoints = [(host, int(port)) for host, port in endpoints]
        self._protocol = protocol
        self._read_timeout = float(read_timeout)
        self._connect_timeout = float(connect_timeout)
        self._ssl_context: ssl.SSLContext | None = None
        self._has_client_cert = bool(ssl_cert)
        if protocol == "https":
            self._ssl_context = ssl.create_default_context(cafile=ca_cert)
            if ssl_cert and ssl_cert_key:
                self._ssl_context.load_cert_chain(ssl_cert, ssl_cert_key)
        self._lock = threading.Lock()
        self._current = 0
        self._idle: list[tuple[int, http.client.HTTPConnection]] = []
        self._closed = False

    # -- endpoints and connections ------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """The members' URLs, in failover order."""
        return [self._url(i) for i in range(len(self._endpoints))]

    @property
    def read_timeout(self) -> float:
        """Seconds one call may take."""
        return self._read_timeout

    def _url(self, index: int) -> str:
        host, port = self._endpoints[index]
        return f"{self._protocol}://{format_endpoint(host, port)}"

    def _connect(self, index: int, timeout: float) -> http.client.HTTPConnection:
        host, port = self._endpoints[index]
        if self._ssl_context is not None:
            return http.client.HTTPSConnection(
                host, port, timeout=timeout, context=self._ssl_context
            )
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _take(self, index: int, timeout: float) -> http.client.HTTPConnection:
        with self._lock:
            if self._closed:
                raise RendezvousConnectionError("the etcd client is closed")
            for i, (idx, conn) in enumerate(self._idle):
                if idx == index:
                    del self._idle[i]
                    return conn
        return self._connect(index, min(self._connect_timeout, timeout))

    def _give_back(self, index: int, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < 8:
                self._idle.append((index, conn))
                return
        conn.close()

    def close(self) -> None:
        """Close every pooled connection; later calls raise."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for _, conn in idle:
            conn.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------

    def _tls_hint(self) -> str:
        if self._ssl_context is not None and not self._has_client_cert:
            return (
                " (a server that requires client certificates drops connections "
                "without one: set ssl_cert and ssl_cert_key)"
            )
        return ""

    def _request_once(
        self, index: int, path: str, body: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        endpoint = self._url(index)
        payload = json.dumps(body).encode()
        conn = self._take(index, timeout)
        if getattr(conn, "sock", None) is None:
            try:
                conn.connect()  # bounded by the connect timeout given at creation
            except ssl.SSLError as exc:
                conn.close()
                raise _tls_error(endpoint, exc, self._has_client_cert) from exc
            except OSError as exc:
                conn.close()
                raise _ConnectFailedError(f"{endpoint}: {type(exc).__name__}: {exc}") from exc
        try:
            conn.sock.settimeout(timeout)
            conn.request("POST", path, payload, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except ssl.SSLError as exc:
            conn.close()
            raise _tls_error(endpoint, exc, self._has_client_cert) from exc
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise EtcdRetryableError(f"{endpoint}: {type(exc).__name__}: {exc}") from exc
        if resp.will_close:
            conn.close()
        else:
            self._give_back(index, conn)
        return decode_reply(resp.status, data, endpoint, path)

    def call(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], int, str]:
        """Send one JSON request, failing over between members until the deadline.

        The deadline is the read timeout, or the caller's deadline
        (:func:`rdzv.retry.deadline_within`) when sooner. While no member
        accepts a connection at all (every host down, nothing listening), the
        call gives up after the connect timeout instead.

        Args:
            path: The gateway path, e.g. ``/v3/kv/range``.
            body: The request object.

        Returns:
            ``(response, attempts, endpoint)``.

        Raises:
            RendezvousConnectionError: No member answered in time; the
                message names every member tried.
            EtcdRejectedError: A member rejected the request (a
                :class:`~rdzv.errors.RendezvousStateError` carrying etcd's
                error ``code``).
            RendezvousStateError: A member's answer is not a JSON object.
        """
        retry = Retry(self._read_timeout)
        errors: list[str] = []
        attempts = 0
        reached = False
        count = len(self._endpoints)
        # A member that accepts connections but hangs must not eat the whole
        # budget: with several members each attempt gets a share of it.
        per_attempt = self._read_timeout if count == 1 else max(1.0, self._read_timeout / count)

        def give_up() -> bool:
            unreachable = not reached and retry.elapsed() >= self._connect_timeout
            return unreachable or retry.expired()

        while True:
            with self._lock:
                start = self._current
            for step in range(count):
                if attempts and give_up():
                    break
                index = (start + step) % count
                attempts += 1
                try:
                    response = self._request_once(
                        index, path, body, retry.attempt_timeout(per_attempt)
                    )
                except _ConnectFailedError as exc:
                    errors.append(str(exc))
                    continue
                except EtcdRetryableError as exc:
                    reached = True
                    errors.append(str(exc))
                    continue
                if step:
                    with self._lock:
                        self._current = index
                return response, attempts, self._url(index)
            if give_up() or not retry.pause():
                what = (
                    f"answered {path}"
                    if reached
                    else f"accepted a connection for {path} (connect timeout "
                    f"{self._connect_timeout:g} s)"
                )
                raise RendezvousConnectionError(
                    f"no etcd member {what} within {retry.elapsed():.3g} s "
                    f"({attempts} attempts); last errors: {'; '.join(errors[-count:])}"
                    + self._tls_hint()
                )

    def check_reachable(self) -> str:
        """Ask each member once, in order, for a count of no keys, until one answers.

        One bounded round trip per member: each attempt may take the connect
        timeout (or the read timeout, when shorter); no member is retried.

        Returns:
            The URL of the member that answered.

        Raises:
            RendezvousConnectionError: No member answered; the message names
                every member and its failure.
            EtcdRejectedError: A member answered and refused to read.
        """
        timeout = min(self._connect_timeout, self._read_timeout)
        body = range_request(b"\0rdzv-probe", count_only=True, serializable=True)
        errors: list[str] = []
        for index in range(len(self._endpoints)):
            try:
                self._request_once(index, "/v3/kv/range", body, timeout)
            except EtcdRetryableError as exc:
                errors.append(str(exc))
                continue
            with self._lock:
                self._current = index
            return self._url(index)
        raise RendezvousConnectionError(
            f"no etcd member answered within {timeout:g} s: {'; '.join(errors)}" + self._tls_hint()
        )

    # -- KV ---------------------------------------------------------------------

    def range(
        self,
        key: bytes,
        prefix: bool = False,
        limit: int = 0,
        sort_by_create: bool = False,
        keys_only: bool = False,
        serializable: bool = False,
    ) -> tuple[list[KeyValue], int]:
        """Read a key or every key under a prefix.

        Args:
            key: The key or prefix.
            prefix: Read every key starting with ``key``.
            limit: The most keys to return (0: no limit).
            sort_by_create: Oldest-created first.
            keys_only: Leave the values out.
            serializable: Answer from the member's own copy (may be stale).

        Returns:
            ``(kvs, revision)``: the keys found and the store revision read.
        """
        body = range_request(
            key, prefix, limit, sort_by_create, keys_only, serializable=serializable
        )
        response, _, endpoint = self.call("/v3/kv/range", body)
        return parse_range(response, endpoint)

    def count(self, prefix: bytes) -> int:
        """Count the keys under ``prefix``."""
        body = range_request(prefix, prefix=True, count_only=True)
        response, _, endpoint = self.call("/v3/kv/range", body)
        return parse_count(response, endpoint)

    def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """Read one key."""
        kvs, revision = self.range(key)
        return (kvs[0] if kvs else None), revision

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write a key under ``lease`` (0: none); return the store revision of the write."""
        response, _, endpoint = self.call("/v3/kv/put", put_request(key, value, lease))
        return parse_revision(response, endpoint)

    def delete(self, key: bytes, prefix: bool = False) -> int:
        """Delete a key or every key under a prefix."""
        response, _, endpoint = self.call("/v3/kv/deleterange", delete_request(key, prefix))
        return parse_deleted(response, endpoint)

    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
    ) -> TxnResult:
        """Run a transaction: the ``success`` ops when every ``compare`` holds, else ``failure``."""
        body = {"compare": compare, "success": success, "failure": failure}
        response, attempts, endpoint = self.call("/v3/kv/txn", body)
        return parse_txn(response, attempts, endpoint)

    def txn_kvs(self, result: TxnResult, index: int) -> list[KeyValue]:
        """Return the keys of the ``index``-th range response of a txn."""
        return txn_range_kvs(result, index, self.endpoints[self._current])

    def compare_and_put(
        self,
        key: bytes,
        value: bytes,
        mod_revision: int,
        lease: int = 0,
        also: Mapping[bytes, bytes] | None = None,
    ) -> tuple[bool, int, KeyValue | None, int]:
        """Write ``key`` if its ``mod_revision`` is ``mod_revision``, in one round trip.

        Args:
            key: The key.
            value: The new value.
            mod_revision: The expected modification revision; 0 means
                "the key must not exist".
            lease: A lease ID to attach to the new value.
            also: More ``{key: value}`` to put in the same transaction, under
                the same lease, when the write wins.

        Returns:
            ``(written, revision, current, attempts)``: on success the
            revision of the write and ``current`` None; on failure the
            stored key (None when absent) as read in the same transaction.
        """
        puts = {key: value, **(also or {})}
        result = self.txn(
            [mod_revision_compare(key, mod_revision)],
            [{"request_put": put_request(k, v, lease)} for k, v in puts.items()],
            [{"request_range": range_request(key)}],
        )
        if result.succeeded:
            return True, result.revision, None, result.attempts
        kvs = self.txn_kvs(result, 0)
        return False, result.revision, (kvs[0] if kvs else None), result.attempts

    # -- leases ---------------------------------------------------------------

    def lease_grant(self, ttl: int) -> tuple[int, int]:
        """Grant a lease of ``ttl`` whole seconds; return ``(lease_id, granted_ttl)``.

        Raises:
            ValueError: ``ttl`` is below 1.
        """
        response, _, endpoint = self.call("/v3/lease/grant", lease_grant_request(ttl))
        return parse_lease_grant(response, endpoint)

    def lease_keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; return its TTL in seconds (0 or less: expired or absent)."""
        response, _, endpoint = self.call("/v3/lease/keepalive", lease_id_request(lease_id))
        return parse_keepalive(response, endpoint)

    def lease_revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting every key attached to it (a missing lease is ignored)."""
        try:
            self.call("/v3/kv/lease/revoke", lease_id_request(lease_id))
        except EtcdRequestError as exc:
            if exc.code != LEASE_NOT_FOUND:
                raise

    # -- watch ------------------------------------------------------------------

    def watch(
        self, key: bytes, start_revision: int, timeout: float, prefix: bool = False
    ) -> tuple[list[WatchEvent], int]:
        """Wait for changes of ``key`` (or a prefix) at or after ``start_revision``.

        Returns as soon as one batch of events arrives, or empty when
        ``timeout`` elapses.

        Args:
            key: The key or prefix.
            start_revision: The first revision of interest.
            timeout: The most seconds to wait.
            prefix: Watch every key starting with ``key``.

        Returns:
            ``(events, next_revision)``: the events and the revision to
            resume from.

        Raises:
            EtcdCompactedError: ``start_revision`` was compacted; re-read.
            RendezvousConnectionError: No member could be watched.
        """
        retry = Retry(timeout)
        payload = json.dumps(watch_request(key, start_revision, prefix)).encode()
        errors: list[str] = []
        count = len(self._endpoints)
        while True:
            with self._lock:
                start = self._current
            for step in range(count):
                index = (start + step) % count
                try:
                    return self._watch_once(index, payload, start_revision, retry)
                except EtcdRetryableError as exc:
                    errors.append(str(exc))
            if not retry.pause():
                raise RendezvousConnectionError(
                    f"could not watch etcd ({', '.join(self.endpoints)}): "
                    f"{'; '.join(errors[-count:])}" + self._tls_hint()
                )

    def _watch_once(
        self, index: int, payload: bytes, start_revision: int, retry: Retry
    ) -> tuple[list[WatchEvent], int]:
        endpoint = self._url(index)
        conn = self._connect(index, retry.attempt_timeout(self._connect_timeout))
        try:
            try:
                conn.request("POST", "/v3/watch", payload, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                if resp.status != 200:
                    body = resp.read(4096)
                    raise EtcdRetryableError(
                        f"{endpoint}: watch answered HTTP {resp.status}: {body!r}"
                    )
                for message in self._stream(resp, conn, retry.remaining, endpoint):
                    events = watch_events(message, endpoint)
                    if events:
                        return events, events[-1].kv.mod_revision + 1
                return [], start_revision
            except ssl.SSLError as exc:
                raise _tls_error(endpoint, exc, self._has_client_cert) from exc
            except (OSError, http.client.HTTPException) as exc:
                if isinstance(exc, TimeoutError) and retry.remaining() <= 0.01:
                    return [], start_revision
                raise EtcdRetryableError(f"{endpoint}: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()

    @staticmethod
    def _stream(
        resp: http.client.HTTPResponse,
        conn: http.client.HTTPConnection,
        time_left: Callable[[], float],
        endpoint: str,
    ) -> Iterator[dict[str, Any]]:
        while True:
            remaining = time_left()
            if remaining <= 0:
                return
            if conn.sock is not None:
                conn.sock.settimeout(remaining)
            try:
                line = resp.readline(_MAX_WATCH_LINE)
            except TimeoutError:
                return
            if not line:
                raise EtcdRetryableError(f"{endpoint}: the watch stream ended")
            message = decode_watch_line(line, endpoint)
            if message is not None:
                yield message


class _ConnectFailedError(EtcdRetryableError):
    """No connection to a member could be made (nothing listening, host down)."""


def _tls_error(
    endpoint: str, exc: ssl.SSLError, has_client_cert: bool
) -> RendezvousConnectionError:
    reason = getattr(exc, "reason", None) or str(exc)
    text = str(exc).upper()
    if isinstance(exc, ssl.SSLCertVerificationError):
        hint = "the server certificate did not verify against ca_cert"
    elif "ALERT" in text and ("CERTIFICATE" in text or "UNKNOWN_CA" in text):
        hint = (
            "the server rejected this client's certificate"
            if has_client_cert
            else "the server requires a client certificate; set ssl_cert and ssl_cert_key"
        )
    elif not has_client_cert:
        hint = (
            "the server ended the handshake; if it requires a client certificate, "
            "set ssl_cert and ssl_cert_key"
        )
    else:
        hint = "check ca_cert, ssl_cert and ssl_cert_key"
    return RendezvousConnectionError(f"TLS with etcd at {endpoint} failed ({reason}): {hint}")
