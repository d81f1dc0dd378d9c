"""A reusable conformance suite for rendezvous backends.

Every backend runs the same checks: the fencing-token rules of
:class:`~rdzv.backends.base.RendezvousBackend`, concurrent writers from
threads, corrupt stored state, and the checks of each optional capability
the backend offers. Use it from pytest like this::

    from rdzv.testing.conformance import BACKEND_CHECKS, BackendHarness

    @pytest.mark.parametrize("check", BACKEND_CHECKS, ids=lambda c: c.name)
    def test_conformance(check, my_harness: BackendHarness) -> None:
        check.run(my_harness)   # skips itself when a capability is missing

or call :func:`run_conformance` to run every applicable check at once. The
suite imports nothing but the standard library and rdzv: a check that does
not apply raises :class:`unittest.SkipTest`, which pytest and unittest
report as a skip. :mod:`rdzv.testing.store_conformance` is its twin for
stores.

Size: one check per rule of the contract and of each capability, and the
list that runs them; apart, a capability's checks would leave the list.
"""

from __future__ import annotations

import threading
import unittest
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from rdzv.backends.base import (
    MAX_RECORD_SIZE,
    JoinQueueBackend,
    LivenessBackend,
    RendezvousBackend,
    SeatedBackend,
    VerdictBackend,
    WatchableBackend,
)
from rdzv.errors import RendezvousStateError

__all__ = [
    "BACKEND_CHECKS",
    "BackendHarness",
    "CapabilityMissing",
    "Check",
    "ConformanceError",
    "run_conformance",
]

_THREADS = 8
_T = TypeVar("_T")


class ConformanceError(AssertionError):
    """A backend broke its contract; the message says how."""


class CapabilityMissing(Exception):  # noqa: N818 - a signal, not an error
    """The check needs a capability the backend does not offer."""


class BackendHarness(ABC):
    """Gives the suite connections to ONE fresh run of the backend under test."""

    @abstractmethod
    def connect(self) -> RendezvousBackend:
        """Return a new client of the harness's run (all share the same storage).

        The suite may use several at once from threads.
        """

    @abstractmethod
    def corrupt_state(self) -> None:
        """Overwrite the stored state with a record the backend cannot decode."""

    def connect_other_run(self) -> RendezvousBackend | None:
        """Return a client of a second, empty run next to the harness's run.

        The checks that runs are kept apart need it; they are skipped when it
        returns None, which the default does.
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release the harness's resources; the default does nothing."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ConformanceError(message)


def _some(value: _T | None) -> _T:
    if value is None:
        raise ConformanceError("a call returned None where the contract promises a result")
    return value


def _need(backend: RendezvousBackend, capability: Callable[..., _T]) -> _T:
    """Return ``backend`` as a ``capability`` (an ABC); CapabilityMissing if it is none."""
    if not isinstance(backend, cast(type, capability)):
        raise CapabilityMissing(f"{type(backend).__name__} is not a {capability.__name__}")
    return cast(_T, backend)


@dataclass(frozen=True)
class Check:
    """One conformance check.

    Attributes:
        name: A short identifier.
        capability: The capability ABC it needs, or None for the base contract.
        body: The check; it raises :class:`ConformanceError` on a violation.
    """

    name: str
    capability: type | None
    body: Callable[[BackendHarness], None]

    def applies_to(self, backend: RendezvousBackend) -> bool:
        """Tell whether the backend offers what the check needs."""
        return self.capability is None or isinstance(backend, self.capability)

    def run(self, harness: BackendHarness) -> None:
        """Run the check, skipping it when the backend lacks what it needs.

        Raises:
            ConformanceError: The backend broke its contract.
            unittest.SkipTest: The check does not apply (a skip under pytest
                and unittest).
        """
        try:
            self.body(harness)
        except CapabilityMissing as exc:
            raise unittest.SkipTest(str(exc)) from exc


def _other_run(harness: BackendHarness) -> RendezvousBackend:
    other = harness.connect_other_run()
    if other is None:
        raise CapabilityMissing(f"{type(harness).__name__} cannot connect to a second run")
    return other


def _fencing_create(harness: BackendHarness) -> None:
    backend = harness.connect()
    _expect(backend.get_state() is None, "get_state() on an empty run must return None")
    created = backend.set_state(b"one")
    _expect(created is not None, "set_state(token=None) on an empty run must write")
    assert created is not None
    state, token, written = created
    _expect(written and state == b"one", f"creating must return (b'one', token, True): {created}")
    read = backend.get_state()
    _expect(read == (b"one", token), f"get_state() must return what was written: {read}")
    again = backend.set_state(b"two")
    _expect(
        again == (b"one", token, False),
        f"set_state(token=None) over an existing state must not write: {again}",
    )
    read = backend.get_state()
    _expect(read == (b"one", token), f"a refused create must leave the state alone: {read}")


def _fencing_update(harness: BackendHarness) -> None:
    backend = harness.connect()
    created = _some(backend.set_state(b"a"))
    _, token_a, _ = created
    updated = backend.set_state(b"b", token_a)
    _expect(
        updated is not None and updated[0] == b"b" and updated[2],
        f"set_state with the current token must write: {updated}",
    )
    assert updated is not None
    token_b = updated[1]
    _expect(token_b != token_a, "a write must produce a new token")
    read = backend.get_state()
    _expect(read == (b"b", token_b), f"get_state() must return the update: {read}")
    stale = backend.set_state(b"c", token_a)
    _expect(
        stale == (b"b", token_b, False),
        f"a stale token must not write and must return the current state: {stale}",
    )
    read = backend.get_state()
    _expect(read == (b"b", token_b), f"a stale write must leave the state alone: {read}")
    same_bytes = backend.set_state(b"b", token_b)
    _expect(
        same_bytes is not None and same_bytes[2] and same_bytes[1] != token_b,
        "writing identical bytes must still produce a new token (no ABA)",
    )


def _fencing_invalid_tokens(harness: BackendHarness) -> None:
    backend = harness.connect()
    created = _some(backend.set_state(b"kept"))
    token = created[1]
    invalid = (object(), "not-a-token", b"\x00garbage", b"x", -1, 0, True, 10**30, 3.5)
    for bad in invalid:
        result = backend.set_state(b"lost", bad)
        _expect(
            result == (b"kept", token, False),
            f"an invalid token {bad!r} must not write and must return the state: {result}",
        )
    read = backend.get_state()
    _expect(read == (b"kept", token), f"the state must be unchanged: {read}")


def _fencing_token_on_empty(harness: BackendHarness) -> None:
    backend = harness.connect()
    empty = _other_run(harness)
    created = _some(backend.set_state(b"x"))
    result = empty.set_state(b"y", created[1])
    _expect(result is None, f"a token on an empty run must not write and return None: {result}")
    _expect(empty.get_state() is None, f"the empty run must stay empty: {empty.get_state()}")
    read = backend.get_state()
    _expect(read == (b"x", created[1]), f"the first run must be untouched: {read}")


def _runs_isolated(harness: BackendHarness) -> None:
    first = harness.connect()
    second = _other_run(harness)
    first.set_state(b"A")
    second.set_state(b"B")
    read_first, read_second = first.get_state(), second.get_state()
    _expect(read_first is not None and read_first[0] == b"A", f"run one lost: {read_first}")
    _expect(read_second is not None and read_second[0] == b"B", f"run two lost: {read_second}")


def _large_binary_state(harness: BackendHarness) -> None:
    backend = harness.connect()
    blob = bytes(range(256)) * 1024
    created = _some(backend.set_state(blob))
    _expect(created[2], "a 256 KiB state must be written")
    read = harness.connect().get_state()
    _expect(read == (blob, created[1]), "a 256 KiB state of every byte value must round-trip")


def _run_threads(count: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def body(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            target(index)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    _expect(not any(t.is_alive() for t in threads), "a concurrent writer hung for 60 s")
    if errors:
        raise ConformanceError(f"a concurrent writer failed: {errors[0]!r}") from errors[0]


def _concurrent_single_winner(harness: BackendHarness) -> None:
    backends = [harness.connect() for _ in range(_THREADS)]
    _some(backends[0].set_state(b"base"))
    lock = threading.Lock()
    for round_no in range(5):
        read = _some(backends[0].get_state())
        wins: list[int] = []

        def write(
            index: int, token: object = read[1], round_no: int = round_no, wins: list[int] = wins
        ) -> None:
            result = backends[index].set_state(f"r{round_no}w{index}".encode(), token)
            if result is not None and result[2]:
                with lock:
                    wins.append(index)

        _run_threads(_THREADS, write)
        _expect(len(wins) == 1, f"exactly one writer must win per token, got {wins}")
        final = backends[0].get_state()
        _expect(
            final is not None and final[0] == f"r{round_no}w{wins[0]}".encode(),
            f"the winner's state must be stored: {final}",
        )


def _concurrent_no_lost_update(harness: BackendHarness) -> None:
    backends = [harness.connect() for _ in range(4)]
    backends[0].set_state(b"0")
    per_thread = 15

    def increment(index: int) -> None:
        backend = backends[index]
        done = 0
        for _ in range(10_000):
            read = _some(backend.get_state())
            result = backend.set_state(str(int(read[0]) + 1).encode(), read[1])
            if result is not None and result[2]:
                done += 1
                if done == per_thread:
                    return
        raise ConformanceError("a writer could not complete its increments")

    _run_threads(len(backends), increment)
    final = backends[0].get_state()
    _expect(
        final is not None and int(final[0]) == per_thread * len(backends),
        f"compare-and-set lost updates: {final}",
    )


def _corrupt_state(harness: BackendHarness) -> None:
    backend = harness.connect()
    backend.set_state(b"fine")
    harness.corrupt_state()
    for call in (backend.get_state, lambda: backend.set_state(b"x", None)):
        try:
            call()
        except RendezvousStateError:
            continue
        except Exception as exc:
            raise ConformanceError(
                f"corrupt state must raise RendezvousStateError, not {exc!r}"
            ) from exc
        raise ConformanceError("corrupt state must raise RendezvousStateError")


def _watch(harness: BackendHarness) -> None:
    backend = _need(harness.connect(), WatchableBackend)
    _expect(backend.wait_for_state(None, 0.0) is None, "waiting on an empty run gives None")
    writer = harness.connect()
    created = _some(writer.set_state(b"v1"))
    token = created[1]
    same = backend.wait_for_state(token, 0.05)
    _expect(same == (b"v1", token), f"an unchanged state must come back on timeout: {same}")
    seen: list[object] = []

    def wait() -> None:
        seen.append(backend.wait_for_state(token, 30.0))

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    updated = _some(writer.set_state(b"v2", token))
    thread.join(timeout=30)
    _expect(not thread.is_alive(), "wait_for_state did not wake up on a write")
    _expect(seen == [(b"v2", updated[1])], f"wait_for_state must return the new state: {seen}")
    from_none = backend.wait_for_state(None, 0.0)
    _expect(from_none == (b"v2", updated[1]), f"token None returns any state: {from_none}")


def _seats(harness: BackendHarness) -> None:
    backend = _need(harness.connect(), SeatedBackend)
    _expect(backend.read_token() is None, "an empty run has no token")
    _expect(backend.wait_for_token(None, 0.0) is None, "waiting on an empty run gives None")
    seats = {"a#1#x": b"seat of a", "b#1#y": b"seat of b"}
    created = _some(backend.set_state_seated(b"v1", None, seats))
    _expect(created[2], f"a seated create must win: {created}")
    token = created[1]
    reader = harness.connect()
    assert isinstance(reader, SeatedBackend)
    _expect(reader.read_token() == token, "read_token must return the written token")
    for node, seat in seats.items():
        # Another client sees a member's seat once the store took it.
        _expect(reader.wait_for_seat(None, node, 5.0) == token, f"{node} is seated by the write")
        got = reader.read_seat(token, node)
        _expect(got == seat, f"read_seat({node!r}) must return its seat: {got!r}")
    _expect(reader.read_seat(token, "c#1#z") is None, "a node without a seat reads None")
    # A write that loses its compare-and-set stores no seat anyone reads (it
    # may have replaced the winner's: the reader then reads the state).
    lost = reader.set_state_seated(b"v-lost", None, {"a#1#x": b"loser"})
    _expect(lost is not None and not lost[2], "a stale seated write must lose")
    after = reader.read_seat(token, "a#1#x")
    _expect(after in (b"seat of a", None), f"a losing write's seat was read: {after!r}")
    # The seat belongs to its write: a later write's token has none.
    updated = _some(reader.set_state(b"v2", token))
    _expect(reader.read_seat(updated[1], "a#1#x") is None, "an unseated write has no seats")
    _expect(reader.read_seat(token, "b#1#y") == b"seat of b", "a seat reads for its own token")
    woke = backend.wait_for_token(token, 5.0)
    _expect(woke == updated[1], f"wait_for_token must return the new token: {woke!r}")
    same = backend.wait_for_token(updated[1], 0.05)
    _expect(same == updated[1], f"an unchanged token must come back on timeout: {same!r}")
    reseated = _some(reader.set_state_seated(b"v3", updated[1], {"a#1#x": b"next seat of a"}))
    _expect(reader.read_seat(reseated[1], "a#1#x") == b"next seat of a", "a reseat reads back")
    _expect(reader.read_seat(token, "a#1#x") is None, "a replaced seat reads None")
    # wait_for_seat: a write that seats the node ends the wait with its token.
    seen: list[object] = []
    waiter = threading.Thread(
        target=lambda: seen.append(backend.wait_for_seat(reseated[1], "a#1#x", 5.0)), daemon=True
    )
    waiter.start()
    fourth = _some(reader.set_state_seated(b"v4", reseated[1], {"a#1#x": b"fourth seat of a"}))
    waiter.join(10.0)
    _expect(seen == [fourth[1]], f"wait_for_seat must return the seating write's token: {seen}")
    same = backend.wait_for_seat(fourth[1], "a#1#x", 0.05)
    _expect(same == fourth[1], f"an unchanged token must come back on timeout: {same!r}")
    # A write that seats it not ends the wait at once or at the timeout, with its token.
    unseated = _some(reader.set_state(b"v5", fourth[1]))
    later = backend.wait_for_seat(fourth[1], "a#1#x", 0.2)
    _expect(later == unseated[1], f"wait_for_seat must return the stored token: {later!r}")


def _queue_basics(harness: BackendHarness) -> None:
    backend = _need(harness.connect(), JoinQueueBackend)
    _expect(backend.queue_length(0) == 0, "an unused queue is empty")
    _expect(backend.queue_records(0) == [], "an unused queue has no records")
    odd = b"\n\x00:|" + bytes(range(256))
    big = b"x" * MAX_RECORD_SIZE
    _expect(backend.enqueue(0, b"first") == 1, "the first record gets position 1")
    _expect(backend.enqueue(0, odd) == 2, "the second record gets position 2")
    _expect(backend.enqueue(0, big) == 3, "the third record gets position 3")
    _expect(backend.enqueue(1, b"other") == 1, "rounds have separate queues")
    _expect(backend.queue_length(0) == 3, "queue_length counts records")
    records = backend.queue_records(0)
    _expect(records == [b"first", odd, big], f"records come back exactly, in order: {records}")
    _expect(backend.wait_queue_length(0, 3, 0.05) == 3, "an unchanged length comes back on timeout")
    _expect(backend.wait_queue_length(0, 1, 5.0) == 3, "a changed length comes back at once")
    for bad_round, bad_record in ((-1, b"x"), (0, b""), (0, b"x" * (MAX_RECORD_SIZE + 1))):
        try:
            backend.enqueue(bad_round, bad_record)
        except ValueError:
            continue
        raise ConformanceError(f"enqueue({bad_round}, {len(bad_record)} bytes) must raise")
    backend.drop_queue(0)
    backend.drop_queue(0)
    _expect(backend.queue_length(0) == 0, "a dropped queue is empty")
    _expect(backend.queue_records(1) == [b"other"], "dropping one round keeps the others")


def _queue_concurrent(harness: BackendHarness) -> None:
    backends = [_need(harness.connect(), JoinQueueBackend) for _ in range(_THREADS)]
    positions: dict[int, int] = {}
    lock = threading.Lock()
    per_thread = 5

    def push(index: int) -> None:
        for item in range(per_thread):
            position = backends[index].enqueue(7, f"n{index}-{item}".encode())
            with lock:
                positions[index * per_thread + item] = position

    _run_threads(_THREADS, push)
    total = _THREADS * per_thread
    _expect(
        sorted(positions.values()) == list(range(1, total + 1)),
        f"positions must be distinct and gap-free: {sorted(positions.values())}",
    )
    records = backends[0].queue_records(7)
    expected = sorted(f"n{i}-{j}".encode() for i in range(_THREADS) for j in range(per_thread))
    _expect(sorted(records) == expected, f"every record must be stored exactly once: {records}")
    for index in range(_THREADS):
        mine = [r for r in records if r.startswith(f"n{index}-".encode())]
        _expect(
            mine == sorted(mine, key=lambda r: int(r.split(b"-")[1])),
            f"one writer's records must keep their order: {mine}",
        )


def _queue_wait_wakes(harness: BackendHarness) -> None:
    waiter = _need(harness.connect(), JoinQueueBackend)
    writer = _need(harness.connect(), JoinQueueBackend)
    seen: list[int] = []
    thread = threading.Thread(
        target=lambda: seen.append(waiter.wait_queue_length(3, 0, 30.0)), daemon=True
    )
    thread.start()
    writer.enqueue(3, b"wake")
    thread.join(timeout=30)
    _expect(not thread.is_alive(), "wait_queue_length did not wake up on enqueue")
    _expect(seen == [1], f"wait_queue_length must return the new length: {seen}")


def _confirmation_queue(harness: BackendHarness) -> None:
    backend = _need(harness.connect(), JoinQueueBackend)
    confirms = backend.confirmation_queue()
    if confirms is None:
        raise CapabilityMissing("the backend offers no confirmation queues")
    backend.enqueue(2, b"join")
    _expect(confirms.queue_length(2) == 0, "confirmations do not see join records")
    _expect(confirms.enqueue(2, b"a") == 1, "the first confirmation gets position 1")
    _expect(confirms.enqueue(2, b"b") == 2, "the second confirmation gets position 2")
    _expect(confirms.queue_records(2) == [b"a", b"b"], "confirmations come back in order")
    _expect(backend.queue_records(2) == [b"join"], "the join queue does not see confirmations")
    other = _need(harness.connect(), JoinQueueBackend)
    mirror = other.confirmation_queue()
    _expect(
        mirror is not None and mirror.queue_length(2) == 2,
        "another connection to the run sees the same confirmations",
    )
    confirms.drop_queue(2)
    _expect(confirms.queue_length(2) == 0, "a dropped confirmation queue is empty")
    _expect(backend.queue_records(2) == [b"join"], "dropping confirmations keeps the join queue")


def _verdict(harness: BackendHarness) -> None:
    backend, other = harness.connect(), _need(harness.connect(), VerdictBackend)
    assert isinstance(backend, VerdictBackend)
    token = _some(backend.set_state(b"sealed"))[1]
    _expect(other.wait_for_verdict(3, token, 0.05) is None, "with neither, the wait times out")
    backend.set_verdict(3)
    _expect(other.wait_for_verdict(3, token, 5.0) is True, "a verdict stored before ends the wait")
    _expect(other.wait_for_verdict(4, token, 0.05) is None, "each round has its own verdict")
    later = _some(backend.set_state(b"evicted", token))[1]
    _expect(other.wait_for_verdict(3, token, 5.0) is True, "the verdict comes before a write")
    _expect(other.wait_for_verdict(4, token, 5.0) is False, "a write after the token ends the wait")
    _expect(other.wait_for_verdict(4, later, 0.05) is None, "a write up to the token does not")
    other.drop_verdict(3)
    _expect(backend.wait_for_verdict(3, later, 0.05) is None, "a dropped verdict is gone")
    _expect(
        _woken(lambda: other.wait_for_verdict(5, later, 30.0), lambda: backend.set_verdict(5)),
        "a verdict stored during the wait ends it",
    )
    _expect(
        _woken(
            lambda: other.wait_for_verdict(6, later, 30.0) is False,
            lambda: backend.set_state(b"closed", later),
        ),
        "a write during the wait ends it",
    )


def _woken(wait: Callable[[], object], act: Callable[[], object]) -> bool:
    """Run ``wait`` on a thread, ``act`` once it blocks; whether ``wait`` returned truthy in time."""
    seen: list[object] = []
    thread = threading.Thread(target=lambda: seen.append(wait()), daemon=True)
    thread.start()
    thread.join(timeout=0.2)
    act()
    thread.join(timeout=30)
    return not thread.is_alive() and bool(seen[0])


def _liveness(harness: BackendHarness) -> None:
    backend = _need(harness.connect(), LivenessBackend)
    other = _need(harness.connect(), LivenessBackend)
    _expect(backend.heartbeat_mark("n1") is None, "a node that never beat has no mark")
    backend.beat("n1")
    first = other.heartbeat_mark("n1")
    _expect(first is not None, "a beat must create a mark visible to other clients")
    _expect(other.heartbeat_mark("n1") == first, "reading a mark must not change it")
    backend.beat("n1")
    second = other.heartbeat_mark("n1")
    _expect(second is not None and second != first, "every beat must change the mark")
    _expect(other.heartbeat_mark("n2") is None, "nodes have separate marks")
    _expect(
        other.heartbeat_marks(["n2", "n1"]) == {"n2": None, "n1": second},
        "heartbeat_marks must return every node's heartbeat_mark",
    )
    _expect(other.heartbeat_marks([]) == {}, "heartbeat_marks of no nodes is empty")
    for bad in ("", "has space", "x" * 257):
        try:
            backend.beat(bad)
        except ValueError:
            continue
        raise ConformanceError(f"beat({bad!r}) must raise ValueError")
    backend.forget("n1")
    backend.forget("n1")
    _expect(other.heartbeat_mark("n1") is None, "a forgotten node has no mark")


BACKEND_CHECKS: list[Check] = [
    Check("fencing_create", None, _fencing_create),
    Check("fencing_update", None, _fencing_update),
    Check("fencing_invalid_tokens", None, _fencing_invalid_tokens),
    Check("fencing_token_on_empty_run", None, _fencing_token_on_empty),
    Check("runs_isolated", None, _runs_isolated),
    Check("large_binary_state", None, _large_binary_state),
    Check("concurrent_single_winner", None, _concurrent_single_winner),
    Check("concurrent_no_lost_update", None, _concurrent_no_lost_update),
    Check("corrupt_state", None, _corrupt_state),
    Check("watch", WatchableBackend, _watch),
    Check("seats", SeatedBackend, _seats),
    Check("queue_basics", JoinQueueBackend, _queue_basics),
    Check("queue_concurrent", JoinQueueBackend, _queue_concurrent),
    Check("queue_wait_wakes", JoinQueueBackend, _queue_wait_wakes),
    Check("confirmation_queue", JoinQueueBackend, _confirmation_queue),
    Check("verdict", VerdictBackend, _verdict),
    Check("liveness", LivenessBackend, _liveness),
]


def run_conformance(factory: Callable[[], BackendHarness]) -> list[str]:
    """Run every applicable check, each on a fresh harness; return the names of those that ran.

    Raises:
        ConformanceError: A check failed; the message names it.
    """
    return _run_checks(BACKEND_CHECKS, factory, lambda check, h: check.applies_to(h.connect()))


def _run_checks(
    checks: Sequence[Any], factory: Callable[[], Any], applies: Callable[[Any, Any], bool]
) -> list[str]:
    """Run each check that ``applies`` on a fresh harness (both suites' loop)."""
    ran: list[str] = []
    for check in checks:
        harness = factory()
        try:
            if not applies(check, harness):
                continue
            try:
                check.body(harness)
            except CapabilityMissing:
                continue
            except ConformanceError as exc:
                raise ConformanceError(f"{check.name}: {exc}") from exc
            ran.append(check.name)
        finally:
            harness.close()
    return ran
