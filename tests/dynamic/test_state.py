import contextlib
import itertools
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdzv.backends.base import validate_node_key
from rdzv.dynamic.state import (
    MAX_PARTICIPANTS,
    JoinRecord,
    RendezvousState,
    assign_ranks,
    decode_record,
    decode_state,
    encode_record,
    encode_state,
    make_node_key,
    natural_key,
    node_address,
)
from rdzv.errors import RendezvousStateError


def _key(i: int, host: str = "10.0.0") -> str:
    return make_node_key(f"{host}.{i}", 1000 + i, "ab12cd34")


def test_state_round_trips() -> None:
    state = RendezvousState(3, (_key(1), _key(2), _key(3)), frozenset({1}), closed=True)
    assert decode_state(encode_state(state)) == state
    assert decode_state(encode_state(RendezvousState())) == RendezvousState()


def test_encoding_is_versioned_json_not_pickle() -> None:
    data = encode_state(RendezvousState(0, (_key(1),)))
    assert data[0] == 1
    assert json.loads(data[1:]) == [0, 0, [_key(1)], []]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"\x03[]", "unknown version 3"),
        (b"\x02[1,0,[],[]]", "participants, evicted, port"),
        (b'\x02[1,0,["a"],[],0]', "bad bootstrap port"),
        (b'\x02[1,0,["a"],[],65536]', "bad bootstrap port"),
        (b"\x01not json", "not JSON"),
        (b"\x01\xff\xfe", "not JSON"),
        (b"\x01[1,0,[]]", "expected"),
        (b"\x01[true,0,[],[]]", "bad round"),
        (b"\x01[1,2,[],[]]", "closed flag"),
        (b"\x01[-2,0,[],[]]", "round must be"),
        (b'\x01[1,0,"ab",[]]', "must be lists"),
        (b'\x01[1,0,["a b"],[]]', "node key"),
        (b'\x01[1,0,["a"],[3]]', "out of range"),
        (b'\x01[1,0,["a"],[0,0]]', "distinct"),
        (b'\x01[1,0,["a","a"],[]]', "distinct"),
        (b'\x01[-1,0,["a"],[]]', "no participants"),
        (b"\x80\x04\x95pickle", "unknown version"),
    ],
)
def test_bad_state_raises_state_error(data: bytes, reason: str) -> None:
    with pytest.raises(RendezvousStateError, match=reason):
        decode_state(data)


@given(st.binary(max_size=200))
def test_garbage_only_ever_raises_state_error(data: bytes) -> None:
    with contextlib.suppress(RendezvousStateError):
        decode_state(data)


@pytest.mark.parametrize("nodes", [10, 100, 1_000, 10_000])
def test_encoded_size_stays_within_budget(nodes: int) -> None:
    # Realistic keys: IPv4 address, 7-digit pid, 8-hex nonce (~30 bytes).
    keys = tuple(
        make_node_key(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 1_000_000 + i, "0123abcd")
        for i in range(nodes)
    )
    size = len(encode_state(RendezvousState(7, keys, frozenset(range(0, nodes, 10)))))
    budget = 64 + 40 * nodes  # torch: ~94 KB at 1,024 nodes, i.e. ~92 bytes a node
    assert size <= budget, (nodes, size)
    if nodes == 1_000:
        assert size < 94_000 / 2


def test_records_round_trip_and_validate() -> None:
    record = JoinRecord(_key(1), 3)
    assert decode_record(encode_record(record)) == record
    for bad in (b"", b"a b c", b"a x", b"a -2", b"\xff 1", b" 1", b"a 1 0", b"a 1 65536"):
        with pytest.raises(RendezvousStateError):
            decode_record(bad)
    for bad in (b"a 1 2 3", b"a 1 +80", b"a 1 \xd9\xa1"):
        with pytest.raises(RendezvousStateError):
            decode_record(bad)


def test_records_carry_the_port_their_node_holds() -> None:
    record = JoinRecord(_key(1), -1, 29500)
    assert encode_record(record) == f"{_key(1)} -1 29500".encode()
    assert decode_record(encode_record(record)) == record
    assert decode_record(f"{_key(1)} -1".encode()).port == 0


def test_a_state_with_a_bootstrap_port_is_version_2() -> None:
    state = RendezvousState(4, (_key(1), _key(2)), frozenset({1}), bootstrap_port=29500)
    data = encode_state(state)
    assert data[0] == 2
    assert json.loads(data[1:]) == [4, 0, [_key(1), _key(2)], [1], 29500]
    assert decode_state(data) == state
    assert state.evict([_key(2)]).bootstrap_port == 29500
    assert state.close().bootstrap_port == 29500
    with pytest.raises(ValueError, match="bootstrap_port"):
        RendezvousState(1, (_key(1),), bootstrap_port=70000)


def test_a_node_key_holding_a_newline_is_refused_in_a_long_state() -> None:
    keys = [_key(i) for i in range(50)] + ["a\nb"]
    data = b"\x01" + json.dumps([1, 0, keys, []]).encode()
    with pytest.raises(RendezvousStateError, match="node key"):
        decode_state(data)


def _is_valid_key(key: str) -> bool:
    try:
        validate_node_key(key)
    except ValueError:
        return False
    return True


_KEY_CHARS = st.sampled_from(["a", "#", "~", "!", " ", "\n", "\t", "\x7f", "\x00", "é", "\u3000"])


@given(st.lists(st.text(_KEY_CHARS, max_size=6) | st.just("k" * 257), min_size=1, max_size=8))
def test_decoding_accepts_exactly_the_keys_validate_node_key_accepts(keys: list[str]) -> None:
    """The state decoder's one-pass check of all keys agrees with checking each key."""
    keys = list(dict.fromkeys(keys))
    data = b"\x01" + json.dumps([1, 0, keys, []]).encode()
    if all(_is_valid_key(k) for k in keys):
        assert decode_state(data).participants == tuple(keys)
    else:
        with pytest.raises(RendezvousStateError, match="node key"):
            decode_state(data)


def test_live_count_counts_the_participants_not_evicted() -> None:
    state = RendezvousState(1, (_key(1), _key(2), _key(3)))
    assert state.live_count == 3
    assert state.live_participants() is state.participants
    evicted = state.evict([_key(1), _key(3)])
    assert evicted.live_count == 1 == len(evicted.live_participants())


def test_node_keys() -> None:
    key = make_node_key("fe80::1%eth0", 12, "ff")
    assert key == "fe80::1#12#ff"
    assert node_address(key) == "fe80::1"
    with pytest.raises(ValueError, match="node key"):
        make_node_key("bad host", 1, "x")


def test_natural_sort() -> None:
    names = ["node66", "node7", "node100", "node8", "a"]
    assert sorted(names, key=natural_key) == ["a", "node7", "node8", "node66", "node100"]


def _tagged_natural_key(text: str) -> tuple[tuple[int, int, str], ...]:
    """The natural order spelled out: runs in turn, a number before any text, numbers by value."""
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in re.split(r"(\d+)", text)
        if part
    )


@given(st.lists(st.text(alphabet="a1.0#-9b:", max_size=8), min_size=2, max_size=40))
def test_natural_key_orders_as_the_runs_compared_in_turn(names: list[str]) -> None:
    by_key = sorted(names, key=natural_key)
    assert [_tagged_natural_key(n) for n in by_key] == sorted(map(_tagged_natural_key, names))
    for a, b in itertools.pairwise(names):
        assert (natural_key(a) == natural_key(b)) == (
            _tagged_natural_key(a) == _tagged_natural_key(b)
        )


def test_evict_and_close() -> None:
    state = RendezvousState(1, (_key(1), _key(2), _key(3)))
    evicted = state.evict([_key(2), "stranger"])
    assert evicted.live_participants() == (_key(1), _key(3))
    assert evicted.rank_of(_key(2)) is None
    assert evicted.rank_of(_key(3)) == 2
    assert state.close().closed
    assert state.next_round == 2


def test_ranks_are_natural_by_address() -> None:
    keys = [make_node_key(f"node{i}", 1, "x") for i in (66, 7, 100, 8)]
    ranked = assign_ranks([JoinRecord(k) for k in keys], (), 10)
    assert [node_address(k) for k in ranked] == ["node7", "node8", "node66", "node100"]


def test_ranks_honour_distinct_node_ranks() -> None:
    keys = [make_node_key(f"node{i}", 1, "x") for i in range(3)]
    records = [JoinRecord(keys[0], 2), JoinRecord(keys[1], 0), JoinRecord(keys[2], 1)]
    assert assign_ranks(records, (), 10) == (keys[1], keys[2], keys[0])
    clash = [JoinRecord(keys[0], 0), JoinRecord(keys[1], 0), JoinRecord(keys[2], 1)]
    assert assign_ranks(clash, (), 10) == tuple(keys)


def test_survivors_keep_order_and_come_first_and_duplicates_count_once() -> None:
    a, b, c, d = (make_node_key(f"node{i}", 1, "x") for i in (9, 5, 1, 3))
    previous = (a, b, c)
    records = [JoinRecord(d), JoinRecord(c), JoinRecord(a), JoinRecord(a), JoinRecord(b)]
    assert assign_ranks(records, previous, 10) == (a, b, c, d)
    assert assign_ranks(records, previous, 2) == (a, b)


def test_a_state_over_the_participant_cap_is_a_state_error_naming_the_limit() -> None:
    nodes = [f"10.0.0.1#{i}#ab" for i in range(MAX_PARTICIPANTS + 1)]
    data = b"\x01" + json.dumps([0, 0, nodes, []]).encode()
    with pytest.raises(RendezvousStateError, match=f"MAX_PARTICIPANTS = {MAX_PARTICIPANTS}"):
        decode_state(data)
    assert len(
        decode_state(b"\x01" + json.dumps([0, 0, nodes[:-1], []]).encode()).participants
    ) == (MAX_PARTICIPANTS)
