"""Fuzz the store's frame parser and a live server with structured, mutated and
randomly split requests: the parser only ever raises ``ProtocolError``; the
server never crashes or hangs and keeps serving other clients."""

from __future__ import annotations

import contextlib
import itertools
import socket
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdzv.store.protocol import (
    VALIDATE_MAGIC,
    Op,
    ProtocolError,
    Request,
    RequestParser,
    encode_request,
)
from rdzv.store.server import TCPStoreServer
from tests.fuzz.budget import budget
from tests.fuzz.test_fuzz_state_codec import mutated
from tests.procs import wait_until
from tests.reliability.sockets import served
from tests.store.hostile import VALIDATE

pytestmark = pytest.mark.timeout(120)

keys = st.binary(min_size=0, max_size=12).map(lambda k: b"/fz/" + k)
values = st.binary(max_size=40)
small_ms = st.integers(min_value=0, max_value=50)


def _request_strategies() -> list[st.SearchStrategy[Request]]:
    one_key = [Op.GET, Op.DELETE_KEY, Op.QUEUE_POP, Op.QUEUE_LEN]
    key_value = [Op.SET, Op.APPEND, Op.QUEUE_PUSH]
    key_list = [Op.CHECK, Op.WAIT, Op.MULTI_GET, Op.MULTI_TRY_GET]
    bare = [Op.GETNUMKEYS, Op.CANCEL_WAIT, Op.LIST_KEYS, Op.AUTH_CHALLENGE]
    return [
        st.builds(Request, st.just(Op.VALIDATE), number=st.sampled_from([VALIDATE_MAGIC, 0, 1])),
        st.builds(Request, st.just(Op.PING), number=st.integers(0, 2**32 - 1)),
        st.builds(Request, st.sampled_from(one_key), st.tuples(keys)),
        st.builds(Request, st.sampled_from(key_value), st.tuples(keys), st.tuples(values)),
        st.builds(Request, st.sampled_from(key_list), st.lists(keys, max_size=4).map(tuple)),
        st.builds(Request, st.sampled_from(bare)),
        st.builds(
            Request,
            st.sampled_from([Op.ADD, Op.BARRIER]),
            st.tuples(keys),
            number=st.integers(-3, 3),
        ),
        st.builds(Request, st.just(Op.GET_WAIT), st.tuples(keys), number=small_ms),
        st.builds(Request, st.just(Op.COMPARE_SET), st.tuples(keys), st.tuples(values, values)),
        st.lists(st.tuples(keys, values), max_size=4).map(
            lambda pairs: Request(
                Op.MULTI_SET, tuple(k for k, _ in pairs), tuple(v for _, v in pairs)
            )
        ),
        st.builds(
            Request,
            st.just(Op.WATCH),
            st.tuples(keys),
            st.lists(values, max_size=1).map(tuple),
            small_ms,
        ),
        st.builds(
            Request,
            st.just(Op.AUTH_RESPONSE),
            values=st.tuples(
                st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32)
            ),
        ),
    ]


requests = st.one_of(*_request_strategies())
streams = st.lists(requests, min_size=1, max_size=8).map(
    lambda reqs: b"".join(encode_request(r) for r in reqs)
)
inputs = streams | mutated(streams) | st.binary(max_size=200)


@st.composite
def split(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` cut at random points into chunks."""
    cuts = sorted(draw(st.sets(st.integers(0, len(data)), max_size=6)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def parse_all(chunks: list[bytes]) -> list[Request]:
    """Feed ``chunks`` to a parser; return the requests (bounded by the input size).

    The atheris parser target uses it too, so a bad bound raises a plain AssertionError.
    """
    parser = RequestParser()
    decoded: list[Request] = []
    for chunk in chunks:
        parser.feed(chunk)
        for _ in range(len(chunk) + 1):
            request = parser.next_request()
            if request is None:
                break
            decoded.append(request)
        else:
            raise AssertionError("the parser returned more requests than bytes fed")
    return decoded


@pytest.mark.slow
@budget(500)
@given(st.data(), st.lists(requests, min_size=1, max_size=8))
def test_valid_streams_decode_the_same_however_split(
    data: st.DataObject, reqs: list[Request]
) -> None:
    stream = b"".join(encode_request(r) for r in reqs)
    decoded = parse_all(data.draw(split(stream)))
    assert [encode_request(r) for r in decoded] == [encode_request(r) for r in reqs]


@pytest.mark.slow
@budget(800)
@given(st.data(), inputs)
def test_parser_only_raises_protocol_error(data: st.DataObject, stream: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_all(data.draw(split(stream)))


@pytest.fixture(scope="module")
def live_server() -> Iterator[TCPStoreServer]:
    server = TCPStoreServer("127.0.0.1", 0, frame_timeout=2.0).start()
    try:
        yield server
    finally:
        server.stop()


@budget(150)
@given(st.data(), inputs, st.booleans())
def test_live_server_survives_fuzzed_frames_and_serves_others(
    live_server: TCPStoreServer, data: st.DataObject, stream: bytes, validate_first: bool
) -> None:
    # The server may drop this connection at any point: that is allowed.
    with (
        socket.create_connection(("127.0.0.1", live_server.port), timeout=10) as sock,
        contextlib.suppress(OSError),
    ):
        for chunk in data.draw(split((VALIDATE if validate_first else b"") + stream)):
            sock.sendall(chunk)
    assert live_server.running
    assert served(live_server.port)


def test_live_server_leaks_nothing_after_the_fuzzing(live_server: TCPStoreServer) -> None:
    # Runs after the fuzzer in file order; on its own it checks a fresh server.
    wait_until(lambda: live_server.connection_count() == 0, timeout=15)
    assert live_server.waiter_count() == 0
    assert served(live_server.port)
