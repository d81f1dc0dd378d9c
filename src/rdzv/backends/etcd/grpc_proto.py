"""etcd v3 protobuf encoding: the few messages rdzv sends over gRPC, with no I/O.

Theory of operation
-------------------
The gRPC client (:mod:`rdzv.backends.etcd.grpc`) sends etcd's own messages,
``etcdserverpb`` and ``mvccpb``, as protobuf bytes. rdzv uses a dozen of
them and a few fields of each, so they are written and read here by field
number (the numbers of etcd's ``rpc.proto`` and ``kv.proto``), with no
protobuf runtime and no generated code: a field is a varint tag
(``number << 3 | wire type``) followed by a varint (integers, booleans,
enums) or a length and that many bytes (bytes, strings, nested messages).
Zero and empty fields are left out, as proto3 does, except the
``mod_revision`` of a compare: it belongs to a ``oneof``, which is sent
even when zero. int64 fields travel as 64-bit two's complement varints.

A transaction's operations reach this module in the form the backend and
the store build them for either client: etcd's JSON mapping of
``RequestOp`` and ``Compare`` (:mod:`rdzv.backends.etcd.gateway_codec`'s
builders, base64 keys). :func:`txn_message` turns them into protobuf; a
reply's operations come back as the JSON mapping's shape, with
:class:`~rdzv.backends.etcd.gateway_codec.KeyValue` objects in place of raw keys
(``{"response_range": {"kvs": [...], "count": n}}``).

A malformed reply raises :class:`MalformedMessageError`; the client names
the member.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

from rdzv.backends.etcd.gateway_codec import (
    EtcdCompactedError,
    EtcdRetryableError,
    KeyValue,
    WatchEvent,
)

__all__ = [
    "MalformedMessageError",
    "decode_deleted",
    "decode_keepalive",
    "decode_lease_grant",
    "decode_range",
    "decode_revision",
    "decode_txn",
    "decode_watch",
    "delete_message",
    "lease_grant_message",
    "lease_id_message",
    "put_message",
    "range_message",
    "txn_message",
    "watch_message",
]

_VARINT = 0
_FIXED64 = 1
_LENGTH = 2
_FIXED32 = 5
_INT64_WRAP = 1 << 64
_INT64_SIGN = 1 << 63

# The JSON mapping's enum names, as the builders write them, and their numbers.
_SORT_ORDERS = {"NONE": 0, "ASCEND": 1, "DESCEND": 2}
_SORT_TARGETS = {"KEY": 0, "VERSION": 1, "CREATE": 2, "MOD": 3, "VALUE": 4}
_COMPARE_RESULTS = {"EQUAL": 0, "GREATER": 1, "LESS": 2, "NOT_EQUAL": 3}
_COMPARE_MOD = 2  # Compare.target MOD
_COMPARE_MOD_REVISION = 6  # Compare.mod_revision, in the target_union oneof
_EVENT_KINDS = {0: "PUT", 1: "DELETE"}


# -- writing ------------------------------------------------------------------


def _varint(value: int) -> bytes:
    if value < 0:
        value += _INT64_WRAP
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value) if value else b""


def _bytes(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | _LENGTH) + _varint(len(data)) + data if data else b""


def _nested(field: int, message: bytes) -> bytes:
    return _varint(field << 3 | _LENGTH) + _varint(len(message)) + message


def range_message(
    key: bytes,
    range_end: bytes = b"",
    limit: int = 0,
    sort_by_create: bool = False,
    keys_only: bool = False,
    count_only: bool = False,
    serializable: bool = False,
) -> bytes:
    """Return a ``RangeRequest`` (``range_end``: the end of a prefix, or empty for one key)."""
    return b"".join(
        (
            _bytes(1, key),
            _bytes(2, range_end),
            _int(3, limit),
            _int(5, _SORT_ORDERS["ASCEND"] if sort_by_create else 0),
            _int(6, _SORT_TARGETS["CREATE"] if sort_by_create else 0),
            _int(7, serializable),
            _int(8, keys_only),
            _int(9, count_only),
        )
    )


def put_message(key: bytes, value: bytes, lease: int = 0) -> bytes:
    """Return a ``PutRequest`` (``lease`` 0: none)."""
    return _bytes(1, key) + _bytes(2, value) + _int(3, lease)


def delete_message(key: bytes, range_end: bytes = b"") -> bytes:
    """Return a ``DeleteRangeRequest``."""
    return _bytes(1, key) + _bytes(2, range_end)


def lease_grant_message(ttl: int) -> bytes:
    """Return a ``LeaseGrantRequest`` for ``ttl`` whole seconds.

    Raises:
        ValueError: ``ttl`` is below 1.
    """
    if ttl < 1:
        raise ValueError(f"a lease TTL must be at least 1 second, got {ttl!r}")
    return _int(1, ttl)


def lease_id_message(lease_id: int) -> bytes:
    """Return the request naming one lease (``LeaseKeepAliveRequest``, ``LeaseRevokeRequest``)."""
    return _int(1, lease_id)


def watch_message(key: bytes, start_revision: int, range_end: bytes = b"") -> bytes:
    """Return a ``WatchRequest`` creating a watch of ``key`` (to ``range_end``) from a revision."""
    return _nested(1, _bytes(1, key) + _bytes(2, range_end) + _int(3, start_revision))


def _b64(body: dict[str, Any], name: str) -> bytes:
    return base64.b64decode(body.get(name) or "", validate=True)


def _request_op(op: dict[str, Any]) -> bytes:
    """Encode one ``RequestOp`` from its JSON mapping."""
    ((kind, body),) = op.items()
    if kind == "request_range":
        return _nested(
            1,
            range_message(
                _b64(body, "key"),
                _b64(body, "range_end"),
                int(body.get("limit", 0)),
                body.get("sort_target") == "CREATE" and body.get("sort_order") == "ASCEND",
                bool(body.get("keys_only")),
                bool(body.get("count_only")),
                bool(body.get("serializable")),
            ),
        )
    if kind == "request_put":
        return _nested(
            2, put_message(_b64(body, "key"), _b64(body, "value"), int(body.get("lease", 0)))
        )
    if kind == "request_delete_range":
        return _nested(3, delete_message(_b64(body, "key"), _b64(body, "range_end")))
    raise ValueError(f"rdzv's etcd gRPC client cannot send a {kind!r} operation")


def _compare(compare: dict[str, Any]) -> bytes:
    """Encode one ``Compare`` of a ``mod_revision`` from its JSON mapping."""
    if compare.get("target") != "MOD":
        raise ValueError(f"rdzv's etcd gRPC client compares mod_revision only, got {compare!r}")
    return (
        _int(1, _COMPARE_RESULTS[compare.get("result", "EQUAL")])
        + _int(2, _COMPARE_MOD)
        + _bytes(3, _b64(compare, "key"))
        + _varint(_COMPARE_MOD_REVISION << 3)
        + _varint(int(compare.get("mod_revision", 0)))
    )


def txn_message(
    compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]]
) -> bytes:
    """Return a ``TxnRequest`` from the JSON mapping of its compares and operations.

    Raises:
        ValueError: An operation rdzv does not use (a nested txn, a compare
            of anything but ``mod_revision``) or a key that is not base64.
    """
    parts = [_nested(1, _compare(c)) for c in compare]
    parts += [_nested(2, _request_op(op)) for op in success]
    parts += [_nested(3, _request_op(op)) for op in failure]
    return b"".join(parts)


# -- reading ------------------------------------------------------------------


class MalformedMessageError(ValueError):
    """A reply is not the protobuf message it should be."""


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise MalformedMessageError("a varint runs past its message")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """Yield ``(field number, value)``: an int for a varint, bytes for a length-delimited field.

    Fixed-width fields (none of rdzv's) are skipped.
    """
    pos, end = 0, len(data)
    while pos < end:
        tag, pos = _read_varint(data, pos)
        wire = tag & 7
        if wire == _VARINT:
            value, pos = _read_varint(data, pos)
            yield tag >> 3, value
        elif wire == _LENGTH:
            length, pos = _read_varint(data, pos)
            if pos + length > end:
                raise MalformedMessageError("a field runs past its message")
            yield tag >> 3, data[pos : pos + length]
            pos += length
        elif wire in (_FIXED64, _FIXED32):
            pos += 8 if wire == _FIXED64 else 4
        else:
            raise MalformedMessageError(f"wire type {wire} is not protobuf's")
    if pos > end:
        raise MalformedMessageError("a fixed-width field runs past its message")


def _as_int(value: int | bytes) -> int:
    """Return an int64 field's value."""
    if not isinstance(value, int):
        raise MalformedMessageError("an integer field arrived as bytes")
    return value - _INT64_WRAP if value >= _INT64_SIGN else value


def _as_bytes(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise MalformedMessageError("a bytes field arrived as a varint")
    return value


def _header_revision(data: bytes) -> int:
    return next((_as_int(v) for f, v in _fields(data) if f == 3), 0)


def decode_revision(data: bytes) -> int:
    """Return the store revision in a reply's ``header`` (field 1 of every reply)."""
    return next((_header_revision(_as_bytes(v)) for f, v in _fields(data) if f == 1), 0)


def _kv(data: bytes) -> KeyValue:
    found: dict[int, int | bytes] = dict(_fields(data))
    return KeyValue(
        key=_as_bytes(found.get(1, b"")),
        value=_as_bytes(found.get(5, b"")),
        mod_revision=_as_int(found.get(3, 0)),
        create_revision=_as_int(found.get(2, 0)),
        version=_as_int(found.get(4, 0)),
        lease=_as_int(found.get(6, 0)),
    )


def decode_range(data: bytes) -> tuple[list[KeyValue], int, int]:
    """Return ``(kvs, count, revision)`` of a ``RangeResponse``."""
    kvs: list[KeyValue] = []
    count = revision = 0
    for field, value in _fields(data):
        if field == 1:
            revision = _header_revision(_as_bytes(value))
        elif field == 2:
            kvs.append(_kv(_as_bytes(value)))
        elif field == 4:
            count = _as_int(value)
    return kvs, count, revision


def decode_deleted(data: bytes) -> int:
    """Return how many keys a ``DeleteRangeResponse`` reports deleted."""
    return next((_as_int(v) for f, v in _fields(data) if f == 2), 0)


def _response_op(data: bytes) -> dict[str, Any]:
    for field, value in _fields(data):
        if field == 1:
            kvs, count, _ = decode_range(_as_bytes(value))
            return {"response_range": {"kvs": kvs, "count": count}}
        if field == 3:
            return {"response_delete_range": {"deleted": decode_deleted(_as_bytes(value))}}
        if field == 2:
            return {"response_put": {}}
    return {}


def decode_txn(data: bytes) -> tuple[bool, int, list[dict[str, Any]]]:
    """Return ``(succeeded, revision, responses)`` of a ``TxnResponse``."""
    succeeded = False
    revision = 0
    responses: list[dict[str, Any]] = []
    for field, value in _fields(data):
        if field == 1:
            revision = _header_revision(_as_bytes(value))
        elif field == 2:
            succeeded = bool(_as_int(value))
        elif field == 3:
            responses.append(_response_op(_as_bytes(value)))
    return succeeded, revision, responses


def decode_lease_grant(data: bytes) -> tuple[int, int, str]:
    """Return ``(lease_id, granted_ttl, error)`` of a ``LeaseGrantResponse``."""
    found = dict(_fields(data))
    error = _as_bytes(found.get(4, b"")).decode("utf-8", "replace")
    return _as_int(found.get(2, 0)), _as_int(found.get(3, 0)), error


def decode_keepalive(data: bytes) -> int:
    """Return the TTL a ``LeaseKeepAliveResponse`` gives the lease (0 or less: gone)."""
    return next((_as_int(v) for f, v in _fields(data) if f == 3), 0)


def decode_watch(data: bytes, endpoint: str) -> list[WatchEvent]:
    """Return the events of one ``WatchResponse`` (none for ``created`` and progress notices).

    Raises:
        EtcdCompactedError: The watch was cancelled because its start
            revision was compacted.
        EtcdRetryableError: The watch was cancelled for another reason.
        MalformedMessageError: The message is malformed.
    """
    events: list[WatchEvent] = []
    canceled = False
    compact = 0
    reason = "no reason given"
    for field, value in _fields(data):
        if field == 4:
            canceled = bool(_as_int(value))
        elif field == 5:
            compact = _as_int(value)
        elif field == 6:
            reason = _as_bytes(value).decode("utf-8", "replace")
        elif field == 11:
            event = dict(_fields(_as_bytes(value)))
            kind = _EVENT_KINDS.get(_as_int(event.get(1, 0)), "PUT")
            events.append(WatchEvent(kind=kind, kv=_kv(_as_bytes(event.get(2, b"")))))
    if canceled:
        if compact:
            raise EtcdCompactedError(endpoint, compact)
        raise EtcdRetryableError(f"{endpoint}: watch cancelled: {reason}")
    return events
