"""The etcd JSON-gateway builders and parsers, without an etcd server."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from rdzv.backends.etcd.gateway_codec import (
    LEASE_NOT_FOUND,
    EtcdCompactedError,
    EtcdRejectedError,
    EtcdRequestError,
    EtcdRetryableError,
    EtcdUnavailableError,
    GrpcCode,
    KeyValue,
    TxnResult,
    WatchEvent,
    decode_bytes,
    decode_reply,
    decode_watch_line,
    delete_request,
    encode_bytes,
    lease_grant_request,
    lease_id_request,
    mod_revision_compare,
    parse_count,
    parse_deleted,
    parse_int,
    parse_keepalive,
    parse_kv,
    parse_lease_grant,
    parse_range,
    parse_txn,
    prefix_range_end,
    put_request,
    range_request,
    txn_range_kvs,
    watch_events,
    watch_request,
)
from rdzv.errors import RendezvousConnectionError, RendezvousStateError

EP = "http://127.0.0.1:2379"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


# -- base64 and integers ------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"/rdzv/run", bytes(range(256)), b"\xff" * 7])
def test_bytes_round_trip_through_base64(data: bytes) -> None:
    text = encode_bytes(data)
    assert text == b64(data)
    assert decode_bytes(text, "key", EP) == data


def test_absent_bytes_field_decodes_as_empty() -> None:
    assert decode_bytes(None, "value", EP) == b""


@pytest.mark.parametrize("text", ["not base64!", "abc", "YQ=?"])
def test_bytes_field_that_is_not_base64_is_a_state_error(text: str) -> None:
    with pytest.raises(RendezvousStateError, match=f"etcd at {EP} sent a value that is not base64"):
        decode_bytes(text, "value", EP)


@pytest.mark.parametrize(("value", "expected"), [("42", 42), (7, 7), ("-3", -3), (None, 0)])
def test_int_fields_parse_from_strings_and_numbers(value: Any, expected: int) -> None:
    assert parse_int(value, "revision", EP) == expected


@pytest.mark.parametrize("value", ["x", "1.5", "", [1], {"a": 1}])
def test_int_field_that_is_not_an_integer_is_a_state_error_naming_it(value: Any) -> None:
    with pytest.raises(
        RendezvousStateError, match="sent a mod_revision that is not an integer"
    ) as info:
        parse_int(value, "mod_revision", EP)
    assert repr(value) in str(info.value)


# -- prefix range end ------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "end"),
    [
        (b"/a/", b"/a0"),
        (b"a", b"b"),
        (b"a\xfe", b"a\xff"),
        (b"a\xff", b"b"),
        (b"ab\xff\xff", b"ac"),
        (b"\x00", b"\x01"),
    ],
)
def test_prefix_range_end_increments_the_last_byte_below_0xff(prefix: bytes, end: bytes) -> None:
    assert prefix_range_end(prefix) == end


@pytest.mark.parametrize("prefix", [b"\xff", b"\xff\xff\xff", b""])
def test_prefix_range_end_of_all_0xff_or_empty_prefix_is_end_of_keyspace(prefix: bytes) -> None:
    assert prefix_range_end(prefix) == b"\0"


@pytest.mark.parametrize("prefix", [b"/a/", b"a\xff", b"ab\xff\xff", b"\x00"])
def test_prefix_range_covers_the_keys_with_the_prefix_and_ends_outside_it(prefix: bytes) -> None:
    end = prefix_range_end(prefix)
    for suffix in (b"", b"\x00", b"z", b"\xff" * 4):
        assert prefix <= prefix + suffix < end
    assert not end.startswith(prefix)


# -- requests -----------------------------------------------------------------


def test_range_request_encodes_key_and_prefix_end_and_only_set_flags() -> None:
    assert range_request(b"/k") == {"key": b64(b"/k")}
    request = range_request(
        b"/p/", prefix=True, limit=3, sort_by_create=True, keys_only=True, count_only=True
    )
    assert request == {
        "key": b64(b"/p/"),
        "range_end": b64(b"/p0"),
        "limit": 3,
        "sort_order": "ASCEND",
        "sort_target": "CREATE",
        "keys_only": True,
        "count_only": True,
    }
    assert range_request(b"/k", serializable=True)["serializable"] is True


def test_put_request_sends_the_lease_as_a_string_and_only_when_set() -> None:
    assert put_request(b"k", b"v") == {"key": b64(b"k"), "value": b64(b"v")}
    assert put_request(b"k", b"v", lease=2**62)["lease"] == str(2**62)


def test_delete_request_has_a_range_end_only_for_a_prefix() -> None:
    assert delete_request(b"/k") == {"key": b64(b"/k")}
    assert delete_request(b"/k/", prefix=True) == {"key": b64(b"/k/"), "range_end": b64(b"/k0")}


def test_mod_revision_compare_targets_the_key_modification_revision() -> None:
    assert mod_revision_compare(b"k", 9) == {
        "key": b64(b"k"),
        "target": "MOD",
        "result": "EQUAL",
        "mod_revision": 9,
    }


def test_lease_requests_send_int64_as_strings() -> None:
    assert lease_grant_request(30) == {"TTL": "30"}
    assert lease_id_request(123) == {"ID": "123"}


@pytest.mark.parametrize("ttl", [0, -1])
def test_lease_ttl_below_one_second_is_refused(ttl: int) -> None:
    with pytest.raises(ValueError, match="at least 1 second"):
        lease_grant_request(ttl)


def test_watch_request_sends_start_revision_as_string_and_range_end_for_a_prefix() -> None:
    assert watch_request(b"/k", 5) == {"create_request": {"key": b64(b"/k"), "start_revision": "5"}}
    create = watch_request(b"/k/", 5, prefix=True)["create_request"]
    assert create["range_end"] == b64(b"/k0")


# -- unary replies ------------------------------------------------------------


def test_reply_fields_left_out_by_proto3_parse_as_zero_values() -> None:
    assert parse_kv({}, EP) == KeyValue(b"", b"", 0, 0, 0, 0)
    assert parse_range({}, EP) == ([], 0)
    assert parse_count({}, EP) == 0
    assert parse_deleted({}, EP) == 0
    assert parse_txn({}, 1, EP) == TxnResult(succeeded=False, revision=0, responses=[], attempts=1)


def test_range_reply_decodes_keys_values_and_int64_strings() -> None:
    raw = {
        "key": b64(b"/k"),
        "value": b64(b"\x00v"),
        "mod_revision": "12",
        "create_revision": "10",
        "version": "3",
        "lease": "7587",
    }
    kvs, revision = parse_range({"header": {"revision": "12"}, "kvs": [raw], "count": "1"}, EP)
    assert kvs == [KeyValue(b"/k", b"\x00v", 12, 10, 3, 7587)]
    assert revision == 12


def test_txn_reply_and_its_range_responses() -> None:
    reply = {
        "header": {"revision": "20"},
        "succeeded": True,
        "responses": [{"response_put": {}}, {"response_range": {"kvs": [{"key": b64(b"a")}]}}],
    }
    result = parse_txn(reply, 2, EP)
    assert (result.succeeded, result.revision, result.attempts) == (True, 20, 2)
    assert [kv.key for kv in txn_range_kvs(result, 1, EP)] == [b"a"]
    assert txn_range_kvs(result, 0, EP) == []


@pytest.mark.parametrize("responses", [[], ["not an object"]])
def test_txn_range_kvs_without_that_response_is_a_state_error(responses: list[Any]) -> None:
    result = TxnResult(succeeded=True, revision=1, responses=responses, attempts=1)
    with pytest.raises(RendezvousStateError, match="without response 0"):
        txn_range_kvs(result, 0, EP)


def test_lease_grant_reply_parses_id_and_ttl() -> None:
    assert parse_lease_grant({"ID": "3994308228573953802", "TTL": "5"}, EP) == (
        3994308228573953802,
        5,
    )


def test_lease_grant_reply_with_an_error_is_a_state_error() -> None:
    with pytest.raises(RendezvousStateError, match="refused a lease: too many"):
        parse_lease_grant({"error": "too many"}, EP)


def test_keepalive_of_an_unknown_lease_has_no_ttl_and_parses_as_zero() -> None:
    assert parse_keepalive({"result": {"ID": "12345"}}, EP) == 0
    assert parse_keepalive({"result": {"ID": "12345", "TTL": "9"}}, EP) == 9


# -- decode_reply and error bodies --------------------------------------------


def test_ok_reply_decodes_to_its_object_and_empty_body_to_empty_reply() -> None:
    assert decode_reply(200, body({"header": {"revision": "3"}}), EP, "/v3/kv/put") == {
        "header": {"revision": "3"}
    }
    assert decode_reply(200, b"", EP, "/v3/kv/put") == {}


@pytest.mark.parametrize("data", [b"Not Found\n", b"<html>bad gateway</html>", b"\xff\xfe"])
def test_body_that_is_not_json_is_retryable_and_not_a_request_error(data: bytes) -> None:
    with pytest.raises(EtcdRetryableError, match="body that is not JSON") as info:
        decode_reply(404, data, EP, "/v3/kv/put")
    assert not isinstance(info.value, EtcdRequestError)


def test_json_body_that_is_not_an_object_is_a_final_state_error() -> None:
    with pytest.raises(RendezvousStateError, match=r"answered /v3/kv/range with \[1, 2\]") as info:
        decode_reply(200, b"[1, 2]", EP, "/v3/kv/range")
    assert not isinstance(info.value, (EtcdRequestError, RendezvousConnectionError))


LEASE_MISSING = "etcdserver: requested lease not found"


@pytest.mark.parametrize(
    "error_body",
    [
        {"error": LEASE_MISSING, "message": LEASE_MISSING, "code": 5},  # etcd 3.4
        {"code": 5, "message": LEASE_MISSING, "details": []},  # etcd 3.5 and later
    ],
)
def test_lease_not_found_body_is_a_final_request_error_with_its_code(
    error_body: dict[str, Any],
) -> None:
    with pytest.raises(EtcdRejectedError) as info:
        decode_reply(404, body(error_body), EP, "/v3/kv/put")
    exc = info.value
    assert exc.code == LEASE_NOT_FOUND == GrpcCode.NOT_FOUND
    assert exc.code == 5
    assert exc.message == LEASE_MISSING
    assert isinstance(exc, RendezvousStateError)
    assert not isinstance(exc, RendezvousConnectionError)
    assert str(exc) == f"etcd at {EP} rejected /v3/kv/put (HTTP 404): {LEASE_MISSING}"


@pytest.mark.parametrize(
    ("status", "code", "message"),
    [
        (503, 14, "etcdserver: no leader"),
        (503, 14, "etcdserver: leader changed"),
        (503, 14, "etcdserver: not capable"),
        (503, 14, "etcdserver: server stopped"),
        (503, 14, "etcdserver: request timed out"),
        (408, 1, "grpc: the client connection is closing"),
        (504, 4, "context deadline exceeded"),
        (500, 8, "etcdserver: too many requests"),  # etcd's backpressure: back off
        (500, 2, "etcdserver: too many requests"),  # as etcd 3.4's gateway answers it
    ],
)
def test_transient_codes_are_retryable_connection_errors(
    status: int, code: int, message: str
) -> None:
    with pytest.raises(EtcdUnavailableError) as info:
        decode_reply(status, body({"error": message, "message": message, "code": code}), EP, "/p")
    exc = info.value
    assert exc.code == code
    assert exc.message == message
    assert isinstance(exc, EtcdRetryableError)
    assert isinstance(exc, RendezvousConnectionError)
    assert not isinstance(exc, RendezvousStateError)
    assert str(exc) == f"{EP}: {message}"


@pytest.mark.parametrize(
    ("status", "code", "message"),
    [
        (400, 3, "illegal base64 data at input byte 0"),
        (400, 9, "etcdserver: not leader"),
        (400, 11, "etcdserver: mvcc: required revision is a future revision"),
        (500, 8, "etcdserver: mvcc: database space exceeded"),
        (403, 7, "etcdserver: permission denied"),
    ],
)
def test_other_codes_are_final_state_errors(status: int, code: int, message: str) -> None:
    with pytest.raises(EtcdRejectedError) as info:
        decode_reply(status, body({"code": code, "message": message}), EP, "/p")
    assert info.value.code == code
    assert not isinstance(info.value, RendezvousConnectionError)


@pytest.mark.parametrize("status", [502, 503, 504])
def test_gateway_statuses_are_retryable_whatever_the_code(status: int) -> None:
    with pytest.raises(EtcdUnavailableError) as info:
        decode_reply(status, body({"code": 9, "message": "upstream"}), EP, "/p")
    assert info.value.code == 9


@pytest.mark.parametrize("code", [None, "14", True])
def test_error_body_without_an_integer_code_has_code_unknown(code: Any) -> None:
    error_body: dict[str, Any] = {"message": "boom"}
    if code is not None:
        error_body["code"] = code
    with pytest.raises(EtcdRejectedError) as info:
        decode_reply(500, body(error_body), EP, "/p")
    assert info.value.code == GrpcCode.UNKNOWN


def test_error_key_in_a_200_reply_is_an_error() -> None:
    with pytest.raises(EtcdRejectedError, match=r"\(HTTP 200\): it broke"):
        decode_reply(200, body({"error": "it broke", "code": 2}), EP, "/p")


def test_error_message_falls_back_to_error_then_raw_body() -> None:
    with pytest.raises(EtcdRejectedError) as info:
        decode_reply(400, body({"error": "only error", "code": 3}), EP, "/p")
    assert info.value.message == "only error"
    with pytest.raises(EtcdRejectedError) as info:
        decode_reply(400, b'{"code": 3}', EP, "/p")
    assert info.value.message == repr(b'{"code": 3}')


def test_request_error_text_without_context_is_the_message() -> None:
    exc = EtcdRejectedError(5, LEASE_MISSING)
    assert (exc.code, exc.message, str(exc)) == (5, LEASE_MISSING, LEASE_MISSING)


# -- watch stream -------------------------------------------------------------


def test_watch_line_decodes_to_its_object() -> None:
    line = body({"result": {"created": True}}) + b"\n"
    assert decode_watch_line(line, EP) == {"result": {"created": True}}


@pytest.mark.parametrize("line", [b"\n", b"  \r\n", b"[1]\n", b'"text"\n', b"3\n"])
def test_blank_lines_and_json_non_objects_are_skipped(line: bytes) -> None:
    assert decode_watch_line(line, EP) is None


@pytest.mark.parametrize("line", [b'{"result": \n', b"garbage\n", b"\xff\xfe\n"])
def test_watch_line_that_is_not_json_is_retryable(line: bytes) -> None:
    with pytest.raises(EtcdRetryableError, match="watch stream sent a line that is not JSON"):
        decode_watch_line(line, EP)


def test_created_message_has_no_events() -> None:
    assert watch_events({"result": {"header": {"revision": "1"}, "created": True}}, EP) == []


def test_watch_events_decode_kind_and_kv_with_put_as_default_kind() -> None:
    message = {
        "result": {
            "events": [
                {"kv": {"key": b64(b"k"), "value": b64(b"1"), "mod_revision": "4"}},
                {"type": "DELETE", "kv": {"key": b64(b"k"), "mod_revision": "5"}},
            ]
        }
    }
    assert watch_events(message, EP) == [
        WatchEvent("PUT", KeyValue(b"k", b"1", 4, 0, 0, 0)),
        WatchEvent("DELETE", KeyValue(b"k", b"", 5, 0, 0, 0)),
    ]


def test_watch_cancelled_for_compaction_raises_with_the_compact_revision() -> None:
    message = {"result": {"canceled": True, "compact_revision": "2"}}
    with pytest.raises(EtcdCompactedError) as info:
        watch_events(message, EP)
    assert info.value.compact_revision == 2
    assert not isinstance(info.value, EtcdRetryableError)


def test_watch_cancelled_for_another_reason_is_retryable() -> None:
    with pytest.raises(EtcdRetryableError, match="watch cancelled: permission denied"):
        watch_events({"result": {"canceled": True, "cancel_reason": "permission denied"}}, EP)


def test_watch_stream_error_message_is_retryable() -> None:
    message = {"error": {"grpc_code": 14, "message": "etcdserver: no leader"}}
    with pytest.raises(EtcdRetryableError, match=r"watch failed: .*no leader"):
        watch_events(message, EP)


def test_watch_event_with_a_malformed_kv_is_a_state_error() -> None:
    message = {"result": {"events": [{"kv": {"key": "!!", "mod_revision": "4"}}]}}
    with pytest.raises(RendezvousStateError, match="sent a key that is not base64"):
        watch_events(message, EP)
