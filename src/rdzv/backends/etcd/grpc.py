"""An etcd v3 client over gRPC (grpcio), the ``etcd`` extra.

Theory of operation
-------------------
The same client as :mod:`rdzv.backends.etcd.gateway`, over etcd's native
API instead of its JSON gateway: each call is one gRPC method of etcd's
``etcdserverpb`` services, its messages written and read by
:mod:`rdzv.backends.etcd.grpc_proto` (grpcio carries bytes; no protobuf runtime,
no generated code). The deadline of a call and the failover between members
are :class:`~rdzv.backends.etcd.client.EtcdClientBase`'s; an attempt is one
call with the attempt's timeout as its gRPC deadline.

Each member has one channel (one HTTP/2 connection, which every call of the
client multiplexes), private to the client (``grpc.use_local_subchannel_pool``:
grpcio would otherwise share one connection between every client of a
process, where each node has its own), without grpcio's bandwidth probe
(:data:`_BDP_PROBE`). A channel reconnects on its own, with backoff capped
at :data:`_MAX_RECONNECT_MS`, so a member that comes back is used again
within a second.

Leases are refreshed and keys watched on etcd's bidirectional streams: an
attempt opens a stream, sends its one request and closes its side, reads
until the answer (a keep-alive) or the first batch of events (a watch), and
cancels the stream. Sent as unary-stream calls, these are read in the
caller's thread; grpcio's default for a stream starts a thread to send the
request and wakes the caller from another (more agent CPU a node:
``docs/history/engines.md``). A watch's stream ends at the time left;
etcd may report that end as its own error rather than as the deadline, so
any end at the deadline but a member's being unavailable is the watch's
timeout.

gRPC's errors are mapped as the gateway's are: a connection that could not
be made is a :class:`~rdzv.backends.etcd.client.ConnectFailedError`, a TLS
handshake that failed (``https`` only: over ``http`` a handshake is HTTP/2's
and its failure a connection's) a :class:`~rdzv.errors.RendezvousConnectionError`
with a hint (not retried), a code in
:data:`~rdzv.backends.etcd.gateway_codec.TRANSIENT_CODES` or etcd's "too many
requests" an
:class:`~rdzv.backends.etcd.gateway_codec.EtcdUnavailableError` (the next member
is tried), any other code an
:class:`~rdzv.backends.etcd.gateway_codec.EtcdRejectedError` carrying it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.experimental

from rdzv.backends.etcd.client import PROBE_KEY, ConnectFailedError, EtcdClientBase, tls_failure
from rdzv.backends.etcd.gateway_codec import (
    TOO_MANY_REQUESTS,
    TRANSIENT_CODES,
    EtcdRejectedError,
    EtcdRetryableError,
    EtcdUnavailableError,
    GrpcCode,
    KeyValue,
    TxnResult,
    WatchEvent,
    prefix_range_end,
)
from rdzv.backends.etcd.grpc_proto import (
    MalformedMessageError,
    decode_deleted,
    decode_keepalive,
    decode_lease_grant,
    decode_range,
    decode_revision,
    decode_txn,
    decode_watch,
    delete_message,
    lease_grant_message,
    lease_id_message,
    put_message,
    range_message,
    txn_message,
    watch_message,
)
from rdzv.errors import RendezvousConnectionError, RendezvousError, RendezvousStateError
from rdzv.retry import Retry

__all__ = ["EtcdGrpcClient"]

_MAX_RECONNECT_MS = 1000
"""The longest a channel waits between two attempts to reconnect to its member."""
_BDP_PROBE = 0
"""grpcio's bandwidth probe, off: it pings as replies arrive to size the flow-control
window, which rdzv's small messages never fill (its cost in etcd's and the
agents' CPU: ``docs/history/engines.md``)."""
_MAX_MESSAGE = 64 * 1024 * 1024
"""The largest reply accepted (grpcio's default, 4 MiB, is below a range of many keys)."""
_UNARY = {
    "range": "/etcdserverpb.KV/Range",
    "put": "/etcdserverpb.KV/Put",
    "delete": "/etcdserverpb.KV/DeleteRange",
    "txn": "/etcdserverpb.KV/Txn",
    "grant": "/etcdserverpb.Lease/LeaseGrant",
    "revoke": "/etcdserverpb.Lease/LeaseRevoke",
}
_KEEPALIVE = "/etcdserverpb.Lease/LeaseKeepAlive"
_WATCH = "/etcdserverpb.Watch/Watch"


class _Member:
    """One member's channel and its methods (bytes in, bytes out)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.unary = {name: channel.unary_unary(path) for name, path in _UNARY.items()}
        # A call of one request is a unary-stream call on the wire: etcd's
        # bidirectional methods take it as such, and grpcio then reads the
        # replies in the caller's thread (SingleThreadedUnaryStream).
        self.keepalive = channel.unary_stream(_KEEPALIVE)
        self.watch = channel.unary_stream(_WATCH)


class EtcdGrpcClient(EtcdClientBase):
    """A thread-safe etcd v3 client over gRPC; it takes its base's arguments."""

    def _open(self, ca_cert: str | None, ssl_cert: str | None, ssl_cert_key: str | None) -> None:
        options = [
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.http2.bdp_probe", _BDP_PROBE),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_MS),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
        ]
        credentials = None
        if self._protocol == "https":
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(ca_cert),
                private_key=_read(ssl_cert_key),
                certificate_chain=_read(ssl_cert),
            )
        self._members: list[_Member] = []
        for host, port in self._endpoints:
            target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            channel = (
                grpc.insecure_channel(target, options)
                if credentials is None
                else grpc.secure_channel(target, credentials, options)
            )
            self._members.append(_Member(channel))

    def close(self) -> None:
        """Close every channel; later calls raise."""
        with self._lock:
            self._closed = True
        for member in self._members:
            member.channel.close()

    def _member(self, index: int) -> _Member:
        with self._lock:
            if self._closed:
                raise RendezvousConnectionError("the etcd client is closed")
        return self._members[index]

    # -- calls ----------------------------------------------------------------

    def _error(self, exc: Any, endpoint: str, what: str) -> RendezvousError:
        """Map a grpcio error of one attempt to rdzv's (see the module's docstring)."""
        status = exc.code()
        code = status.value[0] if status is not None else GrpcCode.UNKNOWN
        details = str(exc.details() or getattr(status, "name", "no details"))
        tls = self._protocol == "https"
        if tls and any(word in details.lower() for word in ("handshake", "ssl", "tsi_")):
            verify_failed = "CERTIFICATE_VERIFY_FAILED" in details
            return tls_failure(endpoint, details, details, verify_failed, self._has_client_cert)
        if code == GrpcCode.UNAVAILABLE and "failed to connect" in details.lower():
            # Over http a "handshaker shutdown" is HTTP/2's connection setup
            # cut short (a member too loaded to finish it in time), no TLS.
            return ConnectFailedError(f"{endpoint}: {details}")
        if code in TRANSIENT_CODES or TOO_MANY_REQUESTS in details:
            return EtcdUnavailableError(code, details, endpoint)
        return EtcdRejectedError(code, details, f"etcd at {endpoint} rejected {what}")

    def _decode(self, parse: Callable[[bytes], Any], data: bytes, index: int, what: str) -> Any:
        try:
            return parse(data)
        except MalformedMessageError as exc:
            raise RendezvousStateError(
                f"etcd at {self._url(index)} answered {what} with a malformed message: {exc}"
            ) from None

    def _unary(self, index: int, name: str, request: bytes, timeout: float) -> bytes:
        try:
            reply: bytes = self._member(index).unary[name](request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self._error(exc, self._url(index), name) from exc
        return reply

    def _call(self, name: str, request: bytes) -> tuple[bytes, int, int]:
        """Send one request with failover; return ``(reply, attempts, member index)``."""
        return self._failover(
            name, lambda index, timeout: self._unary(index, name, request, timeout)
        )

    def _probe(self, index: int, timeout: float) -> None:
        request = range_message(PROBE_KEY, count_only=True, serializable=True)
        self._unary(index, "range", request, timeout)

    # -- KV ---------------------------------------------------------------------

    def _range(self, request: bytes) -> tuple[list[KeyValue], int, int]:
        reply, _, index = self._call("range", request)
        found: tuple[list[KeyValue], int, int] = self._decode(decode_range, reply, index, "range")
        return found

    def range(  # noqa: D102 - see EtcdClientBase
        self,
        key: bytes,
        prefix: bool = False,
        limit: int = 0,
        sort_by_create: bool = False,
        keys_only: bool = False,
        serializable: bool = False,
    ) -> tuple[list[KeyValue], int]:
        range_end = prefix_range_end(key) if prefix else b""
        request = range_message(
            key, range_end, limit, sort_by_create, keys_only, serializable=serializable
        )
        kvs, _, revision = self._range(request)
        return kvs, revision

    def count(self, prefix: bytes) -> int:  # noqa: D102 - see EtcdClientBase
        _, count, _ = self._range(range_message(prefix, prefix_range_end(prefix), count_only=True))
        return count

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:  # noqa: D102 - see EtcdClientBase
        reply, _, index = self._call("put", put_message(key, value, lease))
        revision: int = self._decode(decode_revision, reply, index, "put")
        return revision

    def delete(self, key: bytes, prefix: bool = False) -> int:  # noqa: D102 - see EtcdClientBase
        request = delete_message(key, prefix_range_end(key) if prefix else b"")
        reply, _, index = self._call("delete", request)
        deleted: int = self._decode(decode_deleted, reply, index, "delete")
        return deleted

    def txn(  # noqa: D102 - see EtcdClientBase
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
    ) -> TxnResult:
        reply, attempts, index = self._call("txn", txn_message(compare, success, failure))
        succeeded, revision, responses = self._decode(decode_txn, reply, index, "txn")
        return TxnResult(succeeded, revision, responses, attempts)

    def txn_kvs(self, result: TxnResult, index: int) -> list[KeyValue]:  # noqa: D102 - see EtcdClientBase
        try:
            kvs: list[KeyValue] = result.responses[index]["response_range"]["kvs"]
        except (IndexError, KeyError):
            raise RendezvousStateError(
                f"etcd sent a txn answer without a range response {index}"
            ) from None
        return kvs

    # -- leases ---------------------------------------------------------------

    def lease_grant(self, ttl: int) -> tuple[int, int]:  # noqa: D102 - see EtcdClientBase
        reply, _, index = self._call("grant", lease_grant_message(ttl))
        lease_id, granted, error = self._decode(decode_lease_grant, reply, index, "lease grant")
        if error:
            raise RendezvousStateError(f"etcd at {self._url(index)} refused a lease: {error}")
        return lease_id, granted

    def _keepalive_once(self, index: int, lease_id: int, timeout: float) -> bytes:
        call = self._member(index).keepalive(lease_id_message(lease_id), timeout=timeout)
        try:
            for reply in call:
                return bytes(reply)
        except grpc.RpcError as exc:
            raise self._error(exc, self._url(index), "lease keep-alive") from exc
        finally:
            call.cancel()
        raise EtcdRetryableError(f"{self._url(index)}: the keep-alive stream ended unanswered")

    def lease_keepalive(self, lease_id: int) -> int:  # noqa: D102 - see EtcdClientBase
        reply, _, index = self._failover(
            "lease keep-alive",
            lambda index, timeout: self._keepalive_once(index, lease_id, timeout),
        )
        ttl: int = self._decode(decode_keepalive, reply, index, "lease keep-alive")
        return ttl

    def _revoke(self, lease_id: int) -> None:
        self._call("revoke", lease_id_message(lease_id))

    # -- watch ------------------------------------------------------------------

    def _watch_once(
        self, index: int, key: bytes, start_revision: int, prefix: bool, retry: Retry
    ) -> tuple[list[WatchEvent], int]:
        endpoint = self._url(index)
        request = watch_message(key, start_revision, prefix_range_end(key) if prefix else b"")
        call = self._member(index).watch(request, timeout=retry.remaining())
        answered = False
        try:
            for message in call:
                answered = True  # etcd acknowledges a watch before any event
                events: list[WatchEvent] = self._decode(
                    lambda data: decode_watch(data, endpoint), message, index, "watch"
                )
                if events:
                    return events, events[-1].kv.mod_revision + 1
        except grpc.RpcError as exc:
            expired = retry.remaining() <= 0.01 and exc.code() != grpc.StatusCode.UNAVAILABLE
            if expired and self._watch_went_quiet(answered, retry):
                return [], start_revision
            raise self._error(exc, endpoint, "watch") from exc
        finally:
            call.cancel()
        raise EtcdRetryableError(f"{endpoint}: the watch stream ended")


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()
