"""Items 1 and 3: the c10d ``create_backend`` fails as torch's does, and ``store_type=file``
shares torch's ``FileStore`` format both ways."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as torch_dist
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as torch_c10d

import rdzv
from rdzv.backends import store as rdzv_c10d
from rdzv.store.file import FileStore
from tests.procs import free_port
from tests.torchcompat.helpers import same_error

pytestmark = pytest.mark.timeout(60)


def both(endpoint: str, **config: Any) -> tuple[object, object]:
    return (
        lambda: torch_c10d.create_backend(
            torch_api.RendezvousParameters("c10d", endpoint, "run", 1, 1, **config)
        ),
        lambda: rdzv_c10d.create_backend(
            rdzv.RendezvousParameters("c10d", endpoint, "run", 1, 1, **config)
        ),
    )


@pytest.mark.parametrize(
    ("endpoint", "config"),
    [
        ("127.0.0.1:1", {"store_type": "etcd"}),
        ("127.0.0.1:1", {"store_type": "hash"}),
        ("127.0.0.1:1", {"read_timeout": "0"}),
        ("127.0.0.1:1", {"read_timeout": "-5"}),
        ("127.0.0.1:1", {"read_timeout": "soon"}),
        ("127.0.0.1:1", {"is_host": "perhaps"}),
        ("127.0.0.1:http", {}),
        ("127.0.0.1:70000", {}),
        ("bad host:1", {}),
        ("http://h:1", {}),
    ],
)
def test_invalid_options(endpoint: str, config: dict[str, str]) -> None:
    torch_call, rdzv_call = both(endpoint, **config)
    same_error(torch_call, rdzv_call, ValueError)  # type: ignore[arg-type]


@pytest.mark.slow
def test_an_unreachable_store() -> None:
    torch_call, rdzv_call = both(f"127.0.0.1:{free_port()}", is_host="false", read_timeout="1")
    same_error(
        torch_call,  # type: ignore[arg-type]
        rdzv_call,  # type: ignore[arg-type]
        torch_api.RendezvousConnectionError,
        rdzv.RendezvousConnectionError,
    )


def test_a_file_store_that_cannot_be_opened(tmp_path: Path) -> None:
    torch_call, rdzv_call = both(str(tmp_path), store_type="file")  # a directory
    same_error(
        torch_call,  # type: ignore[arg-type]
        rdzv_call,  # type: ignore[arg-type]
        torch_api.RendezvousConnectionError,
        rdzv.RendezvousConnectionError,
    )


def test_store_type_file_opens_the_same_store_as_torchs(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    params: dict[str, Any] = {"store_type": "file"}
    torch_backend, torch_store = torch_c10d.create_backend(
        torch_api.RendezvousParameters("c10d", path, "run", 1, 1, **params)
    )
    rdzv_backend, rdzv_store = rdzv_c10d.create_backend(
        rdzv.RendezvousParameters("c10d", path, "run", 1, 1, **params)
    )
    assert torch_backend.name == rdzv_backend.name == "c10d"
    assert isinstance(torch_store, torch_dist.FileStore)  # type: ignore[attr-defined]
    assert isinstance(rdzv_store, FileStore)
    rdzv_store.set("from-rdzv", "1")
    torch_store.set("from-torch", "2")
    assert torch_store.get("from-rdzv") == b"1"
    assert rdzv_store.get("from-torch") == b"2"
    rdzv_backend.close()
    rdzv_store.close()


def test_rdzv_writes_torch_reads(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    mine = FileStore(path, timeout=5)
    mine.set("k", b"\x00\xffraw")
    mine.add("n", 41)
    mine.compare_set("c", "", "first")
    mine.append("log", "ab")
    mine.multi_set(["m1", "m2"], ["1", "2"])
    mine.set("gone", "x")
    mine.delete_key("gone")
    theirs = torch_dist.FileStore(path, -1)  # type: ignore[attr-defined]
    assert theirs.get("k") == b"\x00\xffraw"
    assert theirs.add("n", 1) == 42
    assert theirs.compare_set("c", "first", "second") == b"second"
    theirs.append("log", "cd")  # type: ignore[attr-defined]
    assert theirs.multi_get(["m1", "m2", "log"]) == [b"1", b"2", b"abcd"]
    assert not theirs.check(["gone"])
    assert mine.get("c") == b"second"
    assert mine.add("n", 0) == 42


def test_torch_writes_rdzv_reads(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    theirs = torch_dist.FileStore(path, -1)  # type: ignore[attr-defined]
    theirs.set("k", "v")
    theirs.add("n", 7)
    theirs.compare_set("c", "", "x")
    theirs.set("gone", "x")
    theirs.delete_key("gone")
    mine = FileStore(path, timeout=5)
    assert mine.get("k") == b"v"
    assert mine.add("n", 1) == 8
    assert mine.compare_set("c", "y", "z") == b"x"
    assert not mine.check(["gone"])
    assert sorted(mine.list_keys()) == ["c", "k", "n"]


def test_concurrent_adds_from_torch_and_rdzv_are_not_lost(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    mine = FileStore(path, timeout=10)
    theirs = torch_dist.FileStore(path, -1)  # type: ignore[attr-defined]
    threads = [
        threading.Thread(target=lambda: [mine.add("n", 1) for _ in range(150)]),
        threading.Thread(target=lambda: [theirs.add("n", 1) for _ in range(150)]),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert mine.add("n", 0) == theirs.add("n", 0) == 300


def test_an_rdzv_user_counts_toward_torchs_removal(tmp_path: Path) -> None:
    path = tmp_path / "store"
    mine = FileStore(path, world_size=2)
    theirs = torch_dist.FileStore(str(path), 2)  # type: ignore[attr-defined]
    theirs.set("k", "v")
    del theirs  # torch's user counts out; rdzv's still holds the file
    assert path.exists()
    assert mine.get("k") == b"v"
    mine.close()
    assert not path.exists()
