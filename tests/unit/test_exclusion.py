"""The exclusion record: K failures in a row, a cool-down that doubles, the count reset, its codec."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from rdzv.backends.store import C10dRendezvousBackend
from rdzv.exclusion import (
    KIND_HEALTH,
    KIND_WORKERS,
    MAX_COOLDOWN,
    ExclusionPolicy,
    ExclusionRecord,
    ExclusionRecordError,
    check_node_name,
    decode_record,
    encode_record,
    read_record,
    read_records,
    write_record,
)
from rdzv.keys import exclusion_index_key, exclusion_key
from rdzv.status import HeartbeatTracker, format_status, read_status
from rdzv.store.memory import HashStore
from rdzv.testing import FakeClock

POLICY = ExclusionPolicy(after=3, cooldown=10.0)


def fail(record: ExclusionRecord, clock: FakeClock, kind: str = KIND_HEALTH) -> ExclusionRecord:
    return record.failed(kind, f"{kind} failed", clock(), POLICY)


def test_k_failures_in_a_row_exclude_the_node_for_the_cooldown() -> None:
    clock = FakeClock()
    record = ExclusionRecord("n1")
    for count in (1, 2):
        record = fail(record, clock)
        assert record.failures == count
        assert not record.excluded(clock())
    record = fail(record, clock)
    assert record.excluded(clock())
    assert (record.exclusions, record.failures, record.cooldown) == (1, 0, 10.0)
    clock.advance(9.5)
    assert record.left(clock()) == pytest.approx(0.5)
    clock.advance(0.5)
    assert not record.excluded(clock())


def test_the_cooldown_doubles_at_each_exclusion_up_to_the_cap() -> None:
    clock = FakeClock()
    record = ExclusionRecord("n1")
    lengths = []
    for _ in range(4):
        for _ in range(POLICY.after):
            record = fail(record, clock, KIND_WORKERS)
        lengths.append(record.left(clock()))
        clock.advance(record.left(clock()))
    assert lengths == [10.0, 20.0, 40.0, 80.0]
    assert POLICY.cooldown_of(10_000) == MAX_COOLDOWN


def test_a_success_restarts_the_count_but_not_the_doubling() -> None:
    clock = FakeClock()
    record = fail(fail(ExclusionRecord("n1"), clock, KIND_WORKERS), clock, KIND_WORKERS)
    record = record.attempt_ended_well()
    assert record.failures == 0
    # two more are not three in a row
    record = fail(fail(record, clock, KIND_WORKERS), clock, KIND_WORKERS)
    assert not record.excluded(clock())
    record = fail(record, clock, KIND_WORKERS)
    assert record.left(clock()) == 10.0
    clock.advance(10.0)
    record = record.attempt_ended_well()
    for _ in range(3):
        record = fail(record, clock, KIND_WORKERS)
    assert record.left(clock()) == 20.0


def test_a_passing_check_ends_a_run_of_failed_checks_only() -> None:
    clock = FakeClock()
    checks = fail(fail(ExclusionRecord("n1"), clock), clock).passed_check()
    assert checks.failures == 0
    # a worker failure is not undone by the next join's passing check
    workers = fail(ExclusionRecord("n1"), clock, KIND_WORKERS).passed_check()
    assert workers.failures == 1
    mixed = fail(fail(workers, clock), clock)
    assert mixed.excluded(clock())


def test_without_k_failures_never_exclude() -> None:
    clock = FakeClock()
    record = ExclusionRecord("n1")
    off = ExclusionPolicy()
    assert not off.enabled
    for _ in range(50):
        record = record.failed(KIND_HEALTH, "x", clock(), off)
    assert (record.failures, record.exclusions, record.excluded(clock())) == (50, 0, False)


def test_time_left_is_never_more_than_the_cooldown() -> None:
    # a wall clock stepped back by an hour does not keep the node out for an hour
    record = ExclusionRecord("n1", exclusions=1, cooldown=10.0, until=5000.0)
    assert record.left(5000.0 - 3600.0) == 10.0


@pytest.mark.parametrize(
    ("after", "cooldown"), [(-1, 10.0), (1, 0.0), (1, -5.0), (1, MAX_COOLDOWN * 2)]
)
def test_a_bad_policy_names_its_option(after: int, cooldown: float) -> None:
    with pytest.raises(ValueError, match=r"exclude_after|exclude_cooldown"):
        ExclusionPolicy(after, cooldown)


@pytest.mark.parametrize("name", ["", "a/b", "a b", "x" * 201, "n\n1"])
def test_a_bad_node_name_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="node name"):
        check_node_name(name)


def test_the_record_round_trips_and_describes_itself() -> None:
    record = ExclusionRecord("10.0.0.7", 0, 2, KIND_HEALTH, "health check 'x' failed", 20.0, 1e9)
    assert decode_record(encode_record(record)) == record
    assert decode_record(changed()) == ExclusionRecord("n")
    line = record.describe(1e9 - 5)
    assert line.startswith("10.0.0.7 excluded until ")
    assert "(5 s left of 20 s, exclusion 2): health check 'x' failed" in line
    assert "failed 2 time(s) in a row" in ExclusionRecord("n", 2, reason="r").describe(0)
    assert "\\x1b" in ExclusionRecord("n", 1, reason="\x1b[2J").describe(0)


GOOD = {
    "v": 1,
    "node": "n",
    "failures": 0,
    "exclusions": 0,
    "kind": "",
    "reason": "",
    "cooldown": 0,
    "until": 0,
}


def changed(**fields: object) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff",
        b"[]",
        b"x" * 5000,
        changed(v=2),
        changed(node="a/b"),
        changed(failures=-1),
        changed(exclusions=True),
        changed(kind="other"),
        changed(reason=7),
        changed(cooldown=MAX_COOLDOWN + 1),
        changed(until="soon"),
        changed(until=float("inf")),
    ],
)
def test_a_bad_stored_value_is_a_record_error(raw: bytes) -> None:
    with pytest.raises(ExclusionRecordError):
        decode_record(raw)


def test_the_store_lists_each_node_once() -> None:
    store = HashStore()
    first = ExclusionRecord("n1", 1, reason="one")
    write_record(store, "job", first, first=True)
    write_record(store, "job", first.attempt_ended_well(), first=False)
    write_record(store, "job", ExclusionRecord("n2", 2), first=True)
    write_record(store, "job", ExclusionRecord("n2", 3), first=True)
    store.set(exclusion_index_key("job"), store.get(exclusion_index_key("job")) + b"n3\n")
    store.set(exclusion_key("job", "n3"), b"not json")
    assert read_record(store, "job", "n1") == ExclusionRecord("n1", reason="one")
    assert read_record(store, "job", "n9") is None
    records, notes = read_records(store, "job")
    assert [(r.node, r.failures) for r in records] == [("n1", 0), ("n2", 3)]
    assert len(notes) == 1
    assert "exclusion record of n3 does not decode" in notes[0]
    assert read_records(store, "other") == ([], [])


def test_status_lists_the_excluded_and_failing_nodes_even_before_a_round() -> None:
    store = HashStore()
    backend = C10dRendezvousBackend(store, "job")
    now = time.time()
    excluded = ExclusionRecord("10.0.0.7", 0, 1, KIND_HEALTH, "health check 'x' failed", 60.0)
    write_record(store, "job", replace(excluded, until=now + 60.0), first=True)
    write_record(store, "job", ExclusionRecord("10.0.0.8", 2, 0, KIND_WORKERS, "w"), first=True)
    write_record(store, "job", ExclusionRecord("10.0.0.9", 0, 3), first=True)  # healthy again
    store.set(exclusion_index_key("job"), store.get(exclusion_index_key("job")) + b"bad\n")
    store.set(exclusion_key("job", "bad"), b"{}")
    read = read_status(backend, "job", HeartbeatTracker(), store=store)
    assert read.known  # nothing else of the run is in the store yet
    assert [r.node for r in read.excluded] == ["10.0.0.7", "10.0.0.8"]
    lines = format_status(read).splitlines()
    assert lines[-3].startswith("node 10.0.0.7 excluded until ")
    assert lines[-3].endswith("s left of 60 s, exclusion 1): health check 'x' failed")
    assert lines[-2] == "node 10.0.0.8 failed 2 time(s) in a row, not excluded: w"
    assert lines[-1].startswith("the exclusion record of bad does not decode")
    assert read.to_json()["excluded"][1]["failures"] == 2
