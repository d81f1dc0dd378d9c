"""The sans-I/O store engine, without sockets: semantics, waiter index costs, limits."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdzv.store import engine as engine_module
from rdzv.store import waiters as waiters_module
from rdzv.store.engine import (
    BLOCKING_OPS,
    DEFAULT_MAX_WAITED_KEYS,
    MAX_APPENDED_BYTES,
    WAITED_KEY_OVERHEAD,
    WATCH_DIGEST_PAST,
    StoreEngine,
)
from rdzv.store.protocol import (
    MAX_MULTI_KEYS,
    MAX_VALUE_BYTES,
    Op,
    ProtocolError,
    Request,
    WatchStatus,
    encode_bytes,
    encode_i64,
)

STOP_WAITING = b"\x00"
WAIT_CANCELED = b"\x01"
READY = b"\x00"
NOT_READY = b"\x01"
ME = "me"


def i64(reply: bytes | None) -> int:
    assert reply is not None
    value: int = struct.unpack("<q", reply)[0]
    return value


def run(
    engine: StoreEngine[str],
    op: Op,
    *keys: bytes,
    values: tuple[bytes, ...] = (),
    number: int = 0,
    client: str = ME,
) -> bytes | None:
    """Apply one request that answers no other client; return its reply."""
    reply, woken = engine.apply(client, Request(op, keys, values, number))
    assert list(woken) == []
    return reply


def set_(engine: StoreEngine[str], key: bytes, value: bytes = b"v") -> list[tuple[str, bytes]]:
    return list(engine.apply("writer", Request(Op.SET, (key,), (value,)))[1])


def get(engine: StoreEngine[str], key: bytes) -> bytes | None:
    return run(engine, Op.GET, key, client="reader")


def exists(engine: StoreEngine[str], *keys: bytes) -> bool:
    return run(engine, Op.CHECK, *keys, client="reader") == READY


# -- plain operations -----------------------------------------------------------


def test_set_get_delete_num_keys_and_list_keys() -> None:
    engine: StoreEngine[str] = StoreEngine()
    assert run(engine, Op.SET, b"a", values=(b"1",)) is None
    run(engine, Op.SET, b"b", values=(b"2",))
    assert get(engine, b"a") == encode_bytes(b"1")
    assert get(engine, b"missing") == encode_bytes(b"")
    assert i64(run(engine, Op.GETNUMKEYS)) == 2
    assert run(engine, Op.LIST_KEYS) == encode_i64(2) + encode_bytes(b"a") + encode_bytes(b"b")
    assert i64(run(engine, Op.DELETE_KEY, b"a")) == 1
    assert i64(run(engine, Op.DELETE_KEY, b"a")) == 0
    assert i64(run(engine, Op.GETNUMKEYS)) == 1


@pytest.mark.parametrize(
    ("current", "expected", "desired", "reply", "after"),
    [
        (None, b"", b"new", b"new", b"new"),  # missing, empty expected: created
        (None, b"old", b"new", b"old", None),  # missing, non-empty expected: untouched
        (b"cur", b"cur", b"new", b"new", b"new"),  # match: swapped
        (b"cur", b"other", b"new", b"cur", b"cur"),  # mismatch: current returned
        (b"cur", b"", b"new", b"cur", b"cur"),  # present, empty expected: a mismatch
    ],
)
def test_compare_set(
    current: bytes | None, expected: bytes, desired: bytes, reply: bytes, after: bytes | None
) -> None:
    engine: StoreEngine[str] = StoreEngine()
    if current is not None:
        set_(engine, b"k", current)
    assert run(engine, Op.COMPARE_SET, b"k", values=(expected, desired)) == encode_bytes(reply)
    assert exists(engine, b"k") is (after is not None)
    if after is not None:
        assert get(engine, b"k") == encode_bytes(after)


def test_add_counts_in_ascii_and_refuses_a_non_integer_without_changing_it() -> None:
    engine: StoreEngine[str] = StoreEngine()
    assert i64(run(engine, Op.ADD, b"n", number=5)) == 5
    assert i64(run(engine, Op.ADD, b"n", number=-7)) == -2
    assert get(engine, b"n") == encode_bytes(b"-2")
    set_(engine, b"word", b"abc")
    with pytest.raises(ProtocolError, match=r"ADD to key b'word'.*not an integer"):
        run(engine, Op.ADD, b"word", number=1)
    assert get(engine, b"word") == encode_bytes(b"abc")


def test_multi_set_multi_get_and_multi_try_get() -> None:
    engine: StoreEngine[str] = StoreEngine()
    run(engine, Op.MULTI_SET, b"a", b"b", values=(b"1", b""))
    assert run(engine, Op.MULTI_GET, b"b", b"a", b"c") == b"".join(
        encode_bytes(v) for v in (b"", b"1", b"")
    )
    assert run(engine, Op.MULTI_TRY_GET, b"a", b"c", b"b") == (
        b"\x01" + encode_bytes(b"1") + b"\x00" + b"\x01" + encode_bytes(b"")
    )


def test_an_opcode_outside_the_store_is_refused() -> None:
    engine: StoreEngine[str] = StoreEngine()
    assert Op.VALIDATE not in engine.handlers
    assert set(engine.handlers) > BLOCKING_OPS
    with pytest.raises(ProtocolError, match="not a store operation"):
        run(engine, Op.VALIDATE, number=1)


# -- append ----------------------------------------------------------------------


def test_append_concatenates_onto_set_values_and_stays_a_plain_value() -> None:
    engine: StoreEngine[str] = StoreEngine()
    run(engine, Op.APPEND, b"k", values=(b"1",))
    set_(engine, b"k", b"12")
    for part in (b"3", b"4", b"5"):
        run(engine, Op.APPEND, b"k", values=(part,))
    assert get(engine, b"k") == encode_bytes(b"12345")
    assert i64(run(engine, Op.ADD, b"k", number=1)) == 12346
    run(engine, Op.APPEND, b"k", values=(b"7",))
    assert run(engine, Op.WATCH, b"k", values=(b"123467",)) == b"\x02"
    assert run(engine, Op.COMPARE_SET, b"k", values=(b"123467", b"x")) == encode_bytes(b"x")


def test_append_is_capped_at_the_value_limit_and_a_refused_append_changes_nothing() -> None:
    assert MAX_APPENDED_BYTES == MAX_VALUE_BYTES
    engine: StoreEngine[str] = StoreEngine()
    chunk = b"x" * (MAX_APPENDED_BYTES // 4)
    for _ in range(4):
        run(engine, Op.APPEND, b"log", values=(chunk,))
    with pytest.raises(ProtocolError, match=rf"over the limit of {MAX_APPENDED_BYTES} bytes"):
        run(engine, Op.APPEND, b"log", values=(b"!",))
    reply = get(engine, b"log")
    assert reply is not None
    assert len(reply) == 8 + MAX_APPENDED_BYTES
    with pytest.raises(ProtocolError, match="MAX_APPENDED_BYTES"):
        run(engine, Op.APPEND, b"fresh", values=(b"y" * (MAX_APPENDED_BYTES + 1),))
    assert not exists(engine, b"fresh")


# -- queues ----------------------------------------------------------------------


def test_queues_are_fifo_and_separate_from_values() -> None:
    engine: StoreEngine[str] = StoreEngine()
    for item in (b"a", b"b"):
        run(engine, Op.QUEUE_PUSH, b"q", values=(item,))
    assert i64(run(engine, Op.QUEUE_LEN, b"q")) == 2
    assert i64(run(engine, Op.GETNUMKEYS)) == 0
    assert get(engine, b"q") == encode_bytes(b"")
    assert run(engine, Op.QUEUE_POP, b"q") == encode_i64(1) + encode_bytes(b"a")
    assert run(engine, Op.QUEUE_POP, b"q") == encode_i64(1) + encode_bytes(b"b")
    assert run(engine, Op.QUEUE_POP, b"q") == encode_i64(0)
    assert i64(run(engine, Op.QUEUE_LEN, b"q")) == 0


def test_a_non_empty_queue_makes_its_key_exist_as_on_torchs_server() -> None:
    engine: StoreEngine[str] = StoreEngine()
    assert not exists(engine, b"q")
    run(engine, Op.QUEUE_PUSH, b"q", values=(b"item",))
    assert exists(engine, b"q")
    run(engine, Op.QUEUE_POP, b"q")
    assert not exists(engine, b"q")


def test_a_blocking_pop_waits_on_the_queue_key_and_a_push_answers_it() -> None:
    """torch's client pops with WAIT on the key, then QUEUE_POP."""
    engine: StoreEngine[str] = StoreEngine()
    assert run(engine, Op.WAIT, b"q", client="popper") is None
    reply, woken = engine.apply("pusher", Request(Op.QUEUE_PUSH, (b"q",), (b"job",)))
    assert reply is None
    assert list(woken) == [("popper", STOP_WAITING)]
    assert run(engine, Op.QUEUE_POP, b"q", client="popper") == encode_i64(1) + encode_bytes(b"job")
    assert run(engine, Op.WAIT, b"q", client="popper") is None
    assert engine.waiter_count == 1


# -- blocked requests --------------------------------------------------------------


def test_wait_answers_at_once_when_every_key_exists_and_for_no_keys() -> None:
    engine: StoreEngine[str] = StoreEngine()
    assert run(engine, Op.WAIT) == STOP_WAITING
    set_(engine, b"a")
    assert run(engine, Op.WAIT, b"a", b"a") == STOP_WAITING
    assert engine.waiter_count == 0


def test_wait_is_answered_when_its_last_missing_key_is_written() -> None:
    engine: StoreEngine[str] = StoreEngine()
    set_(engine, b"a")
    assert run(engine, Op.WAIT, b"a", b"b", b"c", b"b") is None
    assert (engine.waiter_count, engine.indexed_keys, engine.timeout_ms(ME)) == (1, 3, None)
    assert set_(engine, b"b") == []
    assert set_(engine, b"b", b"again") == []
    _, woken = engine.apply("w", Request(Op.MULTI_SET, (b"x", b"c"), (b"1", b"2")))
    assert list(woken) == [(ME, STOP_WAITING)]
    assert (engine.waiter_count, engine.indexed_keys) == (0, 0)


def test_a_key_deleted_before_the_others_arrive_counts_as_missing_again() -> None:
    engine: StoreEngine[str] = StoreEngine()
    run(engine, Op.WAIT, b"a", b"b")
    assert set_(engine, b"a") == []
    run(engine, Op.DELETE_KEY, b"a", client="writer")
    assert set_(engine, b"b") == []
    assert set_(engine, b"a") == [(ME, STOP_WAITING)]


@pytest.mark.parametrize(
    ("request_", "timeout_reply"),
    [
        (Request(Op.WAIT, (b"k",)), None),
        (Request(Op.BARRIER, (b"bar",), (), 10), None),
        (Request(Op.GET_WAIT, (b"k",), (), 250), b"\x01"),
        (Request(Op.WATCH, (b"k",), (), 250), b"\x02"),
    ],
    ids=["wait", "barrier", "get_wait", "watch"],
)
def test_a_blocked_client_may_only_cancel_and_drop_gives_the_timeout_reply(
    request_: Request, timeout_reply: bytes | None
) -> None:
    engine: StoreEngine[str] = StoreEngine()
    assert engine.apply(ME, request_) == (None, ())
    assert engine.timeout_ms(ME) == (request_.number if timeout_reply else None)
    with pytest.raises(ProtocolError, match="only CANCEL_WAIT"):
        run(engine, Op.SET, b"k", values=(b"v",))
    assert not exists(engine, b"k")
    assert engine.drop(ME) == timeout_reply
    assert engine.drop(ME) is None
    assert (engine.waiter_count, engine.indexed_keys) == (0, 0)
    assert engine.apply(ME, request_)[0] is None
    assert run(engine, Op.CANCEL_WAIT) == WAIT_CANCELED
    assert run(engine, Op.CANCEL_WAIT) == WAIT_CANCELED  # the STOP_WAITING crossed it
    assert (engine.waiter_count, engine.indexed_keys) == (0, 0)


def test_barrier_releases_everyone_at_world_size() -> None:
    engine: StoreEngine[str] = StoreEngine()
    assert run(engine, Op.BARRIER, b"bar", number=3, client="a") is None
    assert run(engine, Op.BARRIER, b"bar", number=3, client="b") is None
    reply, woken = engine.apply("c", Request(Op.BARRIER, (b"bar",), (), 3))
    assert reply == STOP_WAITING
    assert sorted(woken) == [("a", STOP_WAITING), ("b", STOP_WAITING)]
    assert get(engine, b"bar") == encode_bytes(b"3")


def test_get_wait_and_watch() -> None:
    engine: StoreEngine[str] = StoreEngine()
    assert run(engine, Op.GET_WAIT, b"k", number=0) == b"\x01"
    assert run(engine, Op.WATCH, b"k", number=0) == b"\x02"
    run(engine, Op.GET_WAIT, b"k", number=1000, client="getter")
    run(engine, Op.WATCH, b"k", number=1000, client="watcher")
    _, woken = engine.apply("w", Request(Op.QUEUE_PUSH, (b"k",), (b"item",)))
    assert list(woken) == []  # a queue is no value
    assert sorted(set_(engine, b"k", b"v1")) == [
        ("getter", b"\x00" + encode_bytes(b"v1")),
        ("watcher", b"\x00" + encode_bytes(b"v1")),
    ]
    run(engine, Op.WATCH, b"k", values=(b"v1",), number=1000, client="watcher")
    assert set_(engine, b"k", b"v1") == []  # the same value is no change
    _, woken = engine.apply("w", Request(Op.DELETE_KEY, (b"k",)))
    assert list(woken) == [("watcher", b"\x01")]


# -- the cost of the waiter index ----------------------------------------------------


def test_a_write_examines_only_the_waiters_of_its_key() -> None:
    engine: StoreEngine[str] = StoreEngine()
    for i in range(100):
        run(engine, Op.WAIT, b"own%d" % i, b"shared", client=f"own{i}")
    for i in range(10):
        run(engine, Op.WATCH, b"watched", number=1000, client=f"watch{i}")
    before = engine.waiter_checks
    set_(engine, b"unrelated")
    assert engine.waiter_checks == before
    set_(engine, b"own7")
    assert engine.waiter_checks == before + 1
    set_(engine, b"watched")
    assert engine.waiter_checks == before + 11
    assert len(set_(engine, b"shared")) == 1  # own7 had only this one missing
    assert engine.waiter_checks == before + 111


def test_waits_on_the_most_keys_cost_one_step_per_waiter_per_write() -> None:
    """8 WAITs of 128 Ki keys and 100 set/delete pairs: 1,600 steps, not 8 * 2**17 * 200."""
    keys = tuple(b"k%d" % i for i in range(MAX_MULTI_KEYS))
    budget = 8 * sum(len(key) + WAITED_KEY_OVERHEAD for key in keys)
    engine: StoreEngine[str] = StoreEngine(max_waiting_bytes=budget, max_waited_keys=len(keys))
    for client in range(8):
        assert engine.apply(str(client), Request(Op.WAIT, keys)) == (None, ())
    for _ in range(100):
        assert set_(engine, b"k0") == []
        run(engine, Op.DELETE_KEY, b"k0", client="writer")
    assert engine.waiter_checks == 100 * 2 * 8
    _, woken = engine.apply("writer", Request(Op.MULTI_SET, keys, (b"v",) * len(keys)))
    assert sorted(woken) == [(str(client), STOP_WAITING) for client in range(8)]
    assert (engine.waiter_count, engine.indexed_keys) == (0, 0)


def cost(*keys: bytes) -> int:
    return sum(len(key) + WAITED_KEY_OVERHEAD for key in keys)


def test_blocked_requests_hold_their_keys_against_the_budget_until_they_end() -> None:
    """Answered, cancelled, dropped (gone or timed out): each releases what it held."""
    engine: StoreEngine[str] = StoreEngine(max_waiting_bytes=cost(b"a", b"b", b"c", b"d"))
    assert run(engine, Op.WAIT, b"a", b"b", b"b", client="w") is None  # a duplicate counts once
    assert run(engine, Op.GET_WAIT, b"c", number=1000, client="g") is None
    assert run(engine, Op.WATCH, b"d", number=1000, client="x") is None
    assert engine.waiting_bytes == cost(b"a", b"b", b"c", b"d") == engine.max_waiting_bytes
    with pytest.raises(ProtocolError, match=r"over the limit of \d+ bytes \(max_waiting_bytes\)"):
        engine.apply("late", Request(Op.WAIT, (b"e",)))
    with pytest.raises(ProtocolError, match="max_waiting_bytes"):
        engine.apply("late", Request(Op.BARRIER, (b"n",), number=2))
    assert get(engine, b"n") == encode_bytes(b"")  # the refused BARRIER did not arrive
    assert engine.waiter_count == 3
    assert set_(engine, b"c") == [("g", b"\x00" + encode_bytes(b"v"))]  # answered
    assert engine.waiting_bytes == cost(b"a", b"b", b"d")
    assert run(engine, Op.CANCEL_WAIT, client="w") == WAIT_CANCELED  # cancelled
    assert engine.waiting_bytes == cost(b"d")
    assert engine.drop("x") is not None  # gone, or its time ran out
    assert (engine.waiting_bytes, engine.waiter_count, engine.indexed_keys) == (0, 0, 0)
    assert run(engine, Op.WAIT, b"e", client="late") is None  # room again
    assert run(engine, Op.BARRIER, b"n", number=1, client="solo") == STOP_WAITING  # never blocks
    assert engine.waiting_bytes == cost(b"e")


def test_waits_still_arriving_reserve_their_least_cost_until_they_arrive_or_drop() -> None:
    """The server reserves a WAIT's keys once their number is read, before the keys."""
    engine: StoreEngine[str] = StoreEngine(max_waiting_bytes=3 * WAITED_KEY_OVERHEAD + 2)
    engine.reserve_wait("w", 2)
    engine.reserve_wait("gone", 1)
    assert engine.reserved_bytes == 3 * WAITED_KEY_OVERHEAD
    with pytest.raises(ProtocolError, match="max_waiting_bytes"):
        engine.reserve_wait("late", 1)
    assert engine.drop("gone") is None  # its connection closed mid-request
    assert engine.reserved_bytes == 2 * WAITED_KEY_OVERHEAD
    assert run(engine, Op.WAIT, b"a", b"b", client="w") is None  # the reservation becomes the cost
    assert (engine.reserved_bytes, engine.waiting_bytes) == (0, cost(b"a", b"b"))
    engine.reserve_wait("late", 1)
    assert run(engine, Op.WAIT, b"", client="late") is None
    engine.reserve_wait("soon", 0)
    assert set_(engine, b"a") == []
    assert run(engine, Op.WAIT, client="soon") == STOP_WAITING  # never blocked: nothing held
    assert engine.reserved_bytes == 0


def test_many_waiters_on_one_key_share_its_index_entry() -> None:
    """A rendezvous's many waiters of a few keys: wake, cancel and drop in any order."""
    engine: StoreEngine[str] = StoreEngine()
    for client in range(100):
        assert run(engine, Op.WAIT, b"go", b"own%d" % client, client=str(client)) is None
    assert engine.indexed_keys == 101
    assert run(engine, Op.CANCEL_WAIT, client="0") == WAIT_CANCELED
    assert engine.drop("1") is None
    assert engine.indexed_keys == 99
    for client in range(2, 100):
        assert set_(engine, b"own%d" % client) == []
    assert sorted(set_(engine, b"go")) == sorted((str(c), STOP_WAITING) for c in range(2, 100))
    assert (engine.waiting_bytes, engine.waiter_count, engine.indexed_keys) == (0, 0, 0)


def test_a_watch_of_a_long_value_holds_its_digest_and_still_sees_every_change() -> None:
    long = b"s" * (WATCH_DIGEST_PAST + 1)
    engine: StoreEngine[str] = StoreEngine()
    assert set_(engine, b"k", long) == []
    for client in ("x", "y"):
        assert run(engine, Op.WATCH, b"k", values=(long,), number=1000, client=client) is None
    assert engine.waiting_bytes == 2 * cost(b"k")  # the value is not held
    assert set_(engine, b"k", bytes(long)) == []  # the same value again: no change
    run(engine, Op.APPEND, b"k", values=(b"",), client="writer")  # nor an empty append
    changed = b"t" + long[1:]  # as long, different
    present = bytes([WatchStatus.PRESENT]) + encode_bytes(changed)
    assert sorted(set_(engine, b"k", changed)) == [("x", present), ("y", present)]
    assert run(engine, Op.WATCH, b"k", values=(changed,), number=1000, client="x") is None
    _, woken = engine.apply("writer", Request(Op.APPEND, (b"k",), (b"!",)))
    assert list(woken) == [("x", bytes([WatchStatus.PRESENT]) + encode_bytes(changed + b"!"))]


def test_max_waiting_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_waiting_bytes"):
        StoreEngine(max_waiting_bytes=0)
    with pytest.raises(ValueError, match="max_waited_keys"):
        StoreEngine(max_waited_keys=0)


def test_a_wait_naming_more_keys_than_one_client_may_wait_on_is_refused_naming_the_limit() -> None:
    engine: StoreEngine[str] = StoreEngine(max_waited_keys=3)
    limit = r"over the limit of 3 keys one client may wait on \(max_waited_keys\)"
    with pytest.raises(ProtocolError, match=limit):
        engine.reserve_wait(ME, 4)  # the server asks as soon as the count is read
    with pytest.raises(ProtocolError, match=limit):
        engine.apply(ME, Request(Op.WAIT, (b"a", b"b", b"c", b"d")))
    assert (engine.reserved_bytes, engine.waiter_count) == (0, 0)
    assert run(engine, Op.WAIT, b"a", b"b", b"c") is None
    assert DEFAULT_MAX_WAITED_KEYS == 65536 < MAX_MULTI_KEYS


def test_a_large_wait_is_indexed_and_cleared_a_slice_per_call_of_work() -> None:
    """With ``schedule``, no call touches more than WAIT_SLICE keys of a large WAIT."""
    slice_ = waiters_module.WAIT_SLICE
    scheduled: list[None] = []
    engine: StoreEngine[str] = StoreEngine(schedule=lambda: scheduled.append(None))
    keys = tuple(b"k%d" % i for i in range(3 * slice_ + 5))
    assert engine.apply(ME, Request(Op.WAIT, (*keys, keys[0]))) == (None, ())
    assert (len(scheduled), engine.indexed_keys, engine.has_work) == (1, 0, True)
    assert engine.work() == []
    assert engine.indexed_keys == slice_
    _, woken = engine.apply("writer", Request(Op.MULTI_SET, keys, (b"v",) * len(keys)))
    assert list(woken) == []  # not answered while its count is incomplete
    assert engine.work() == []
    assert engine.work() == []
    assert engine.work() == [(ME, STOP_WAITING)]  # every key exists once indexed
    assert engine.waiter_count == 0
    assert engine.waiting_bytes == cost(*keys)  # the duplicate is not counted
    # The last 6 entries were indexed, and the rest of that call's slice cleared.
    cleared = [engine.indexed_keys]
    while engine.has_work:
        assert engine.work() == []
        cleared.append(engine.indexed_keys)
    assert cleared == [len(keys) - (slice_ - 6) - n * slice_ for n in range(3)] + [0]
    assert (engine.waiting_bytes, len(scheduled)) == (0, 1)


def test_a_large_wait_dropped_while_it_is_indexed_is_cleared_and_frees_its_budget() -> None:
    slice_ = waiters_module.WAIT_SLICE
    engine: StoreEngine[str] = StoreEngine(schedule=lambda: None)
    keys = tuple(b"k%d" % i for i in range(2 * slice_ + 1))
    assert engine.apply(ME, Request(Op.WAIT, keys)) == (None, ())
    engine.work()
    assert engine.drop(ME) is None
    assert (engine.waiter_count, engine.indexed_keys) == (0, slice_)
    assert set_(engine, keys[0]) == []  # a dead entry is skipped
    while engine.has_work:
        assert engine.work() == []
    assert (engine.waiting_bytes, engine.indexed_keys) == (0, 0)


KEYS = [b"a", b"b", b"c"]
WRITES = st.tuples(
    st.sampled_from([Op.SET, Op.DELETE_KEY, Op.QUEUE_PUSH, Op.QUEUE_POP, Op.APPEND, Op.ADD]),
    st.sampled_from(KEYS),
)


@settings(max_examples=200, deadline=None)
@given(
    waits=st.lists(st.lists(st.sampled_from(KEYS), max_size=3), min_size=1, max_size=4),
    writes=st.lists(WRITES, max_size=30),
)
def test_a_wait_is_answered_exactly_when_all_its_keys_exist(
    waits: list[list[bytes]], writes: list[tuple[Op, bytes]]
) -> None:
    """Counting agrees with checking every key: no early, late or lost STOP_WAITING."""
    engine: StoreEngine[str] = StoreEngine()
    blocked: dict[str, list[bytes]] = {}
    for index, keys in enumerate(waits):
        client = f"w{index}"
        if engine.apply(client, Request(Op.WAIT, tuple(keys)))[0] is None:
            blocked[client] = keys
    for op, key in writes:
        values = (b"1",) if op in (Op.SET, Op.QUEUE_PUSH, Op.APPEND) else ()
        _, woken = engine.apply("writer", Request(op, (key,), values, 1))
        for client, reply in woken:
            assert reply == STOP_WAITING
            assert exists(engine, *blocked.pop(client))
        for keys in blocked.values():
            assert not exists(engine, *keys)
    assert engine.waiter_count == len(blocked)


@settings(max_examples=200, deadline=None)
@given(
    waits=st.lists(st.lists(st.sampled_from(KEYS), max_size=6), min_size=1, max_size=4),
    steps=st.lists(st.one_of(WRITES, st.none()), max_size=40),
)
def test_a_wait_indexed_in_slices_is_answered_exactly_when_all_its_keys_exist(
    waits: list[list[bytes]], steps: list[tuple[Op, bytes] | None]
) -> None:
    """Slices of two keys, writes between them (None: a slice of work): no early, late or
    lost STOP_WAITING."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "WAIT_SLICE", 2)
        patch.setattr(waiters_module, "WAIT_SLICE", 2)
        engine: StoreEngine[str] = StoreEngine(schedule=lambda: None)
        blocked: dict[str, list[bytes]] = {}

        def answered(woken: Sequence[tuple[str, bytes]]) -> None:
            for client, reply in woken:
                assert reply == STOP_WAITING
                assert exists(engine, *blocked.pop(client))

        for index, keys in enumerate(waits):
            client = f"w{index}"
            if engine.apply(client, Request(Op.WAIT, tuple(keys)))[0] is None:
                blocked[client] = keys
        for step in [*steps, *[None] * 20]:
            if step is None:
                answered(engine.work())
            else:
                op, key = step
                values = (b"1",) if op in (Op.SET, Op.QUEUE_PUSH, Op.APPEND) else ()
                answered(engine.apply("writer", Request(op, (key,), values, 1))[1])
            if not engine.has_work:
                for keys in blocked.values():
                    assert not exists(engine, *keys)
        assert not engine.has_work
        assert engine.waiter_count == len(blocked)
        assert engine.waiting_bytes == sum(cost(*dict.fromkeys(k)) for k in blocked.values())
