"""Corrupt etcd and Redis records are state errors; the contract itself is in tests/conformance."""

from __future__ import annotations

from typing import Any

import pytest

from rdzv.errors import RendezvousStateError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.etcd
def test_corrupt_etcd_value_is_a_state_error(etcd_client: Any, unique: str) -> None:
    from rdzv.backends.etcd import EtcdRendezvousBackend

    backend = EtcdRendezvousBackend(etcd_client, unique, key_prefix="/test/")
    etcd_client.put(backend.key, b"not a state")
    with pytest.raises(RendezvousStateError, match="not an rdzv rendezvous state"):
        backend.get_state()
    with pytest.raises(RendezvousStateError, match="not an rdzv rendezvous state"):
        backend.set_state(b"x", 12345)


@pytest.mark.redis
@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda r, k: r.set(k, b"x"), "not a hash"),
        (lambda r, k: r.hset(k, mapping={b"v": b"x"}), "missing"),
        (lambda r, k: r.hset(k, mapping={b"v": b"x", b"rev": b"abc"}), "not an integer"),
        (lambda r, k: r.hset(k, mapping={b"v": b"x", b"rev": b""}), "not an integer"),
    ],
)
def test_corrupt_redis_record_is_a_state_error(
    redis_client: Any, unique: str, setup: Any, message: str
) -> None:
    from rdzv.backends.redis import RedisRendezvousBackend

    backend = RedisRendezvousBackend(redis_client, unique, key_prefix="test:")
    setup(redis_client, backend.key)
    with pytest.raises(RendezvousStateError, match=message):
        backend.get_state()
    with pytest.raises(RendezvousStateError, match=message):
        backend.set_state(b"y", 5)
    with pytest.raises(RendezvousStateError, match=message):
        backend.set_state(b"y")
