"""Items 1 and 6: etcd's ``create_backend`` fails as torch's does, at once when etcd is
unreachable; Redis's checks its server the same way."""

from __future__ import annotations

import time
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous import etcd_rendezvous_backend as torch_etcd

import rdzv
from rdzv.backends import etcd as rdzv_etcd
from tests.procs import free_port
from tests.torchcompat.helpers import same_error

pytestmark = pytest.mark.timeout(60)


def both(endpoint: str, **config: Any) -> tuple[object, object]:
    return (
        lambda: torch_etcd.create_backend(
            torch_api.RendezvousParameters("etcd-v2", endpoint, "run", 1, 1, **config)
        ),
        lambda: rdzv_etcd.create_backend(
            rdzv.RendezvousParameters("etcd-v2", endpoint, "run", 1, 1, **config)
        ),
    )


@pytest.mark.parametrize(
    ("endpoint", "config"),
    [
        ("127.0.0.1:2379", {"protocol": "ftp"}),
        ("127.0.0.1:2379", {"protocol": "grpc"}),
        ("127.0.0.1:2379", {"read_timeout": "0"}),
        ("127.0.0.1:2379", {"read_timeout": "-1"}),
        ("127.0.0.1:2379", {"read_timeout": "soon"}),
        ("127.0.0.1:http", {}),
        ("127.0.0.1:99999", {}),
        ("bad host:2379", {}),
    ],
)
def test_invalid_options(endpoint: str, config: dict[str, str]) -> None:
    torch_call, rdzv_call = both(endpoint, **config)
    same_error(torch_call, rdzv_call, ValueError)  # type: ignore[arg-type]


def test_an_unreachable_etcd_fails_at_once() -> None:
    pytest.importorskip("etcd", reason="torch's etcd backend needs python-etcd (rdzv[dev])")
    torch_call, rdzv_call = both(f"127.0.0.1:{free_port()}")
    start = time.monotonic()
    same_error(
        torch_call,  # type: ignore[arg-type]
        rdzv_call,  # type: ignore[arg-type]
        torch_api.RendezvousConnectionError,
        rdzv.RendezvousConnectionError,
    )
    # Both fail within the connect attempt, not at the 60 s read timeout.
    assert time.monotonic() - start < 30


@pytest.mark.redis
def test_an_unreachable_redis_fails_at_once() -> None:
    from rdzv.backends import redis as rdzv_redis

    port = free_port()
    start = time.monotonic()
    with pytest.raises(
        rdzv.RendezvousConnectionError,
        match=rf"^The connection to Redis has failed\..*127\.0\.0\.1:{port}",
    ):
        rdzv_redis.create_backend(rdzv.RendezvousParameters("redis", f"127.0.0.1:{port}", "r"))
    assert time.monotonic() - start < 30
