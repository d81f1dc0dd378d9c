"""etcd v3 JSON-gateway encoding: request bodies and reply parsing, with no I/O.

Theory of operation
-------------------
etcd serves its gRPC API as JSON under ``/v3/...`` (the grpc-gateway): every
call is a ``POST`` of one JSON object, answered by one JSON object. The
encoding differs from plain JSON in ways this module hides:

* bytes fields (``key``, ``value``, ``range_end``) travel base64-encoded;
* int64 fields (revisions, lease IDs, TTLs, counts) come back as JSON
  strings; requests may send them as strings or numbers;
* proto3 JSON omits false, zero and empty fields: a failed txn has no
  ``succeeded``, an absent key no ``kvs``, a key without a lease no
  ``lease``. A missing field parses as its zero value.

A rejected call answers with a non-200 status and an error body holding the
gRPC status ``code`` and ``message`` (etcd 3.4 repeats the message as
``error``). :func:`decode_reply` turns it into an :class:`EtcdRequestError`
carrying the code: an :class:`EtcdUnavailableError` (retryable on another
member) for the codes in :data:`TRANSIENT_CODES`, a gateway/proxy status or
etcd's "too many requests",
an :class:`EtcdRejectedError` (final) otherwise.

A watch is a stream: ``POST /v3/watch`` with a ``create_request`` answers
with newline-delimited JSON objects, each ``{"result": WatchResponse}`` or
``{"error": ...}``. The first result says ``created``; later ones carry
events. A watch from a compacted revision is cancelled with
``compact_revision`` (:class:`EtcdCompactedError`).

Everything here builds or parses plain objects; the connections, timeouts
and failover live in :mod:`rdzv.backends.etcd.gateway`. The ``endpoint``
arguments only name the member in error messages.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from rdzv.errors import RendezvousConnectionError, RendezvousError, RendezvousStateError

__all__ = [
    "LEASE_NOT_FOUND",
    "TRANSIENT_CODES",
    "EtcdCompactedError",
    "EtcdRejectedError",
    "EtcdRequestError",
    "EtcdRetryableError",
    "EtcdUnavailableError",
    "GrpcCode",
    "KeyValue",
    "TxnResult",
    "WatchEvent",
    "decode_bytes",
    "decode_reply",
    "decode_watch_line",
    "delete_request",
    "encode_bytes",
    "lease_grant_request",
    "lease_id_request",
    "mod_revision_compare",
    "parse_count",
    "parse_deleted",
    "parse_int",
    "parse_keepalive",
    "parse_kv",
    "parse_lease_grant",
    "parse_range",
    "parse_revision",
    "parse_txn",
    "prefix_range_end",
    "put_request",
    "range_request",
    "txn_range_kvs",
    "watch_events",
    "watch_request",
]


class GrpcCode(IntEnum):
    """The gRPC status codes rdzv tells apart (an error body's ``code``)."""

    CANCELLED = 1
    UNKNOWN = 2
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    UNAVAILABLE = 14


# etcd answers UNAVAILABLE for "no leader", "leader changed", "not capable",
# "server stopped", "unhealthy cluster" and "request timed out"; the gateway
# answers DEADLINE_EXCEEDED when its own call to the member timed out, and
# CANCELLED (HTTP 408, "grpc: the client connection is closing") while the
# member it fronts shuts down: another member can answer.
TRANSIENT_CODES = frozenset({GrpcCode.CANCELLED, GrpcCode.DEADLINE_EXCEEDED, GrpcCode.UNAVAILABLE})
# etcd's code for "requested lease not found", the only NOT_FOUND a KV or lease call gets.
LEASE_NOT_FOUND = GrpcCode.NOT_FOUND
# Bad gateway, service unavailable, gateway timeout: the member behind is unreachable.
_TRANSIENT_HTTP_STATUSES = frozenset({502, 503, 504})
# etcd's own backpressure while its applies lag its commits by over 5,000
# entries: a pass over the members and a backoff ride it out (8,192 joining
# nodes on two cores drove etcd there). Told by its message: the 3.4 gateway
# answers it with HTTP 500 and whatever code, and gRPC's RESOURCE_EXHAUSTED also
# stands for "database space exceeded", which stays final.
TOO_MANY_REQUESTS = "too many requests"


# -- errors -------------------------------------------------------------------


class EtcdRetryableError(RendezvousConnectionError):
    """A member failed in a way that another member, or a later try, may not.

    The client fails over on it; when no member answers in time, callers get
    the :class:`RendezvousConnectionError` that lists these failures.
    """


class EtcdRequestError(RendezvousError):
    """etcd answered a call with an error body.

    Args:
        code: The gRPC status code of the body (``GrpcCode.UNKNOWN`` when it
            has none); compare it with :class:`GrpcCode` members.
        message: etcd's message.
        context: What the error text starts with (the member and the call).
    """

    def __init__(self, code: int, message: str, context: str = "") -> None:
        self.code = code
        self.message = message
        super().__init__(f"{context}: {message}" if context else message)


class EtcdUnavailableError(EtcdRequestError, EtcdRetryableError):
    """A transient error: the member cannot serve now; another one may."""


class EtcdRejectedError(EtcdRequestError, RendezvousStateError):
    """A final error: etcd refused the call (a missing lease, a bad argument, ...)."""


class EtcdCompactedError(RendezvousConnectionError):
    """A watch asked for a revision the server has compacted away.

    Args:
        endpoint: The member that answered.
        compact_revision: The oldest revision still available.
    """

    def __init__(self, endpoint: str, compact_revision: int) -> None:
        self.compact_revision = compact_revision
        super().__init__(
            f"etcd at {endpoint} compacted the history up to revision {compact_revision}; "
            "re-read and watch again"
        )


# -- values -------------------------------------------------------------------


@dataclass(frozen=True)
class KeyValue:
    """A key and its value as etcd stores them."""

    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch: ``kind`` is ``"PUT"`` or ``"DELETE"``."""

    kind: str
    kv: KeyValue


@dataclass(frozen=True)
class TxnResult:
    """The outcome of a transaction.

    Attributes:
        succeeded: Whether the compare held (the success branch ran).
        revision: The store revision after the transaction.
        responses: The raw responses of the branch that ran.
        attempts: How many times the request was sent (> 1 after a failover).
    """

    succeeded: bool
    revision: int
    responses: list[dict[str, Any]]
    attempts: int


# -- scalars ------------------------------------------------------------------


def encode_bytes(data: bytes) -> str:
    """Return the base64 text of a bytes field."""
    return base64.b64encode(data).decode("ascii")


def decode_bytes(text: Any, what: str, endpoint: str) -> bytes:
    """Decode a base64 bytes field ``what`` of a reply (absent: empty).

    Raises:
        RendezvousStateError: The field is not base64.
    """
    if text is None:
        return b""
    try:
        return base64.b64decode(str(text), validate=True)
    except ValueError:
        raise RendezvousStateError(f"etcd at {endpoint} sent a {what} that is not base64") from None


def parse_int(value: Any, what: str, endpoint: str) -> int:
    """Parse an integer field ``what`` of a reply (an int64 usually a string; absent: 0).

    Raises:
        RendezvousStateError: The value is not an integer.
    """
    if value is None:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise RendezvousStateError(
            f"etcd at {endpoint} sent a {what} that is not an integer: {value!r}"
        ) from None


def prefix_range_end(prefix: bytes) -> bytes:
    r"""Return the ``range_end`` that selects every key starting with ``prefix``.

    That is the prefix with its last byte below 0xff incremented (``b"\\0"``
    if every byte is 0xff, or there is none, meaning "to the end of the keyspace").
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


# -- requests -----------------------------------------------------------------


def range_request(
    key: bytes,
    prefix: bool = False,
    limit: int = 0,
    sort_by_create: bool = False,
    keys_only: bool = False,
    count_only: bool = False,
    serializable: bool = False,
) -> dict[str, Any]:
    """Build a range request (for ``/v3/kv/range`` or inside a txn).

    Args:
        key: The key, or the prefix when ``prefix`` is set.
        prefix: Select every key starting with ``key``.
        limit: The most keys to return (0: no limit).
        sort_by_create: Sort by creation revision, oldest first.
        keys_only: Leave the values out.
        count_only: Return only the count.
        serializable: Answer from the member's own copy, without asking
            the leader (may be stale; for diagnostics).
    """
    request: dict[str, Any] = {"key": encode_bytes(key)}
    if prefix:
        request["range_end"] = encode_bytes(prefix_range_end(key))
    if limit:
        request["limit"] = limit
    if sort_by_create:
        request["sort_order"] = "ASCEND"
        request["sort_target"] = "CREATE"
    if keys_only:
        request["keys_only"] = True
    if count_only:
        request["count_only"] = True
    if serializable:
        request["serializable"] = True
    return request


def put_request(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    """Build a put request (``lease`` 0: none), for ``/v3/kv/put`` or inside a txn."""
    request: dict[str, Any] = {"key": encode_bytes(key), "value": encode_bytes(value)}
    if lease:
        request["lease"] = str(lease)
    return request


def delete_request(key: bytes, prefix: bool = False) -> dict[str, Any]:
    """Build a delete-range request for ``key`` (``prefix``: every key under it)."""
    request: dict[str, Any] = {"key": encode_bytes(key)}
    if prefix:
        request["range_end"] = encode_bytes(prefix_range_end(key))
    return request


def mod_revision_compare(key: bytes, mod_revision: int) -> dict[str, Any]:
    """Build a txn compare that holds while ``key``'s ``mod_revision`` is ``mod_revision``.

    A ``mod_revision`` of 0 means "the key does not exist".
    """
    return {
        "key": encode_bytes(key),
        "target": "MOD",
        "result": "EQUAL",
        "mod_revision": mod_revision,
    }


def lease_grant_request(ttl: int) -> dict[str, Any]:
    """Build a lease grant request for ``ttl`` whole seconds.

    Raises:
        ValueError: ``ttl`` is below 1.
    """
    if ttl < 1:
        raise ValueError(f"a lease TTL must be at least 1 second, got {ttl!r}")
    return {"TTL": str(ttl)}


def lease_id_request(lease_id: int) -> dict[str, Any]:
    """Build the request naming one lease (for keep-alive and revoke)."""
    return {"ID": str(lease_id)}


def watch_request(key: bytes, start_revision: int, prefix: bool = False) -> dict[str, Any]:
    """Build the request that watches ``key`` (``prefix``: every key under it) from a revision."""
    create: dict[str, Any] = {"key": encode_bytes(key), "start_revision": str(start_revision)}
    if prefix:
        create["range_end"] = encode_bytes(prefix_range_end(key))
    return {"create_request": create}


# -- replies ------------------------------------------------------------------


def _request_error(
    status: int, body: dict[str, Any], data: bytes, endpoint: str, path: str
) -> EtcdRequestError:
    """Classify an error body by its gRPC code (and the HTTP status).

    An :class:`EtcdUnavailableError` for a code in :data:`TRANSIENT_CODES`, a
    502, 503 or 504 status or etcd's "too many requests", an
    :class:`EtcdRejectedError` otherwise.
    """
    message = str(body.get("message") or body.get("error") or data[:200])
    code = body.get("code")
    if not isinstance(code, int) or isinstance(code, bool):
        code = GrpcCode.UNKNOWN
    busy = TOO_MANY_REQUESTS in message
    if code in TRANSIENT_CODES or status in _TRANSIENT_HTTP_STATUSES or busy:
        return EtcdUnavailableError(code, message, endpoint)
    return EtcdRejectedError(code, message, f"etcd at {endpoint} rejected {path} (HTTP {status})")


def decode_reply(status: int, data: bytes, endpoint: str, path: str) -> dict[str, Any]:
    """Decode the answer (``status`` and body ``data``) to a unary call to ``path``.

    Raises:
        EtcdRetryableError: The body is not JSON (a proxy's page, a cut
            reply); an :class:`EtcdUnavailableError` for a transient error
            body.
        EtcdRejectedError: etcd refused the call.
        RendezvousStateError: The body is JSON but not an object.
    """
    try:
        decoded = json.loads(data) if data else {}
    except ValueError:
        raise EtcdRetryableError(
            f"{endpoint}: HTTP {status} with a body that is not JSON: {data[:200]!r}"
        ) from None
    if not isinstance(decoded, dict):
        raise RendezvousStateError(f"etcd at {endpoint} answered {path} with {decoded!r}")
    if status != 200 or "error" in decoded:
        raise _request_error(status, decoded, data, endpoint, path)
    return decoded


def parse_kv(raw: dict[str, Any], endpoint: str) -> KeyValue:
    """Parse one ``mvccpb.KeyValue`` object.

    Raises:
        RendezvousStateError: A field is malformed.
    """
    return KeyValue(
        key=decode_bytes(raw.get("key"), "key", endpoint),
        value=decode_bytes(raw.get("value"), "value", endpoint),
        mod_revision=parse_int(raw.get("mod_revision"), "mod_revision", endpoint),
        create_revision=parse_int(raw.get("create_revision"), "create_revision", endpoint),
        version=parse_int(raw.get("version"), "version", endpoint),
        lease=parse_int(raw.get("lease"), "lease", endpoint),
    )


def parse_revision(reply: dict[str, Any], endpoint: str) -> int:
    """Return the store revision in a reply's header (0 when absent)."""
    header = reply.get("header") or {}
    return parse_int(header.get("revision"), "revision", endpoint)


def parse_range(reply: dict[str, Any], endpoint: str) -> tuple[list[KeyValue], int]:
    """Return ``(kvs, revision)`` of a range reply (top level or a txn's ``response_range``)."""
    kvs = [parse_kv(raw, endpoint) for raw in reply.get("kvs") or []]
    return kvs, parse_revision(reply, endpoint)


def parse_count(reply: dict[str, Any], endpoint: str) -> int:
    """Return the ``count`` of a range reply."""
    return parse_int(reply.get("count"), "count", endpoint)


def parse_deleted(reply: dict[str, Any], endpoint: str) -> int:
    """Return how many keys a delete-range reply reports deleted."""
    return parse_int(reply.get("deleted"), "deleted", endpoint)


def parse_txn(reply: dict[str, Any], attempts: int, endpoint: str) -> TxnResult:
    """Return the result of a txn reply to a request sent ``attempts`` times."""
    return TxnResult(
        succeeded=bool(reply.get("succeeded", False)),
        revision=parse_revision(reply, endpoint),
        responses=list(reply.get("responses") or []),
        attempts=attempts,
    )


def txn_range_kvs(result: TxnResult, index: int, endpoint: str) -> list[KeyValue]:
    """Return the keys read by the ``index``-th op (a range) of a txn's branch.

    Raises:
        RendezvousStateError: The txn reply has no such response.
    """
    try:
        reply = result.responses[index].get("response_range") or {}
    except (IndexError, AttributeError):
        raise RendezvousStateError(
            f"etcd at {endpoint} sent a txn answer without response {index}"
        ) from None
    return parse_range(reply, endpoint)[0]


def parse_lease_grant(reply: dict[str, Any], endpoint: str) -> tuple[int, int]:
    """Parse a lease grant reply into ``(lease_id, granted_ttl)``.

    Raises:
        RendezvousStateError: The reply carries an error or a malformed field.
    """
    if reply.get("error"):
        raise RendezvousStateError(f"etcd at {endpoint} refused a lease: {reply['error']}")
    return parse_int(reply.get("ID"), "lease ID", endpoint), parse_int(
        reply.get("TTL"), "TTL", endpoint
    )


def parse_keepalive(reply: dict[str, Any], endpoint: str) -> int:
    """Return the TTL a keep-alive reply gives the lease (0 or less: expired or unknown)."""
    result = reply.get("result") or {}
    return parse_int(result.get("TTL"), "TTL", endpoint)


def decode_watch_line(line: bytes, endpoint: str) -> dict[str, Any] | None:
    """Decode one line of a watch stream; None for a blank line or a JSON non-object (skipped).

    Raises:
        EtcdRetryableError: The line is not JSON.
    """
    if not line.strip():
        return None
    try:
        message = json.loads(line)
    except ValueError:
        raise EtcdRetryableError(
            f"{endpoint}: the watch stream sent a line that is not JSON: {line[:200]!r}"
        ) from None
    return message if isinstance(message, dict) else None


def watch_events(message: dict[str, Any], endpoint: str) -> list[WatchEvent]:
    """Return the events of one watch-stream message (none for ``created`` and progress notices).

    Raises:
        EtcdCompactedError: The watch was cancelled because its start
            revision was compacted.
        EtcdRetryableError: The stream reports an error, or the watch was
            cancelled for another reason.
        RendezvousStateError: An event is malformed.
    """
    result = message.get("result")
    if not isinstance(result, dict):
        error = message.get("error") or message
        raise EtcdRetryableError(f"{endpoint}: watch failed: {error}")
    if result.get("canceled"):
        compact = parse_int(result.get("compact_revision"), "revision", endpoint)
        if compact:
            raise EtcdCompactedError(endpoint, compact)
        reason = result.get("cancel_reason", "no reason given")
        raise EtcdRetryableError(f"{endpoint}: watch cancelled: {reason}")
    return [
        WatchEvent(kind=str(raw.get("type") or "PUT"), kv=parse_kv(raw.get("kv") or {}, endpoint))
        for raw in result.get("events") or []
    ]
