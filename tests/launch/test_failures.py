"""The first-failure record: its codec, the create-only race, and an agent's side of it."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from pathlib import Path

import pytest

from rdzv import HashStore, PrefixStore, RendezvousInfo
from rdzv.errors import RendezvousConnectionError
from rdzv.first_failure import (
    KIND_HUNG,
    MAX_RECORD_BYTES,
    FailureRecord,
    FailureRecordError,
    decode_failure,
    encode_failure,
    read_last,
    record_first,
)
from rdzv.keys import first_failure_key, last_failure_key, round_store_prefix
from rdzv.launch.exits import WorkerExit
from rdzv.launch.failures import FirstFailure, record_of
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore

pytestmark = pytest.mark.timeout(60)

# 2030-01-31 12:03:04 local time.
WHEN = time.mktime((2030, 1, 31, 12, 3, 4, 0, 0, -1))


def killed(rank: int = 3, local_rank: int = 1) -> WorkerExit:
    return WorkerExit(rank, local_rank, 4242, -9, Path("/logs/job/attempt_2/rank_3.log"))


def record(**fields: object) -> FailureRecord:
    base = record_of(
        killed(), host="host-b", when=WHEN, group_rank=1, node="10.0.0.2#7#ab", round=5, restart=2
    )
    return FailureRecord(**{**base.__dict__, **fields})


def test_a_killed_worker_is_described_in_one_line() -> None:
    first = record()
    assert first.kind == "signal"
    assert first.signal == "SIGKILL"
    assert first.exit_code is None
    assert first.describe() == (
        "worker rank 3 on host-b (node 1, local rank 1) was killed by signal SIGKILL "
        "at 12:03:04 (round 5, restart 2); log: /logs/job/attempt_2/rank_3.log"
    )


def test_an_exit_code_a_root_cause_and_a_hang_are_described() -> None:
    failed = WorkerExit(0, 0, 1, 7, None, "ValueError: bad input (at train.py:12 in main)")
    exited = record_of(failed, host="h", when=WHEN, restart=0)
    assert (exited.kind, exited.exit_code, exited.signal) == ("exit", 7, None)
    assert exited.describe() == (
        "worker rank 0 on h (local rank 0) exited with code 7 at 12:03:04 (restart 0): "
        "ValueError: bad input (at train.py:12 in main)"
    )
    hung = record_of(
        killed(),
        host="h",
        when=WHEN,
        kind=KIND_HUNG,
        detail="no progress for 300 s",
        stack="/logs/rank_3.stacks",
    )
    assert hung.describe() == (
        "worker rank 3 on h (local rank 1) hung at 12:03:04 (restart 0): no progress for "
        "300 s; log: /logs/job/attempt_2/rank_3.log; stacks: /logs/rank_3.stacks"
    )
    assert decode_failure(encode_failure(hung)) == hung


def test_a_worker_the_watchdog_ended_is_recorded_as_hung() -> None:
    ended = WorkerExit(
        3, 1, 4242, -9, None, hang=" (no progress for 5 s); stacks in /logs/rank_3.stacks"
    )
    hung = record_of(ended, host="h", when=WHEN)
    assert hung.kind == KIND_HUNG
    assert hung.describe() == (
        "worker rank 3 on h (local rank 1) hung at 12:03:04 (restart 0): hung (no progress "
        "for 5 s); stacks in /logs/rank_3.stacks"
    )


def test_a_record_survives_its_encoding() -> None:
    first = record(detail="RuntimeError: é ✓")
    raw = encode_failure(first)
    assert raw.isascii()
    assert decode_failure(raw) == first


def test_long_strings_are_cut_and_the_longest_record_stays_under_the_limit() -> None:
    # Control characters take 6 bytes each in JSON: the worst case.
    huge = record(host="\x01" * 10_000, node="n" * 10_000, detail="\x02" * 10_000)
    huge = FailureRecord(**{**huge.__dict__, "log": "\x03" * 10_000, "stack": "\x04" * 10_000})
    raw = encode_failure(huge)
    assert len(raw) <= MAX_RECORD_BYTES
    back = decode_failure(raw)
    assert back.host == "\x01" * 125 + "..."
    assert len(back.detail or "") == 400
    assert "\x01" not in back.describe()  # escaped for a terminal
    assert "\\x01" in back.describe()


def _mangled(**changes: object) -> bytes:
    data = json.loads(encode_failure(record()))
    data.update(changes)
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (_mangled(v=2), "version 2"),
        (_mangled(kind=None), "kind is missing"),
        (_mangled(rank="3"), "rank is not a 32-bit integer"),
        (_mangled(rank=True), "rank is not a 32-bit integer"),
        (_mangled(rank=1 << 40), "rank is not a 32-bit integer"),
        (_mangled(host=["x"]), "host is not a string"),
        (_mangled(detail="x" * 401), "detail is not a string of at most 400"),
        (_mangled(time=float("nan")), "time is not a time"),
        (_mangled(time=1e300), "time is not a time"),
        (_mangled(kind="Rm -rf"), "kind 'Rm -rf' is not a lower-case word"),
        (b" " * (MAX_RECORD_BYTES + 1), "over the limit"),
    ],
)
def test_what_does_not_decode_is_a_record_error(raw: bytes, why: str) -> None:
    with pytest.raises(FailureRecordError, match=why):
        decode_failure(raw)


def test_garbage_only_ever_raises_the_record_error() -> None:
    rng = random.Random(49)
    good = encode_failure(record())
    for _ in range(2000):
        raw = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        with contextlib.suppress(FailureRecordError):
            decode_failure(bytes(raw[: rng.randint(0, len(raw))]))


def test_a_later_version_may_add_kinds() -> None:
    other = record(kind="oom-killed", signal=None)
    assert (
        decode_failure(encode_failure(other))
        .describe()
        .startswith("worker rank 3 on host-b (node 1, local rank 1) oom-killed at 12:03:04")
    )


def _race(port: int, round_key: str, mine: list[FailureRecord]) -> list[bytes]:
    """Let one client per record write it create-only at once; return what each got back."""
    clients = [TCPStore("127.0.0.1", port, timeout=10) for _ in mine]
    got: list[bytes] = [b""] * len(mine)
    ready = threading.Barrier(len(mine))

    def write(i: int) -> None:
        ready.wait(timeout=10)
        got[i] = record_first(PrefixStore(round_key, clients[i]), mine[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(mine))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    for c in clients:
        c.close()
    return got


def test_two_writers_race_on_a_real_store_and_exactly_one_wins() -> None:
    with TCPStoreServer("127.0.0.1", 0) as server:
        for attempt in range(10):
            mine = [record(rank=rank, round=attempt) for rank in range(2)]
            got = _race(server.port, f"rdzv/job/round/{attempt}", mine)
            # Both got the same record back, and it is one of theirs.
            assert got[0] == got[1]
            assert decode_failure(got[0]) in mine
            won = [got[i] == encode_failure(mine[i]) for i in range(2)]
            assert won.count(True) == 1


def _round(store: HashStore, round_id: int) -> RendezvousInfo:
    return RendezvousInfo(PrefixStore(round_store_prefix("job", round_id), store), 0, 2)


def test_one_first_failure_per_round_named_by_the_agents_that_lost() -> None:
    store = HashStore()
    notes: list[str] = []
    agents = [FirstFailure("job", f"node-{i}", notes.append, host=f"host-{i}") for i in range(2)]
    for group_rank, agent in enumerate(agents):
        agent.round_started(_round(store, 4), group_rank, restart=1)
    # Before any failure: no suffix, nothing at the run level.
    assert agents[1].after("a node is waiting") == "a node is waiting"
    assert read_last(store, "job") is None
    first = agents[1].report(killed(rank=3))
    assert first is not None
    assert (first.host, first.group_rank, first.round, first.restart) == ("host-1", 1, 4, 1)
    # The winner's own lines describe the failure already: no suffix.
    assert agents[1].after("restarting") == "restarting"
    # The loser gets the winner's record back from its own write.
    lost = agents[0].report(WorkerExit(0, 0, 1, 1, None))
    assert lost == first
    assert (
        agents[0]
        .after("restarting")
        .startswith(
            "restarting after the first failure: worker rank 3 on host-1 (node 1, local rank 1) "
            "was killed by signal SIGKILL at "
        )
    )
    assert read_last(store, "job") == first
    # The next round has its own first failure; the run-level key follows it.
    for group_rank, agent in enumerate(agents):
        agent.round_started(_round(store, 5), group_rank, restart=2)
    assert agents[0].first() is None
    again = agents[0].report(WorkerExit(1, 1, 2, 5, None))
    assert again is not None
    assert again.round == 5
    assert read_last(store, "job") == again
    assert agents[1].first() == again
    assert notes == []


def test_a_record_that_does_not_decode_is_ignored_with_a_note() -> None:
    store = HashStore()
    notes: list[str] = []
    agent = FirstFailure("job", None, notes.append)
    info = _round(store, 0)
    agent.round_started(info, 0, restart=0)
    assert isinstance(info.store, PrefixStore)
    info.store.set(first_failure_key(), b"\x00garbage")
    assert agent.report(killed()) is None
    assert agent.after("restarting") == "restarting"
    assert agent.first() is None
    assert len(notes) == 1
    assert "ignoring the round's first-failure record, which does not decode" in notes[0]
    store.set(last_failure_key("job"), b"{}")
    with pytest.raises(FailureRecordError):
        read_last(store, "job")


class _DeadStore(HashStore):
    def compare_set(self, key: str, expected: object, desired: object) -> bytes:
        raise RendezvousConnectionError("the store is gone")


def test_a_store_that_fails_costs_a_note_not_the_agent() -> None:
    notes: list[str] = []
    agent = FirstFailure("job", None, notes.append)
    agent.round_started(_round(_DeadStore(), 0), 0, restart=0)
    assert agent.report(killed()) is None
    assert notes == [
        "could not record the first failure: RendezvousConnectionError: the store is gone"
    ]
