"""The sans-I/O codec: every request round-trips whole, in chunks and byte by byte."""

from __future__ import annotations

import random
import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdzv.store import protocol
from rdzv.store.protocol import (
    MAX_KEY_BYTES,
    MAX_MULTI_KEYS,
    MAX_VALUE_BYTES,
    VALIDATE_MAGIC,
    Decoder,
    GetWaitStatus,
    Op,
    ProtocolError,
    ReplyReader,
    Request,
    RequestParser,
    decode_bytes,
    decode_get_wait,
    decode_i64,
    decode_raw,
    decode_u8,
    decode_u32,
    encode_bytes,
    encode_i64,
    encode_request,
    encode_u8,
    encode_u32,
)

SAMPLES = [
    Request(Op.VALIDATE, number=VALIDATE_MAGIC),
    Request(Op.SET, (b"/k",), (b"value",)),
    Request(Op.SET, (b"",), (b"",)),
    Request(Op.COMPARE_SET, (b"/k",), (b"", b"desired")),
    Request(Op.GET, (b"/k",)),
    Request(Op.ADD, (b"/n",), (), -12),
    Request(Op.CHECK, (b"/a", b"/b")),
    Request(Op.CHECK, ()),
    Request(Op.WAIT, (b"/a",)),
    Request(Op.GETNUMKEYS),
    Request(Op.DELETE_KEY, (b"/k",)),
    Request(Op.APPEND, (b"/k",), (b"\x00\xff",)),
    Request(Op.MULTI_GET, (b"/a", b"/b", b"/c")),
    Request(Op.MULTI_SET, (b"/a", b"/b"), (b"1", b"2")),
    Request(Op.CANCEL_WAIT),
    Request(Op.PING, number=4242),
    Request(Op.QUEUE_PUSH, (b"/q",), (b"item",)),
    Request(Op.QUEUE_POP, (b"/q",)),
    Request(Op.QUEUE_LEN, (b"/q",)),
    Request(Op.LIST_KEYS),
    Request(Op.BARRIER, (b"/bar",), (), 8),
    Request(Op.AUTH_CHALLENGE),
    Request(Op.AUTH_RESPONSE, (), (b"n" * 32, b"t" * 32)),
    Request(Op.WATCH, (b"/w",), (), 1500),
    Request(Op.WATCH, (b"/w",), (b"previous",), 0),
    Request(Op.GET_WAIT, (b"/g",), (), 250),
    Request(Op.MULTI_TRY_GET, (b"/a", b"/b")),
]


def parse_all(parser: RequestParser, fast: bool = False, limit: int = 1024) -> list[Request]:
    """Decode every complete request; ``fast``: runs of sets as the server does."""
    out = []
    while True:
        if fast:
            sets = parser.next_sets(limit)
            assert len(sets) <= limit
            out += [Request(Op.SET, (key,), (value,)) for key, value in sets]
        request = parser.next_request()
        if request is None:
            return out
        out.append(request)


def feed_in_chunks(data: bytes, sizes: list[int], fast: bool = False) -> list[Request]:
    parser = RequestParser()
    out: list[Request] = []
    pos = 0
    for size in sizes:
        parser.feed(data[pos : pos + size])
        pos += size
        out += parse_all(parser, fast)
    parser.feed(data[pos:])
    out += parse_all(parser, fast)
    assert parser.pending == 0
    return out


FAST = pytest.mark.parametrize("fast", [False, True], ids=["one-by-one", "set-runs"])


@FAST
@pytest.mark.parametrize("request_", SAMPLES, ids=lambda r: Op(r.op).name)
def test_each_request_round_trips_whole_chunked_and_bytewise(request_: Request, fast: bool) -> None:
    data = encode_request(request_)
    assert data[0] == request_.op
    assert feed_in_chunks(data, [], fast) == [request_]
    assert feed_in_chunks(data, [1] * len(data), fast) == [request_]
    rng = random.Random(len(data))
    sizes = [rng.randint(1, 5) for _ in range(len(data))]
    assert feed_in_chunks(data, sizes, fast) == [request_]


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from([0, 1, 100, 4_000, 5_000, 40_000])),
        min_size=1,
        max_size=30,
    ),
    others=st.lists(st.integers(0, 29), max_size=5),
    cuts=st.lists(st.integers(1, 20_000), max_size=12),
    limit=st.integers(1, 7),
)
def test_runs_of_sets_decode_as_one_by_one_however_split(
    sizes: list[tuple[int, int]], others: list[int], cuts: list[int], limit: int
) -> None:
    """Sets of every size around the fast path's first window, other requests
    between them, the stream cut anywhere: the same requests in the same order."""
    requests = [
        Request(Op.SET, (b"k" * k,), (bytes([i % 251]) * v,)) for i, (k, v) in enumerate(sizes)
    ]
    for where in sorted(others, reverse=True):
        requests.insert(min(where, len(requests)), Request(Op.GET, (b"/between",)))
    data = b"".join(map(encode_request, requests))
    parser = RequestParser()
    decoded: list[Request] = []
    pos = 0
    for size in [*cuts, len(data)]:
        parser.feed(data[pos : pos + size])
        pos += size
        decoded += parse_all(parser, fast=True, limit=limit)
    assert decoded == requests
    assert parser.pending == 0


def test_the_set_fast_path_leaves_what_it_does_not_take_to_the_per_request_path() -> None:
    parser = RequestParser()
    parser.allowed = {Op.VALIDATE}
    parser.feed(encode_request(Request(Op.SET, (b"/k",), (b"v",))))
    assert parser.next_sets(10) == []  # not allowed: refused by next_request
    with pytest.raises(protocol.RefusedOpcodeError):
        parser.next_request()

    parser = RequestParser()
    parser.feed(encode_request(Request(Op.SET, (b"/a",), (b"1",))))
    parser.feed(b"\x01" + struct.pack("<Q", MAX_KEY_BYTES + 1))
    assert parser.next_sets(10) == [(b"/a", b"1")]
    assert parser.next_sets(10) == []
    with pytest.raises(ProtocolError, match="key of 8193 bytes"):
        parser.next_request()

    parser = RequestParser()
    parser.feed(encode_request(Request(Op.SET, (b"/a",), (b"1",))))
    parser.feed(b"\x01" + encode_bytes(b"/b") + struct.pack("<Q", MAX_VALUE_BYTES + 1))
    assert parser.next_sets(10) == [(b"/a", b"1")]
    with pytest.raises(ProtocolError, match="value of"):
        parser.next_request()

    parser = RequestParser()
    whole = encode_request(Request(Op.SET, (b"/k",), (b"v" * 10,)))
    parser.feed(whole[:-3])  # a request partly decoded is finished by next_request
    assert parser.next_sets(10) == []
    assert parser.next_request() is None
    parser.feed(whole[-3:] + whole)
    assert parser.next_sets(10) == []
    assert parser.next_request() == Request(Op.SET, (b"/k",), (b"v" * 10,))
    assert parser.next_sets(10) == [(b"/k", b"v" * 10)]
    assert parser.pending == 0


def test_torch_wire_layout_of_set_and_add() -> None:
    assert encode_request(Request(Op.SET, (b"/k",), (b"v",))) == (
        b"\x01" + struct.pack("<Q", 2) + b"/k" + struct.pack("<Q", 1) + b"v"
    )
    assert encode_request(Request(Op.ADD, (b"/n",), (), 3)) == (
        b"\x04" + struct.pack("<Q", 2) + b"/n" + struct.pack("<q", 3)
    )
    assert encode_request(Request(Op.VALIDATE, number=VALIDATE_MAGIC)) == b"\x00\xce\xf7\x85\x3c"


@FAST
def test_a_stream_of_every_request_fed_byte_by_byte(fast: bool) -> None:
    stream = b"".join(encode_request(r) for r in SAMPLES)
    assert feed_in_chunks(stream, [1] * len(stream), fast) == SAMPLES
    assert feed_in_chunks(stream, [], fast) == SAMPLES


def test_incomplete_request_consumes_nothing() -> None:
    data = encode_request(Request(Op.SET, (b"/key",), (b"value",)))
    parser = RequestParser()
    parser.feed(data[:-1])
    assert parser.next_request() is None
    assert parser.pending == len(data) - 1
    parser.feed(data[-1:])
    assert parser.next_request() == Request(Op.SET, (b"/key",), (b"value",))


def test_keys_decoded_from_an_incomplete_request_are_held_at_their_memory_cost() -> None:
    keys = tuple(b"%d" % (i % 10) for i in range(50_000))
    data = encode_request(Request(Op.CHECK, keys))
    parser = RequestParser()
    tracemalloc.start()
    try:
        parser.feed(data[:-5])  # the last key (8-byte length, 1 byte) is 4 bytes short
        assert parser.next_request() is None
        allocated = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert parser.pending == len(data) - 5
    assert parser.held == parser.pending + 49_999 * protocol.DECODED_ITEM_OVERHEAD
    # What the decoding really allocated (the buffer and 49,999 key objects)
    # is more than four times the wire bytes, and within what is counted.
    assert allocated > 4 * parser.pending
    assert allocated <= parser.held
    parser.feed(data[-5:])
    assert parser.next_request() == Request(Op.CHECK, keys)
    assert parser.held == parser.pending == 0


def test_key_over_the_limit_fails_as_soon_as_its_length_is_read() -> None:
    parser = RequestParser()
    parser.feed(b"\x03" + struct.pack("<Q", MAX_KEY_BYTES + 1))
    with pytest.raises(ProtocolError, match="key of 8193 bytes"):
        parser.next_request()


def test_key_at_the_limit_is_accepted() -> None:
    key = b"k" * MAX_KEY_BYTES
    parser = RequestParser()
    parser.feed(encode_request(Request(Op.GET, (key,))))
    assert parser.next_request() == Request(Op.GET, (key,))


def test_value_over_the_limit_fails() -> None:
    parser = RequestParser()
    parser.feed(b"\x01" + encode_bytes(b"/k") + struct.pack("<Q", MAX_VALUE_BYTES + 1))
    with pytest.raises(ProtocolError, match="value of"):
        parser.next_request()


@pytest.mark.parametrize("op", [Op.CHECK, Op.WAIT, Op.MULTI_GET, Op.MULTI_SET, Op.MULTI_TRY_GET])
def test_count_over_the_limit_fails(op: Op) -> None:
    parser = RequestParser()
    parser.feed(bytes([op]) + struct.pack("<Q", MAX_MULTI_KEYS + 1))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        parser.next_request()


def test_a_request_larger_than_the_total_limit_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "MAX_REQUEST_BYTES", 1000)
    parser = RequestParser()
    parser.feed(b"\x0b" + struct.pack("<q", 10))
    for i in range(3):  # 9 + 3 * 319 = 966 bytes: under the limit
        parser.feed(encode_bytes(b"/k%d" % i) + encode_bytes(b"v" * 300))
        assert parser.next_request() is None
    parser.feed(encode_bytes(b"/k3") + encode_bytes(b"v" * 300))
    with pytest.raises(ProtocolError, match="exceeds 1000 bytes"):
        parser.next_request()


def test_negative_multi_set_count_fails() -> None:
    parser = RequestParser()
    parser.feed(b"\x0b" + struct.pack("<q", -1))
    with pytest.raises(ProtocolError):
        parser.next_request()


@pytest.mark.parametrize(
    "data",
    [
        b"\x13",
        b"\x3f",
        b"\xff",
        b"\x42" + encode_bytes(b"/w") + b"\x02",
        b"\x42" + encode_bytes(b"/w") + b"\x00" + struct.pack("<q", -5),
        b"\x43" + encode_bytes(b"/g") + struct.pack("<q", -1),
    ],
    ids=["opcode-19", "opcode-63", "opcode-255", "watch-flag", "watch-timeout", "get-timeout"],
)
def test_malformed_requests_raise_protocol_error(data: bytes) -> None:
    parser = RequestParser()
    parser.feed(data)
    with pytest.raises(ProtocolError):
        parser.next_request()


def test_encoder_refuses_over_limit_fields() -> None:
    with pytest.raises(ProtocolError, match="key of"):
        encode_request(Request(Op.GET, (b"k" * (MAX_KEY_BYTES + 1),)))
    with pytest.raises(ProtocolError, match="value of"):
        encode_request(Request(Op.SET, (b"k",), (b"v" * (MAX_VALUE_BYTES + 1),)))
    with pytest.raises(ProtocolError, match="as many keys as values"):
        encode_request(Request(Op.MULTI_SET, (b"a", b"b"), (b"1",)))
    with pytest.raises(ProtocolError, match="do not fit"):
        encode_request(Request(Op.SET, (b"k",), ()))
    with pytest.raises(ProtocolError, match="unknown opcode"):
        encode_request(Request(99))


SET_FRAME = encode_request(Request(Op.SET, (b"/k",), (b"v",)))
"""Garbage starts with an opcode, a set or neither, so the fast path meets it."""


def _decode_garbage(data: bytes, cut: list[int], fast: bool) -> tuple[list[Request], str]:
    parser = RequestParser()
    decoded: list[Request] = []
    pos = 0
    try:
        for size in [*cut, len(data)]:
            parser.feed(data[pos : pos + size])
            pos += size
            decoded += parse_all(parser, fast)
    except ProtocolError as exc:
        return decoded, str(exc)
    return decoded, ""


@settings(max_examples=400, deadline=None)
@given(
    data=st.tuples(st.sampled_from([b"", b"\x01", SET_FRAME]), st.binary(max_size=300)).map(
        b"".join
    ),
    cut=st.lists(st.integers(1, 40), max_size=20),
)
def test_garbage_only_ever_raises_protocol_error_and_the_set_fast_path_agrees(
    data: bytes, cut: list[int]
) -> None:
    assert _decode_garbage(data, cut, fast=True) == _decode_garbage(data, cut, fast=False)


@settings(max_examples=200, deadline=None)
@given(
    index=st.integers(0, len(SAMPLES) - 1),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
)
def test_mutated_valid_requests_only_raise_protocol_error(
    index: int, flips: list[tuple[int, int]]
) -> None:
    data = bytearray(encode_request(SAMPLES[index]) * 2)
    for where, byte in flips:
        data[where % len(data)] = byte
    parser = RequestParser()
    for i in range(len(data)):
        parser.feed(bytes(data[i : i + 1]))
        try:
            parse_all(parser)
        except ProtocolError:
            return


def test_reply_reader_fields_byte_by_byte() -> None:
    stream = (
        encode_u8(7)
        + encode_u32(0xDEADBEEF)
        + encode_i64(-3)
        + encode_bytes(b"val")
        + b"xy"
        + encode_u8(GetWaitStatus.FOUND)
        + encode_bytes(b"found")
        + encode_u8(GetWaitStatus.TIMED_OUT)
    )
    reader = ReplyReader()
    decoders: list[Decoder[object]] = [
        decode_u8,
        decode_u32,
        decode_i64,
        decode_bytes,
        decode_raw(2),
        decode_get_wait,
        decode_get_wait,
    ]
    results = []
    position = 0
    for decode in decoders:
        while (value := reader.read(decode)) is None:
            reader.feed(stream[position : position + 1])
            position += 1
        results.append(value)
    assert results == [
        7,
        0xDEADBEEF,
        -3,
        b"val",
        b"xy",
        (GetWaitStatus.FOUND, b"found"),
        (GetWaitStatus.TIMED_OUT, b""),
    ]
    assert reader.pending == 0


def test_reply_reader_refuses_an_over_limit_length() -> None:
    reader = ReplyReader()
    reader.feed(struct.pack("<Q", 100))
    with pytest.raises(ProtocolError, match="100 bytes"):
        reader.read(lambda buf, pos: decode_bytes(buf, pos, limit=10))
