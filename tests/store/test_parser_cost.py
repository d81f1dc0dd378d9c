"""The request parser is incremental: a request fed in small pieces costs CPU
time linear in its size, and an opcode that is not allowed is refused at its
first byte."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from rdzv.store.protocol import (
    AUTH_MAC_BYTES,
    AUTH_NONCE_BYTES,
    FRAME_BYTES,
    MAX_VALUE_BYTES,
    Op,
    RefusedOpcodeError,
    Request,
    RequestParser,
    encode_request,
)

CHUNK = 64
"""Bytes per feed: small enough that a parser re-reading the pending request
from its start on every feed would take minutes on the larger sizes."""


def _wait_of(size: int) -> Request:
    keys = size // 72  # a 64-byte key is 72 bytes on the wire
    return Request(Op.WAIT, tuple(b"/%063d" % i for i in range(keys)))


def _multi_set_of(size: int) -> Request:
    pairs = size // 1040  # a 16-byte key and a 1 KiB value
    keys = tuple(b"/%015d" % i for i in range(pairs))
    return Request(Op.MULTI_SET, keys, tuple(b"v" * 1024 for _ in keys))


def _set_of(size: int) -> Request:
    return Request(Op.SET, (b"/big",), (b"x" * min(size, MAX_VALUE_BYTES),))


def _cpu_to_parse_in_chunks(request: Request) -> float:
    data = encode_request(request)
    parser = RequestParser()
    decoded = []
    started = time.process_time()
    for offset in range(0, len(data), CHUNK):
        parser.feed(data[offset : offset + CHUNK])
        # As the server decodes: runs of sets first, then one request.
        while True:
            decoded += [Request(Op.SET, (k,), (v,)) for k, v in parser.next_sets(1024)]
            if (done := parser.next_request()) is None:
                break
            decoded.append(done)
    spent = time.process_time() - started
    assert decoded == [request]
    assert parser.pending == 0
    return spent


@pytest.mark.parametrize(
    "build", [_wait_of, _multi_set_of, _set_of], ids=["wait", "multi_set", "set"]
)
def test_a_request_fed_in_small_chunks_costs_time_linear_in_its_size(
    build: Callable[[int], Request],
) -> None:
    small = min(_cpu_to_parse_in_chunks(build(1 << 20)) for _ in range(2))
    large = min(_cpu_to_parse_in_chunks(build(4 << 20)) for _ in range(2))
    # Four times the bytes: linear costs about 4x; quadratic would be 16x or
    # more. CPU time (not wall time) is compared, the best of two runs each,
    # and the bound is generous for a loaded machine.
    assert large < 9 * max(small, 0.002), (small, large)


def test_a_refused_opcode_is_refused_at_its_first_byte() -> None:
    parser = RequestParser()
    parser.allowed = frozenset({Op.VALIDATE})
    parser.feed(bytes([Op.SET]))  # no field of the SET has arrived
    with pytest.raises(RefusedOpcodeError) as refused:
        parser.next_request()
    assert refused.value.op == Op.SET
    assert "opcode 1" in str(refused.value)


def test_allowed_opcodes_can_change_between_requests() -> None:
    validate = encode_request(Request(Op.VALIDATE, number=1))
    ping = encode_request(Request(Op.PING, number=2))
    parser = RequestParser()
    parser.allowed = frozenset({Op.VALIDATE})
    parser.feed(validate + ping)
    assert parser.next_request() == Request(Op.VALIDATE, number=1)
    with pytest.raises(RefusedOpcodeError):
        parser.next_request()
    parser = RequestParser()
    parser.allowed = frozenset({Op.VALIDATE})
    parser.feed(validate + ping)
    assert parser.next_request() == Request(Op.VALIDATE, number=1)
    parser.allowed = None
    assert parser.next_request() == Request(Op.PING, number=2)


def test_the_handshake_requests_have_small_fixed_sizes() -> None:
    handshake = (Op.VALIDATE, Op.PING, Op.AUTH_CHALLENGE, Op.AUTH_RESPONSE)
    assert {op: FRAME_BYTES[op] for op in handshake} == {
        Op.VALIDATE: 5,
        Op.PING: 5,
        Op.AUTH_CHALLENGE: 1,
        Op.AUTH_RESPONSE: 1 + AUTH_NONCE_BYTES + AUTH_MAC_BYTES,
    }
    assert Op.SET not in FRAME_BYTES  # a key and a value: not fixed
    for op, size in FRAME_BYTES.items():
        request = Request(
            Op(op),
            values=(b"n" * AUTH_NONCE_BYTES, b"t" * AUTH_MAC_BYTES)
            if op == Op.AUTH_RESPONSE
            else (),
        )
        assert len(encode_request(request)) == size
