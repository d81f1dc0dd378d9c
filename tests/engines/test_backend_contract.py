"""The RendezvousBackend contract (fencing-token CAS) on a real etcd and a real Redis."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rdzv.errors import RendezvousStateError
from tests.engines.conftest import BackendFactory

pytestmark = pytest.mark.timeout(60)


def test_empty_backend_has_no_state(make_backend: BackendFactory, unique: str) -> None:
    backend = make_backend(unique)
    assert backend.get_state() is None


def test_create_with_none_token_then_read_back(make_backend: BackendFactory, unique: str) -> None:
    backend = make_backend(unique)
    state, token, written = backend.set_state(b"first")
    assert (state, written) == (b"first", True)
    assert backend.get_state() == (b"first", token)


def test_none_token_on_existing_state_is_stale(make_backend: BackendFactory, unique: str) -> None:
    backend = make_backend(unique)
    _, token, _ = backend.set_state(b"first")
    assert backend.set_state(b"second") == (b"first", token, False)
    assert backend.get_state() == (b"first", token)


def test_current_token_writes_and_changes_token(make_backend: BackendFactory, unique: str) -> None:
    backend = make_backend(unique)
    _, token1, _ = backend.set_state(b"one")
    state, token2, written = backend.set_state(b"two", token1)
    assert (state, written) == (b"two", True)
    assert token2 != token1
    assert backend.get_state() == (b"two", token2)


def test_stale_token_returns_current_without_writing(
    make_backend: BackendFactory, unique: str
) -> None:
    backend = make_backend(unique)
    _, token1, _ = backend.set_state(b"one")
    _, token2, _ = backend.set_state(b"two", token1)
    assert backend.set_state(b"three", token1) == (b"two", token2, False)
    assert backend.get_state() == (b"two", token2)


@pytest.mark.parametrize("bad", ["junk", -5, 0, 3.5, True, b"x"])
def test_invalid_token_is_treated_as_stale(
    make_backend: BackendFactory, unique: str, bad: Any
) -> None:
    backend = make_backend(unique)
    _, token, _ = backend.set_state(b"one")
    assert backend.set_state(b"two", bad) == (b"one", token, False)


def test_token_with_nothing_stored_returns_none(make_backend: BackendFactory, unique: str) -> None:
    backend = make_backend(unique)
    other = make_backend(unique + "x")
    _, token, _ = other.set_state(b"elsewhere")
    assert backend.set_state(b"one", token) is None
    assert backend.get_state() is None


def test_runs_are_isolated(make_backend: BackendFactory, unique: str) -> None:
    a, b = make_backend(unique + "a"), make_backend(unique + "b")
    a.set_state(b"A")
    b.set_state(b"B")
    assert a.get_state()[0] == b"A"
    assert b.get_state()[0] == b"B"


def test_binary_and_large_states_round_trip(make_backend: BackendFactory, unique: str) -> None:
    backend = make_backend(unique)
    blob = bytes(range(256)) * 1024
    _, token, _ = backend.set_state(blob)
    assert backend.get_state() == (blob, token)


def test_concurrent_writers_never_lose_an_acknowledged_write(
    make_backend: BackendFactory, unique: str
) -> None:
    """Several threads append their tag by CAS; every acknowledged append is in the end state."""
    writers, rounds = 4, 15
    backends = [make_backend(unique) for _ in range(writers)]
    backends[0].set_state(b"")
    acked: list[list[bytes]] = [[] for _ in range(writers)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            backend = backends[i]
            current = backend.get_state()
            assert current is not None
            state, token = current
            for n in range(rounds):
                item = f"{i}.{n};".encode()
                for _ in range(500):
                    result = backend.set_state(state + item, token)
                    assert result is not None
                    state, token, written = result
                    if written:
                        acked[i].append(item)
                        break
                else:
                    raise AssertionError("writer starved")  # noqa: TRY301 - recorded below
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not errors, errors
    final = backends[0].get_state()
    assert final is not None
    items = [x + b";" for x in final[0].split(b";") if x]
    assert sorted(items) == sorted(x for per in acked for x in per)
    assert len(items) == writers * rounds


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
