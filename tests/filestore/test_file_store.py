"""rdzv's FileStore beyond the shared suites (tests/conformance runs the Store suite
and the backend suite over a file): torch's on-disk format, locking, and a
rendezvous across processes with no server."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rdzv import RendezvousParameters, create_handler
from rdzv.errors import RendezvousConnectionError, RendezvousStateError, StoreTimeoutError
from rdzv.store.file import FileStore
from tests.procs import subprocess_env

NODE = str(Path(__file__).with_name("file_node.py"))

pytestmark = pytest.mark.timeout(60)

LATE_WRITER = (
    "import sys, time; from rdzv.store.file import FileStore; "
    "s = FileStore(sys.argv[1]); time.sleep(0.3); s.set('late', 'here'); s.close()"
)
ADDER = (
    "import sys; from rdzv.store.file import FileStore; s = FileStore(sys.argv[1]); "
    "[s.add('n', 1) for _ in range(200)]; s.close()"
)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "store"


def test_the_store_api(path: Path) -> None:
    a, b = FileStore(path, timeout=2), FileStore(path, timeout=2)
    a.set("k", "v")
    assert b.get("k") == b"v"
    assert b.add("n", 5) == 5
    assert a.add("n", -2) == 3
    assert a.compare_set("c", "", "x") == b"x"
    assert b.compare_set("c", "nope", "y") == b"x"
    assert b.compare_set("absent", "nope", "y") == b"nope"
    assert not a.check(["absent"])
    a.append("log", "ab")
    b.append("log", "cd")
    assert a.get("log") == b"abcd"
    b.multi_set(["m1", "m2"], ["1", b"2"])
    assert a.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert a.try_multi_get(["m1", "absent"]) == [b"1", None]
    assert sorted(a.list_keys()) == ["c", "k", "log", "m1", "m2", "n"]
    assert a.num_keys() == 6
    assert b.delete_key("k")
    assert not a.delete_key("k")
    assert not a.check(["k"])
    a.queue_push("q", "first")
    b.queue_push("q", "second")
    assert a.queue_len("q") == 2
    assert b.queue_pop("q") == b"first"
    assert a.queue_pop("q") == b"second"
    with pytest.raises(StoreTimeoutError):
        a.queue_pop("q", block=False)
    with pytest.raises(ValueError, match="not an integer"):
        a.add("log", 1)
    a.close()
    b.close()


def test_blocking_calls_wait_for_another_process_and_time_out(path: Path) -> None:
    store = FileStore(path, timeout=0.3)
    with pytest.raises(StoreTimeoutError, match="'late'"):
        store.get("late")
    with pytest.raises(StoreTimeoutError):
        store.wait(["late"], timeout=0.1)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LATE_WRITER,
            str(path),
        ],
        env=subprocess_env(),
    )
    try:
        assert store.watch("late", None, 30) == b"here"
        store.wait(["late"], timeout=5)
        assert store.get("late") == b"here"
    finally:
        assert writer.wait(30) == 0
    assert store.watch("late", b"here", 0.05) == b"here"  # unchanged: previous at the timeout
    store.close()


def test_adds_from_threads_and_processes_are_not_lost(path: Path) -> None:
    store = FileStore(path, timeout=10)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ADDER,
            str(path),
        ],
        env=subprocess_env(),
    )
    threads = [
        threading.Thread(target=lambda: [store.clone().add("n", 1) for _ in range(100)])
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert child.wait(30) == 0
    assert store.add("n", 0) == 400


def test_the_last_user_removes_the_file_when_counted(path: Path) -> None:
    kept = FileStore(path)
    kept.close()
    assert path.exists()  # world_size -1: never removed (torch's default)
    first, second = FileStore(path, world_size=2), FileStore(path, world_size=2)
    first.close()
    assert path.exists()
    second.close()
    assert not path.exists()
    second.close()  # again: nothing
    with pytest.raises(RendezvousConnectionError, match="closed"):
        second.set("k", "v")


def test_a_torn_record_is_a_state_error(path: Path) -> None:
    store = FileStore(path)
    store.set("k", "v")
    with path.open("ab") as f:
        f.write(struct.pack("=I", 10) + b"abc")  # a writer died mid-record
    with pytest.raises(RendezvousStateError, match="torn record"):
        store.get("k")


def test_a_file_that_cannot_be_opened_is_a_connection_error(tmp_path: Path) -> None:
    with pytest.raises(RendezvousConnectionError, match="cannot be opened"):
        FileStore(tmp_path / "no" / "such" / "dir" / "store")


def test_a_held_lock_ends_at_the_store_timeout(path: Path) -> None:
    import fcntl

    store = FileStore(path, timeout=0.3)
    with path.open("rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(RendezvousConnectionError, match="stayed locked"):
            store.set("k", "v")
    store.set("k", "v")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_three_processes_rendezvous_through_a_file_with_no_server(path: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, NODE, str(path), "filejob", "3"],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    summaries = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=100)
            assert proc.returncode == 0, err
            summaries.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert sorted(s["rank"] for s in summaries) == [0, 1, 2]
    assert {s["world_size"] for s in summaries} == {3}
    assert len({tuple(s["participants"]) for s in summaries}) == 1
    assert all(s["seen"] == [0, 1, 2] for s in summaries)
    assert {s["backend"] for s in summaries} == {"c10d"}


def test_an_empty_endpoint_is_a_private_file_removed_on_close() -> None:
    handler = create_handler(
        RendezvousParameters("c10d", "", "solo", 1, 1, store_type="file", last_call_timeout="0.1")
    )
    store = handler.store  # type: ignore[attr-defined]
    assert isinstance(store, FileStore)
    file = store.path
    assert os.path.exists(file)
    start = time.monotonic()
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert time.monotonic() - start < 30
    handler.shutdown()
    handler.close()  # type: ignore[attr-defined]
    assert not os.path.exists(file)
