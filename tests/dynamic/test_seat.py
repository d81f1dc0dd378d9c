"""Seats: a member's place in a sealed round in O(1) bytes (rdzv.dynamic.seat), and their use."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import pytest

from rdzv.api import RendezvousInfo, RendezvousTimeout
from rdzv.backends.store import C10dRendezvousBackend
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.dynamic.pacing import waiting_poll_gap
from rdzv.dynamic.seat import (
    MAX_SEALED_MARK,
    SealedMark,
    Seat,
    decode_seat,
    encode_seat,
    seats_of,
    watching_seat,
)
from rdzv.dynamic.shared import shared_state
from rdzv.dynamic.state import (
    RendezvousState,
    StateSummary,
    decode_summary,
    encode_state,
    encode_summary,
)
from rdzv.errors import RendezvousClosedError, RendezvousStateError
from rdzv.retry import REAL_TIME
from rdzv.store.base import Timeout, Value
from rdzv.store.memory import HashStore, PrefixStore

pytestmark = pytest.mark.timeout(120)

A, B, C, D = "10.0.0.1#1#a", "10.0.0.2#1#b", "10.0.0.3#1#c", "10.0.0.4#1#d"


def test_every_members_seat_decodes_to_its_place_in_the_state() -> None:
    state = RendezvousState(7, (A, B, C, D), bootstrap_port=29500)
    seats = seats_of(state)
    assert list(seats) == [A, B, C, D]
    for rank, node in enumerate(state.participants):
        seat = decode_seat(seats[node])
        assert seat == Seat.of(state, node)
        assert (seat.round, seat.rank, seat.world_size, seat.port) == (7, rank, 4, 29500)
        assert seat.master == A
        assert seat.successor == state.participants[(rank + 1) % 4]


def test_a_round_of_one_has_no_successor_and_evicted_members_no_seat() -> None:
    alone = decode_seat(seats_of(RendezvousState(0, (A,), bootstrap_port=1))[A])
    assert alone.successor is None
    assert alone.world_size == 1
    evicted = RendezvousState(2, (A, B, C), evicted=frozenset({1}), bootstrap_port=9)
    seats = seats_of(evicted)
    assert set(seats) == {A, C}
    assert decode_seat(seats[A]).successor == C  # the ring skips the evicted
    assert decode_seat(seats[C]) == Seat(2, 2, 3, A, 9, A)


@pytest.mark.parametrize("mark", [None, b"", b"17", b"\x00\xff a-b"])
def test_a_sealed_mark_round_trips_without_the_readers_time(mark: bytes | None) -> None:
    seat = Seat(3, 1, 4, A, 80, C, SealedMark(mark, read_at=12.5))
    decoded = decode_seat(encode_seat(seat))
    assert decoded.sealed_mark == SealedMark(mark)  # read_at is the reader's, never stored
    assert replace(decoded, sealed_mark=None) == replace(seat, sealed_mark=None)


def test_each_seat_carries_its_successors_mark_as_read_before_the_seal() -> None:
    state = RendezvousState(7, (A, B, C, D), evicted=frozenset({2}), bootstrap_port=29500)
    seats = {n: decode_seat(raw) for n, raw in seats_of(state, {B: b"5", D: None, A: b"1"}).items()}
    assert seats[A].sealed_mark == SealedMark(b"5")  # A watches B
    assert seats[B].sealed_mark == SealedMark(None)  # B watches D (C is evicted), never beat
    assert seats[D].sealed_mark == SealedMark(b"1")  # D watches A, wrapping
    for node, seat in seats.items():
        assert replace(seat, sealed_mark=None) == Seat.of(state, node)
    # A member whose successor's mark was not read gets none; without marks, nobody.
    assert decode_seat(seats_of(state, {A: b"1"})[A]).sealed_mark is None
    # Nor one whose successor's mark is junk too long for an O(1) seat.
    junk = seats_of(state, {B: b"7" * (MAX_SEALED_MARK + 1), D: b"7" * MAX_SEALED_MARK})
    assert decode_seat(junk[A]).sealed_mark is None
    assert decode_seat(junk[B]).sealed_mark == SealedMark(b"7" * MAX_SEALED_MARK)
    assert all(decode_seat(raw).sealed_mark is None for raw in seats_of(state).values())
    # An older rdzv's seat, without the field, decodes without a sealed mark.
    assert decode_seat(b"1 7 0 4 29500 " + A.encode() + b" " + B.encode()).sealed_mark is None


def test_the_seat_size_does_not_grow_with_the_round() -> None:
    def largest_seat(size: int) -> int:
        nodes = tuple(f"10.0.{i:05d}#1#x" for i in range(size))  # keys of one length
        seats = seats_of(RendezvousState(0, nodes, bootstrap_port=1))
        return max(len(s) for s in seats.values())

    # Only the digits of the rank and of the world size grow.
    assert largest_seat(8192) <= largest_seat(8) + 6


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"2 1 0 2 80 a b",  # an unknown version
        b"1 1 0 2 80 a",  # a field missing
        b"1 1 2 2 80 a b",  # rank >= world size
        b"1 1 0 2 0 a b",  # a stored seat always names the port
        b"1 1 0 2 70000 a b",
        b"1 -1 0 2 80 a b",
        b"1 1 0 2 80 a\xff b",
        b"1 1 0 2 80 a " + b"b" * 300,  # a node key too long
        b"1 1 0 2 80 a b y31",  # a mark neither "-" nor "x<hex>"
        b"1 1 0 2 80 a b xzz",
        b"1 1 0 2 80 a b x313",  # an odd number of hex digits
        b"1 1 0 2 80 a b ",  # an empty mark field
        b"1 1 0 2 80 a b - -",  # a field too many
    ],
)
def test_a_corrupt_seat_is_a_state_error(data: bytes) -> None:
    with pytest.raises(RendezvousStateError):
        decode_seat(data)


def test_a_member_that_left_keeps_watching_the_next_live_participant() -> None:
    state = RendezvousState(3, (A, B, C), evicted=frozenset({0, 1}), bootstrap_port=5)
    seat = watching_seat(state, A)  # A left (evicted itself), B was judged dead
    assert seat is not None
    assert seat.successor == C
    assert watching_seat(state, D) is None
    assert encode_seat(seat).startswith(b"1 3 0 3 5 ")


def test_a_state_summary_round_trips_and_stays_small() -> None:
    for state in (
        RendezvousState(),
        RendezvousState(5, (A, B, C), evicted=frozenset({1}), closed=True),
        RendezvousState(10**12, tuple(f"10.0.{i:05d}#1#x" for i in range(8192))),
    ):
        summary = StateSummary.of(state)
        assert (summary.round, summary.closed, summary.live_count) == (
            state.round,
            state.closed,
            state.live_count,
        )
        encoded = encode_summary(summary)
        assert decode_summary(encoded) == summary
        assert len(encoded) <= 40


@pytest.mark.parametrize(
    "data",
    [b"", b"S2 1 0 3", b"S1 1 0", b"S1 1 2 3", b"S1 -2 0 3", b"S1 1 0 -3", b"S1 x 0 3", b"1 1 0 3"],
)
def test_a_corrupt_summary_is_a_state_error(data: bytes) -> None:
    with pytest.raises(RendezvousStateError):
        decode_summary(data)


class ReadRecordingStore(PrefixStore):
    """One node's client of a shared store: counts the bytes and keys it read."""

    def __init__(self, inner: HashStore) -> None:
        super().__init__("shared", inner)
        self.bytes_read = 0
        self.keys_read: list[str] = []

    def _got(self, key: str, value: bytes | None) -> None:
        self.keys_read.append(key)
        self.bytes_read += 0 if value is None else len(value)

    def get(self, key: str) -> bytes:
        value = super().get(key)
        self._got(key, value)
        return value

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        value = super().compare_set(key, expected, desired)
        self._got(key, value)
        return value

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        values = super().try_multi_get(keys)
        for key, value in zip(keys, values, strict=True):
            self._got(key, value)
        return values

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:
        value = super().watch(key, previous, timeout)
        self._got(key, value)
        return value


def _handlers(
    clients: Sequence[ReadRecordingStore],
    run_id: str,
    nodes: tuple[int, int],
    net: str,
    keep_alive: float = 30,
    **options: object,
) -> list[DynamicRendezvousHandler]:
    """One c10d handler per client; min and max ``nodes``, addresses ``<net>.<i>``."""
    return [
        DynamicRendezvousHandler.from_backend(
            run_id,
            client,
            C10dRendezvousBackend(client, run_id),
            nodes[0],
            nodes[1],
            local_addr=f"{net}.{i}",
            timeout=RendezvousTimeout(join=60, last_call=0.1),
            keep_alive_interval=keep_alive,
            **options,  # type: ignore[arg-type]
        )
        for i, client in enumerate(clients)
    ]


def _form(size: int) -> tuple[list[RendezvousInfo], list[ReadRecordingStore], HashStore]:
    shared = HashStore(timeout=30)
    clients = [ReadRecordingStore(shared) for _ in range(size)]
    handlers = _handlers(clients, "seats", (size, size), "10.1.0", keep_alive=5)
    infos: list[RendezvousInfo | None] = [None] * size

    def join(i: int) -> None:
        infos[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for h in handlers:
        h.pre_shutdown()
    assert all(info is not None for info in infos), "a member did not complete"
    return [i for i in infos if i is not None], clients, shared


def test_members_learn_their_place_from_their_seats_without_reading_the_state() -> None:
    infos, clients, _ = _form(6)
    assert sorted(i.rank for i in infos) == list(range(6))
    assert {i.world_size for i in infos} == {6}
    assert len({i.bootstrap_store_info for i in infos}) == 1
    body_readers = [c for c in clients if any("/state/" in k for k in c.keys_read)]
    # Only the sealer read the (pre-seal) state body: every other member its seat.
    assert len(body_readers) <= 1
    seat_readers = [c for c in clients if any("/seat/" in k for k in c.keys_read)]
    assert len(seat_readers) >= 5
    # Everyone that asks gets the same participant list, in rank order.
    lists = {i.participants for i in infos}
    assert len(lists) == 1
    assert len(next(iter(lists))) == 6


def test_members_judge_their_successor_from_the_mark_the_sealer_read() -> None:
    shared = HashStore(timeout=30)
    clients = [ReadRecordingStore(shared) for _ in range(4)]
    handlers = _handlers(clients, "marks", (4, 4), "10.3.0", keep_alive=5)
    beaten = handlers[2].node
    for _ in range(2):  # it beat twice before the seal: its counter holds 2
        C10dRendezvousBackend(PrefixStore("shared", shared), "marks").beat(beaten)
    infos: list[RendezvousInfo | None] = [None] * 4

    def join(i: int) -> None:
        infos[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    watched = [h.statistics().watched for h in handlers]
    for h in handlers:
        h.pre_shutdown()
    assert all(info is not None for info in infos), "a member did not complete"
    # Members that learned their place from their seats (all but at most the
    # sealer) judge from the sealer's reading, stamped when they read the seat.
    stamped = [w for w in watched if w is not None and w.sealed_mark is not None]
    assert len(stamped) >= 3, watched
    for seat in stamped:
        assert seat.sealed_mark is not None
        assert seat.sealed_mark.read_at is not None
        assert seat.sealed_mark.mark == (b"2" if seat.successor == beaten else None), seat


def test_a_seat_is_stored_only_by_the_write_that_committed_and_proves_it() -> None:
    """The c10d backend stores seats after its compare-and-set: a losing
    write stores none, and a member whose seat watch fires knows its write
    committed without reading the state's head again."""
    shared = HashStore(timeout=30)
    writer = C10dRendezvousBackend(ReadRecordingStore(shared), "proof")
    waiting = ReadRecordingStore(shared)
    member = C10dRendezvousBackend(waiting, "proof")
    first = writer.set_state_seated(b"v1", None, {A: b"first seat"})
    assert first is not None
    assert first[2]
    stale = writer.set_state_seated(b"v-lost", None, {A: b"loser"})
    assert stale is not None
    assert not stale[2]
    assert member.read_seat(first[1], A) == b"first seat"
    got: list[object] = []
    waiter = threading.Thread(
        target=lambda: got.append(member.wait_for_seat(first[1], A, 10.0)), daemon=True
    )
    waiter.start()
    for _ in range(2000):  # the waiter's watch is in place once it read the seat key
        if any("/seat/" in k for k in waiting.keys_read):
            break
        threading.Event().wait(0.005)
    waiting.keys_read.clear()
    second = writer.set_state_seated(b"v2", first[1], {A: b"second seat"})
    waiter.join(10.0)
    assert second is not None
    assert second[2]
    assert got == [second[1]]
    assert not any(k.endswith("/state") for k in waiting.keys_read), waiting.keys_read
    assert member.read_seat(second[1], A) == b"second seat"


class _LateSeats(ReadRecordingStore):
    """Stores a seal's member seats ``lag`` seconds after the seal (a slow sealer)."""

    def __init__(self, inner: HashStore, lag: float) -> None:
        super().__init__(inner)
        self.lag = lag

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        if any("/seat/" in k and "#summary" not in k for k in keys):
            threading.Timer(self.lag, super().multi_set, (keys, values)).start()
            return
        super().multi_set(keys, values)


@pytest.mark.parametrize("lag", [1.3, pytest.param(2.5, marks=pytest.mark.slow)])
def test_a_node_that_finds_its_round_sealed_before_its_seat_waits_for_the_seat(
    lag: float,
) -> None:
    """Seats follow the seal's compare-and-set. A waiting node whose wait cap
    (1 s) ends in between finds its round sealed with no seat for it yet; it
    waits for the seat instead of reading the state (at 8,192 nodes, those
    that read it read 240 KB each, thousands at once), also when the seats
    come over a second later, past its next wait cap (a starved sealer,
    in a recovery of 1,024 beside a second one)."""
    shared = HashStore(timeout=30)
    waiting = ReadRecordingStore(shared)
    sealing = _LateSeats(shared, lag=lag)

    first, second = _handlers([waiting, sealing], "late", (2, 2), "10.5.0")
    infos: list[RendezvousInfo] = []
    joining = threading.Thread(target=lambda: infos.append(first.next_rendezvous()), daemon=True)
    joining.start()
    for _ in range(2000):  # the first node waits, enqueued, before the second one seals
        if shared.add("shared/rdzv.backend/late/q/0/n", 0) == 1:
            break
        threading.Event().wait(0.005)
    threading.Event().wait(0.05)
    try:
        infos.append(second.next_rendezvous())
        joining.join(30)
        assert sorted(i.rank for i in infos) == [0, 1]
        assert not any("/state/" in k for k in waiting.keys_read), waiting.keys_read
    finally:
        for h in (first, second):
            h.pre_shutdown()


class _Ordered(ReadRecordingStore):
    """Records the appends and deletes of one client in order."""

    def __init__(self, inner: HashStore) -> None:
        super().__init__(inner)
        self.writes: list[tuple[str, str]] = []

    def append(self, key: str, value: Value) -> None:
        self.writes.append(("append", key))
        super().append(key, value)

    def delete_key(self, key: str) -> bool:
        self.writes.append(("delete", key))
        return super().delete_key(key)


def test_the_sealer_confirms_before_it_drops_old_rounds() -> None:
    """A seal of round r makes round r - 2's queues droppable. The deletes
    have replies, which a loaded store serves behind every member's
    confirmation; the round's verdict waits for the sealer's confirmation
    too, so the sealer confirms first and drops afterwards."""
    shared = HashStore(timeout=30)
    clients = [_Ordered(shared) for _ in range(3)]
    handlers = _handlers(clients, "drops", (3, 3), "10.7.0")
    try:
        for round_id in range(3):
            threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in handlers]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads), f"round {round_id} did not complete"
        dropping = [c for c in clients if ("delete", "rdzv.backend/drops/q/0") in c.writes]
        assert len(dropping) == 1, [c.writes for c in clients]
        writes = dropping[0].writes
        confirmed = writes.index(("append", "rdzv.backend/drops/c/2"))
        assert confirmed < writes.index(("delete", "rdzv.backend/drops/q/0")), writes
        assert shared.add("shared/rdzv.backend/drops/q/0/n", 0) == 0
    finally:
        for h in handlers:
            h.pre_shutdown()


def test_the_wait_list_is_read_only_when_asked() -> None:
    infos, clients, _ = _form(3)
    next_queue = [k for c in clients for k in c.keys_read if "/q/1" in k]
    assert next_queue == [], "a member read the next round's queue unasked"
    assert infos[0].wait_list == ()
    assert any("/q/1" in k for c in clients for k in c.keys_read)


def test_a_leave_wakes_no_member_waiting_for_the_next_round() -> None:
    """The recovery of thousands: a member leaves (an eviction would do the
    same) while the others wait to re-form without it. The re-joining members
    read the state's summary, not the state; the leave wakes none of them
    (each waits on its own seat); only the one that seals reads the state."""
    shared = HashStore(timeout=30)
    clients = [ReadRecordingStore(shared) for _ in range(4)]
    # keep-alive 30 s: nobody is judged dead meanwhile
    handlers = _handlers(clients, "leave", (3, 4), "10.3.0")
    infos: list[RendezvousInfo | None] = [None] * 4

    def join(i: int) -> None:
        infos[i] = handlers[i].next_rendezvous()

    def run(indices: range) -> list[threading.Thread]:
        threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in indices]
        for t in threads:
            t.start()
        return threads

    for t in run(range(4)):
        t.join(90)
    assert all(info is not None and info.world_size == 4 for info in infos)
    infos[:3] = [None] * 3
    for client in clients:
        client.keys_read.clear()
    rejoined = run(range(3))
    for _ in range(2000):  # the three re-joined round 1 and wait for the fourth
        if shared.add("shared/rdzv.backend/leave/q/1/n", 0) == 3:
            break
        threading.Event().wait(0.005)
    else:
        pytest.fail("the members did not re-join")
    threading.Event().wait(0.2)  # each is blocked in its wait
    summary_reads = [sum("#summary" in k for k in c.keys_read) for c in clients[:3]]
    rejoin_body_reads = [sum("/state/" in k for k in c.keys_read) for c in clients[:3]]
    for client in clients:
        client.keys_read.clear()
    assert handlers[3].shutdown()
    for t in rejoined:
        t.join(90)
    try:
        assert all(info is not None and info.world_size == 3 for info in infos[:3])
        # Each re-joined on the summary; the state body was read only by the
        # member that wrote the round's leave (its compare-and-set) and the
        # one whose seal waits for the fourth.
        assert all(n >= 1 for n in summary_reads), summary_reads
        assert sum(n > 0 for n in rejoin_body_reads) <= 2, rejoin_body_reads
        after = [c.keys_read for c in clients[:3]]
        # After the leave: two of the three (all but the sealer) read no
        # state and no summary: the leave woke them not, the seal did.
        untouched = [k for k in after if not any("/state/" in x or "#summary" in x for x in k)]
        assert len(untouched) >= 2, after
    finally:
        for h in handlers:
            h.pre_shutdown()


class _RacedBackend(C10dRendezvousBackend):
    """Another node writes the state between this one's token and summary reads, ``races`` times."""

    def __init__(self, store: HashStore, races: int) -> None:
        super().__init__(store, "raced")
        self.races = races
        self.other = shared_state(C10dRendezvousBackend(store, "raced"), "c10d")
        self.written: dict[object, RendezvousState] = {}

    def write(self, state: RendezvousState) -> None:
        current = self.other.read()[1]
        result = self.other.write(state, encode_state(state), current)
        assert result is not None
        assert result[2]
        self.written[result[1]] = state

    def read_seat(self, token: object, node: str) -> bytes | None:
        if self.races:
            self.races -= 1
            self.write(RendezvousState(4 + self.races, (A, B, C), bootstrap_port=7))
        return super().read_seat(token, node)


@pytest.mark.parametrize("races", [0, 1, 2, 5])
def test_a_join_starts_on_a_summary_even_when_writes_race_with_its_reads(races: int) -> None:
    backend = _RacedBackend(HashStore(timeout=5), races)
    backend.write(RendezvousState(9, (A, B, C), bootstrap_port=7))
    view, token = shared_state(backend, "c10d").read_view()
    # The summary of the very write whose token comes with it, never the state.
    assert view == StateSummary.of(backend.written[token])


def test_bytes_read_per_member_do_not_grow_with_the_round() -> None:
    medians = []
    for size in (8, 48):
        _, clients, _ = _form(size)
        reads = sorted(c.bytes_read for c in clients)
        medians.append(reads[len(reads) // 2])
    small, large = medians
    # The state lists 28 bytes a member: a member reading it would read 6x more at 48.
    assert large <= small * 1.2, medians


def test_num_nodes_waiting_reads_the_backend_at_most_once_per_gap() -> None:
    """Agents ask every monitor interval; a round of N reads at most
    WAITING_POLLS_PER_SECOND times a second in all (waiting_poll_gap), on the
    handler's own clock."""
    frozen: list[float | None] = [None]  # real time until the round formed, then held

    def clock() -> float:
        held = frozen[0]
        return time.monotonic() if held is None else held

    shared = HashStore(timeout=30)
    clients = [ReadRecordingStore(shared) for _ in range(3)]
    handlers = _handlers(clients, "gap", (2, 3), "10.6.0", clock=clock)
    threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in handlers[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    member, client = handlers[0], clients[0]
    frozen[0] = time.monotonic()
    try:
        assert member.num_nodes_waiting() == 0
        asked = len(client.keys_read)
        assert [member.num_nodes_waiting() for _ in range(20)] == [0] * 20
        assert len(client.keys_read) == asked, "a repeated ask within the gap read the store"
        ended: list[BaseException] = []

        def late_join() -> None:
            try:
                handlers[2].next_rendezvous()
            except RendezvousClosedError as exc:  # the close below ends its wait
                ended.append(exc)

        late = threading.Thread(target=late_join, daemon=True)
        late.start()
        for _ in range(2000):  # the third node waits in the next round's queue
            if shared.add("shared/rdzv.backend/gap/q/1/n", 0) == 1:
                break
            threading.Event().wait(0.005)
        assert member.num_nodes_waiting() == 0, "the answer within the gap is the last one"
        # Past the gap (by twice it: at a clock of tens of thousands of s, adding
        # the 1 ms gap and subtracting again can come out a hair short).
        frozen[0] = clock() + 2 * waiting_poll_gap(2)
        assert member.num_nodes_waiting() == 1
        assert len(client.keys_read) > asked
        # The late node would wait forever on the held clock (its join
        # deadline never comes): close the run, and it ends its join.
        member.set_closed()
        late.join(30)
        assert not late.is_alive(), "the late node kept waiting after the close"
        assert len(ended) == 1
    finally:
        for h in handlers:
            h.pre_shutdown()


def test_an_unchanged_round_is_polled_without_reading_the_state() -> None:
    shared = HashStore(timeout=30)
    clients = [ReadRecordingStore(shared) for _ in range(3)]
    handlers = _handlers(clients, "poll", (3, 3), "10.2.0", keep_alive=5)
    threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    try:
        for client, handler in zip(clients, handlers, strict=True):
            before = len(client.keys_read)
            assert [handler.num_nodes_waiting() for _ in range(5)] == [0] * 5
            assert not any("/state/" in k for k in client.keys_read[before:])
        # A member leaves: the token changes, the others read the state and
        # re-join (once the last answer's gap passed: waiting_poll_gap).
        assert handlers[2].shutdown()
        threading.Event().wait(waiting_poll_gap(3))
        assert [h.num_nodes_waiting() for h in handlers[:2]] == [1, 1]
    finally:
        for h in handlers:
            h.pre_shutdown()


def test_a_waiting_node_whose_summary_was_replaced_reads_the_newest_one_not_the_state() -> None:
    """Members that re-join together race with the leave and the eviction:
    the head a waiting node looked at can be replaced, summary and all,
    before it reads that head's summary. It reads the newest write's
    summary then; it read the whole state before (dozens of 28 KB reads in
    a recovery of 1,024 beside a second one)."""
    store = HashStore(timeout=5)
    backend = _RacedBackend(store, races=0)
    backend.write(RendezvousState(2, (A, B, C), bootstrap_port=7))
    seen = backend.other.read()[1]
    backend.write(RendezvousState(3, (A, B, C), bootstrap_port=7))  # the head moved on
    backend.races = 1  # and moves again between the node's look at it and its summary read
    shared = shared_state(backend, "c10d", REAL_TIME)
    view, token, seated = shared.wait(D, None, seen, 9, 0.05, 0, 5.0)
    assert seated is None
    assert isinstance(view, StateSummary)
    assert view == StateSummary.of(backend.written[token])
