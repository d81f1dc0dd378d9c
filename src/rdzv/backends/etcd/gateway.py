"""A small etcd v3 client over etcd's JSON gateway, standard library only.

Theory of operation
-------------------
This module is the transport: connections and timeouts. What goes
over the wire (base64 keys and values, int64 fields as strings, error bodies
with gRPC codes, watch-stream lines) is built and parsed by
:mod:`rdzv.backends.etcd.gateway_codec`.

Unary calls (range, put, txn, leases) share a small pool of keep-alive
``http.client`` connections, one per call at a time, so the client is
thread-safe. Each attempt has a socket timeout; the deadline of a whole
call and the failover between members are
:class:`~rdzv.backends.etcd.client.EtcdClientBase`'s.

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
from collections.abc import Callable, Iterator
from typing import Any

from rdzv.backends.etcd.client import PROBE_KEY, ConnectFailedError, EtcdClientBase, tls_failure
from rdzv.backends.etcd.gateway_codec import (
    EtcdRetryableError,
    KeyValue,
    TxnResult,
    WatchEvent,
    decode_reply,
    decode_watch_line,
    delete_request,
    lease_grant_request,
    lease_id_request,
    parse_count,
    parse_deleted,
    parse_keepalive,
    parse_lease_grant,
    parse_range,
    parse_revision,
    parse_txn,
    put_request,
    range_request,
    txn_range_kvs,
    watch_events,
    watch_request,
)
from rdzv.errors import RendezvousConnectionError
from rdzv.retry import Retry

__all__ = ["EtcdClient"]


# The most bytes one line of a watch stream may take (a guard against garbage).
_MAX_WATCH_LINE = 64 * 1024 * 1024


class EtcdClient(EtcdClientBase):
    """A thread-safe etcd v3 client over the JSON gateway; it takes its base's arguments."""

    def _open(self, ca_cert: str | None, ssl_cert: str | None, ssl_cert_key: str | None) -> None:
        self._ssl_context: ssl.SSLContext | None = None
        if self._protocol == "https":
            self._ssl_context = ssl.create_default_context(cafile=ca_cert)
            if ssl_cert and ssl_cert_key:
                self._ssl_context.load_cert_chain(ssl_cert, ssl_cert_key)
        self._idle: list[tuple[int, http.client.HTTPConnection]] = []

    # -- endpoints and connections ------------------------------------------

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

    # -- requests -------------------------------------------------------------

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
                raise ConnectFailedError(f"{endpoint}: {type(exc).__name__}: {exc}") from exc
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
        """Send one JSON request, failing over between members until the deadline (see the base).

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
        response, attempts, index = self._failover(
            path, lambda index, timeout: self._request_once(index, path, body, timeout)
        )
        return response, attempts, self._url(index)

    def _probe(self, index: int, timeout: float) -> None:
        body = range_request(PROBE_KEY, count_only=True, serializable=True)
        self._request_once(index, "/v3/kv/range", body, timeout)

    # -- KV ---------------------------------------------------------------------

    def range(  # noqa: D102 - see EtcdClientBase
        self,
        key: bytes,
        prefix: bool = False,
        limit: int = 0,
        sort_by_create: bool = False,
        keys_only: bool = False,
        serializable: bool = False,
    ) -> tuple[list[KeyValue], int]:
        body = range_request(
            key, prefix, limit, sort_by_create, keys_only, serializable=serializable
        )
        response, _, endpoint = self.call("/v3/kv/range", body)
        return parse_range(response, endpoint)

    def count(self, prefix: bytes) -> int:  # noqa: D102 - see EtcdClientBase
        body = range_request(prefix, prefix=True, count_only=True)
        response, _, endpoint = self.call("/v3/kv/range", body)
        return parse_count(response, endpoint)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:  # noqa: D102 - see EtcdClientBase
        response, _, endpoint = self.call("/v3/kv/put", put_request(key, value, lease))
        return parse_revision(response, endpoint)

    def delete(self, key: bytes, prefix: bool = False) -> int:  # noqa: D102 - see EtcdClientBase
        response, _, endpoint = self.call("/v3/kv/deleterange", delete_request(key, prefix))
        return parse_deleted(response, endpoint)

    def txn(  # noqa: D102 - see EtcdClientBase
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
    ) -> TxnResult:
        body = {"compare": compare, "success": success, "failure": failure}
        response, attempts, endpoint = self.call("/v3/kv/txn", body)
        return parse_txn(response, attempts, endpoint)

    def txn_kvs(self, result: TxnResult, index: int) -> list[KeyValue]:  # noqa: D102 - see EtcdClientBase
        return txn_range_kvs(result, index, self.endpoints[self._current])

    # -- leases ---------------------------------------------------------------

    def lease_grant(self, ttl: int) -> tuple[int, int]:  # noqa: D102 - see EtcdClientBase
        response, _, endpoint = self.call("/v3/lease/grant", lease_grant_request(ttl))
        return parse_lease_grant(response, endpoint)

    def lease_keepalive(self, lease_id: int) -> int:  # noqa: D102 - see EtcdClientBase
        response, _, endpoint = self.call("/v3/lease/keepalive", lease_id_request(lease_id))
        return parse_keepalive(response, endpoint)

    def _revoke(self, lease_id: int) -> None:
        self.call("/v3/kv/lease/revoke", lease_id_request(lease_id))

    # -- watch ------------------------------------------------------------------

    def _watch_once(
        self, index: int, key: bytes, start_revision: int, prefix: bool, retry: Retry
    ) -> tuple[list[WatchEvent], int]:
        endpoint = self._url(index)
        payload = json.dumps(watch_request(key, start_revision, prefix)).encode()
        conn = self._connect(index, retry.attempt_timeout(self._connect_timeout))
        answered = False
        try:
            try:
                conn.request("POST", "/v3/watch", payload, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                answered = True
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
                expired = isinstance(exc, TimeoutError) and retry.remaining() <= 0.01
                if expired and self._watch_went_quiet(answered, retry):
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


def _tls_error(
    endpoint: str, exc: ssl.SSLError, has_client_cert: bool
) -> RendezvousConnectionError:
    reason = getattr(exc, "reason", None) or str(exc)
    verify_failed = isinstance(exc, ssl.SSLCertVerificationError)
    return tls_failure(endpoint, reason, str(exc), verify_failed, has_client_cert)
