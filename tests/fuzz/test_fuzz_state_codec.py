"""Fuzz the rendezvous state and join-record codecs: only ever
``RendezvousStateError``, and whatever decodes re-encodes to an equal state."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdzv.backends.store import C10dRendezvousBackend
from rdzv.dynamic.state import (
    STATE_VERSION,
    RendezvousState,
    decode_record,
    decode_state,
    encode_state,
)
from rdzv.errors import RendezvousStateError
from rdzv.store.memory import HashStore
from tests.fuzz.budget import budget

pytestmark = pytest.mark.timeout(120)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=25,
)

node_keys = st.from_regex(r"[a-z0-9.]{1,12}_[0-9]{1,5}_[0-9a-f]{1,8}", fullmatch=True)


@st.composite
def valid_states(draw: st.DrawFn) -> RendezvousState:
    round_no = draw(st.integers(min_value=-1, max_value=10**9))
    nodes = () if round_no == -1 else tuple(draw(st.lists(node_keys, max_size=8, unique=True)))
    evicted = frozenset(draw(st.sets(st.integers(0, max(0, len(nodes) - 1)))) if nodes else ())
    return RendezvousState(round_no, nodes, evicted, draw(st.booleans()))


@st.composite
def mutated(draw: st.DrawFn, source: st.SearchStrategy[bytes]) -> bytes:
    """A valid encoding with a few random byte edits (flip, insert, delete, cut)."""
    data = bytearray(draw(source))
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        edit = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if edit == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=3))
        elif edit == "delete":
            del data[at]
        else:
            del data[at:]
    return bytes(data)


def check_state_bytes(data: bytes) -> None:
    try:
        state = decode_state(data)
    except RendezvousStateError:
        return
    assert decode_state(encode_state(state)) == state


@budget(400)
@given(st.binary(max_size=300))
def test_state_codec_on_random_bytes(data: bytes) -> None:
    check_state_bytes(data)
    check_state_bytes(bytes([STATE_VERSION]) + data)


@pytest.mark.slow
@budget(400)
@given(json_values)
def test_state_codec_on_arbitrary_json(body: object) -> None:
    check_state_bytes(bytes([STATE_VERSION]) + json.dumps(body).encode())


@pytest.mark.slow
@budget(400)
@given(mutated(valid_states().map(encode_state)))
def test_state_codec_on_mutated_valid_states(data: bytes) -> None:
    check_state_bytes(data)


@pytest.mark.slow
@budget(100)
@given(valid_states())
def test_valid_states_round_trip(state: RendezvousState) -> None:
    assert decode_state(encode_state(state)) == state


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_regression_deeply_nested_json_is_a_state_error(depth: int) -> None:
    # Found by the structured fuzzers: json.loads raised RecursionError.
    with pytest.raises(RendezvousStateError, match="not JSON"):
        decode_state(bytes([STATE_VERSION]) + b"[" * depth + b"]" * depth)


@pytest.mark.slow
@budget(300)
@given(st.binary(max_size=120) | mutated(node_keys.map(lambda n: f"{n} 3".encode())))
def test_join_record_codec_only_raises_state_error(data: bytes) -> None:
    try:
        record = decode_record(data)
    except RendezvousStateError:
        return
    assert record.node_rank >= -1


@budget(200)
@given(st.binary(max_size=64))
def test_backend_record_header_only_raises_state_error(raw: bytes) -> None:
    store = HashStore()
    store.set("rdzv.backend/job/state", raw)
    try:
        found = C10dRendezvousBackend(store, "job").get_state()
    except RendezvousStateError:
        return
    if found is None:
        # The read's compare-and-set probe value itself reads as "nothing stored".
        assert raw == b"\x00rdzv-probe"
        return
    body, token = found
    assert token == raw
    assert raw.endswith(body)
