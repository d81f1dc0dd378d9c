"""Item 2: ``rdzv.torch.as_torch_store`` gives torch a real ``torch.distributed.Store``;
a gloo process group initialised from ``info.store`` through it all-reduces across processes."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as torch_dist

from rdzv.store.file import FileStore
from rdzv.store.memory import HashStore, PrefixStore
from rdzv.torch import as_torch_store
from tests.procs import free_port, subprocess_env

WORKER = str(Path(__file__).with_name("gloo_worker.py"))


def test_a_real_torch_store_that_keeps_the_prefix() -> None:
    base = HashStore(timeout=5)
    store = as_torch_store(PrefixStore("rdzv/run/round/3", base))
    assert isinstance(store, torch_dist.Store)  # type: ignore[attr-defined]
    store.set("k", "v")
    assert base.get("rdzv/run/round/3/k") == b"v"
    # torch's own PrefixStore over it stacks its prefix on rdzv's, through C++.
    stacked = torch_dist.PrefixStore("default_pg", store)  # type: ignore[attr-defined]
    stacked.set("k", "w")
    assert base.get("rdzv/run/round/3/default_pg/k") == b"w"
    assert stacked.get("k") == b"w"
    assert stacked.add("n", 2) == 2
    assert stacked.compare_set("c", "", "x") == b"x"
    assert stacked.check(["k", "n"])
    stacked.wait(["k"], timedelta(seconds=1))
    stacked.append("log", "ab")  # type: ignore[attr-defined]
    stacked.multi_set(["m1", "m2"], ["1", "2"])  # type: ignore[attr-defined]
    assert stacked.multi_get(["m1", "m2", "log"]) == [b"1", b"2", b"ab"]
    assert store.list_keys() == list(PrefixStore("rdzv/run/round/3", base).list_keys())
    assert store.delete_key("k")
    assert store.num_keys() == base.num_keys()
    store.queue_push("q", "item")
    assert store.queue_len("q") == 1
    assert store.queue_pop("q") == b"item"


def _script(store: torch_dist.Store) -> list[object]:  # type: ignore[name-defined]
    """The Store calls torch's own code makes, through torch's PrefixStore as a process group."""
    pg = torch_dist.PrefixStore("default_pg/0", store)  # type: ignore[attr-defined]
    out: list[object] = []
    pg.set("k", "v")
    out.append(pg.get("k"))
    out.append(pg.add("n", 3))
    out.append(pg.add("n", -1))
    out.append(pg.compare_set("c", "", "first"))
    out.append(pg.compare_set("c", "wrong", "second"))
    out.append(pg.compare_set("absent", "wrong", "second"))
    out.append(pg.check(["k", "n"]))
    out.append(pg.check(["k", "absent"]))
    pg.wait(["k"], timedelta(seconds=1))
    pg.append("log", "ab")  # type: ignore[attr-defined]
    pg.append("log", "cd")  # type: ignore[attr-defined]
    pg.multi_set(["m1", "m2"], ["1", "2"])  # type: ignore[attr-defined]
    out.append(pg.multi_get(["m1", "m2", "log"]))
    out.append(store.delete_key("default_pg/0/k"))
    out.append(store.check(["default_pg/0/k"]))
    return out


def test_the_calls_give_what_torchs_own_store_gives() -> None:
    assert _script(as_torch_store(HashStore(timeout=5))) == _script(torch_dist.HashStore())  # type: ignore[attr-defined]


def test_timeouts_and_wait_are_torchs() -> None:
    store = as_torch_store(HashStore(timeout=5))
    store.set_timeout(timedelta(seconds=0.2))
    assert store.timeout == timedelta(seconds=0.2)  # type: ignore[attr-defined]
    with pytest.raises(torch_dist.DistStoreError):
        store.get("never")
    with pytest.raises(torch_dist.DistStoreError):
        store.wait(["never"], timedelta(seconds=0.1))


def test_only_rdzv_stores_are_adapted() -> None:
    """A torch store comes back as it is; anything else is a TypeError naming its type."""
    torch_store = torch_dist.HashStore()  # type: ignore[attr-defined]
    assert as_torch_store(torch_store) is torch_store
    with pytest.raises(TypeError, match="got dict"):
        as_torch_store({})  # type: ignore[arg-type]


def test_a_file_store_through_the_adapter_is_torchs_file_store_too(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    store = as_torch_store(FileStore(path, timeout=5))
    store.set("k", "v")
    assert torch_dist.FileStore(path, -1).get("k") == b"v"  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("store_type", ["tcp", "file"])
def test_gloo_all_reduce_over_the_rendezvous_store(store_type: str, tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}" if store_type == "tcp" else str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, endpoint, store_type, f"gloo-{store_type}", "2"],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    # gloo's rendezvous keys landed in the round's store, under its prefix.
    for r in results:
        assert [k for k in r["keys"] if "/cpu/" in k], r["keys"]
