"""etcd's protobuf messages as rdzv writes and reads them (sans-I/O; the wire is tested on both clients)."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdzv.backends.etcd import grpc_proto as proto
from rdzv.backends.etcd.client import ConnectFailedError
from rdzv.backends.etcd.gateway_codec import (
    EtcdCompactedError,
    EtcdRejectedError,
    EtcdRetryableError,
    KeyValue,
    mod_revision_compare,
    put_request,
    range_request,
)
from rdzv.backends.etcd.grpc import EtcdGrpcClient


def _kv(kv: KeyValue) -> bytes:
    return b"".join(
        (
            proto._bytes(1, kv.key),
            proto._int(2, kv.create_revision),
            proto._int(3, kv.mod_revision),
            proto._int(4, kv.version),
            proto._bytes(5, kv.value),
            proto._int(6, kv.lease),
        )
    )


HEADER = proto._nested(1, proto._int(3, 77))  # a ResponseHeader at revision 77
KV = KeyValue(b"/k", b"v", mod_revision=70, create_revision=60, version=3, lease=2**62)


def test_requests_carry_etcds_field_numbers_and_leave_zero_fields_out() -> None:
    assert proto.range_message(b"k") == b"\x0a\x01k"
    assert proto.range_message(b"k", b"l", limit=2, sort_by_create=True, count_only=True) == (
        b"\x0a\x01k\x12\x01l\x18\x02\x28\x01\x30\x02\x48\x01"
    )
    assert proto.put_message(b"k", b"", lease=1) == b"\x0a\x01k\x18\x01"
    assert proto.watch_message(b"k", 5) == b"\x0a\x05\x0a\x01k\x18\x05"
    # A negative int64 is ten bytes of two's complement.
    assert proto.lease_id_message(-1) == b"\x08" + b"\xff" * 9 + b"\x01"
    with pytest.raises(ValueError, match="at least 1 second"):
        proto.lease_grant_message(0)


def test_a_txn_is_encoded_from_the_json_mapping_and_a_zero_mod_revision_is_sent() -> None:
    message = proto.txn_message(
        [mod_revision_compare(b"k", 0)],
        [{"request_put": put_request(b"k", b"v", 3)}],
        [{"request_range": range_request(b"k/", prefix=True, sort_by_create=True)}],
    )
    compare = b"\x10\x02\x1a\x01k\x30\x00"  # target MOD, key, mod_revision 0 (a oneof)
    put = b"\x12\x08" + b"\x0a\x01k\x12\x01v\x18\x03"
    ranged = b"\x0a\x0c" + proto.range_message(b"k/", b"k0", sort_by_create=True)
    assert message == b"\x0a\x07" + compare + b"\x12\x0a" + put + b"\x1a\x0e" + ranged
    with pytest.raises(ValueError, match="request_txn"):
        proto.txn_message([], [{"request_txn": {}}], [])


def test_replies_are_read_into_rdzvs_values() -> None:
    assert proto.decode_range(HEADER + proto._nested(2, _kv(KV)) + proto._int(4, 9)) == (
        [KV],
        9,
        77,
    )
    assert proto.decode_revision(HEADER) == 77
    assert proto.decode_keepalive(HEADER + proto._int(2, 5) + proto._int(3, -1)) == -1
    assert proto.decode_lease_grant(proto._int(2, 5) + proto._int(3, 10)) == (5, 10, "")
    ranged = proto._nested(1, proto._nested(2, _kv(KV)) + proto._int(4, 1))
    reply = HEADER + proto._int(2, 1) + proto._nested(3, ranged) + proto._nested(3, b"\x12\x00")
    assert proto.decode_txn(reply) == (
        True,
        77,
        [{"response_range": {"kvs": [KV], "count": 1}}, {"response_put": {}}],
    )


def test_watch_replies_give_events_or_the_reason_the_watch_ended() -> None:
    delete = proto._nested(11, proto._int(1, 1) + proto._nested(2, _kv(KV)))
    (event,) = proto.decode_watch(HEADER + delete, "e")
    assert (event.kind, event.kv) == ("DELETE", KV)
    assert proto.decode_watch(HEADER + proto._int(3, 1), "e") == []  # created
    with pytest.raises(EtcdCompactedError) as info:
        proto.decode_watch(proto._int(4, 1) + proto._int(5, 40), "e")
    assert info.value.compact_revision == 40
    with pytest.raises(EtcdRetryableError, match="cancelled: gone"):
        proto.decode_watch(proto._int(4, 1) + proto._bytes(6, b"gone"), "e")


@given(st.binary(max_size=64))
def test_garbage_only_ever_raises_the_malformed_message_error(data: bytes) -> None:
    decoders = (
        proto.decode_range,
        proto.decode_txn,
        proto.decode_lease_grant,
        lambda data: proto.decode_watch(data, "e"),
    )
    for decode in decoders:
        with contextlib.suppress(proto.MalformedMessageError, EtcdRetryableError):
            decode(data)


class _RpcError:
    """A failed gRPC call as grpcio's error reports it: a status code and its details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details", "retryable"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests", True),
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: leader changed", True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded", False),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided", False),
    ],
)
def test_grpc_errors_are_retried_as_the_gateways_are(
    code: grpc.StatusCode, details: str, retryable: bool
) -> None:
    client = EtcdGrpcClient([("127.0.0.1", 2379)])
    try:
        error = client._error(_RpcError(code, details), "http://127.0.0.1:2379", "put")
    finally:
        client.close()
    assert isinstance(error, EtcdRetryableError) is retryable
    assert isinstance(error, EtcdRejectedError) is not retryable
    assert details in str(error)


_SHUTDOWN = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: handshaker shutdown"


def test_a_handshake_cut_short_over_http_is_a_failed_connection_not_tls() -> None:
    # A member too loaded to finish HTTP/2's connection setup (8,192 nodes on
    # two cores): over http there is no TLS to blame, and the next member is tried.
    client = EtcdGrpcClient([("127.0.0.1", 2379)])
    try:
        error = client._error(
            _RpcError(grpc.StatusCode.UNAVAILABLE, _SHUTDOWN), "http://127.0.0.1:2379", "range"
        )
    finally:
        client.close()
    assert isinstance(error, ConnectFailedError)
    assert "TLS" not in str(error)
    assert "handshaker shutdown" in str(error)
