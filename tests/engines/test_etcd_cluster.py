"""A 3-member etcd cluster on loopback: the leader dies during concurrent CAS writes."""

from __future__ import annotations

import threading

import pytest

from rdzv.backends.etcd import EtcdRendezvousBackend, parse_endpoints
from rdzv.backends.etcd.client import EtcdClientBase
from rdzv.backends.etcd.gateway import EtcdClient
from tests.engines.servers import etcd_cluster, kill_process
from tests.procs import wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def _local_read(member_endpoint: str, key: bytes) -> bytes | None:
    """Read ``key`` from one member's own copy (serializable read, no leader involved)."""
    client = EtcdClient(parse_endpoints(member_endpoint), read_timeout=5)
    try:
        kvs, _ = client.range(key, serializable=True)
        return kvs[0].value if kvs else None
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_no_acknowledged_write_is_lost_when_the_leader_dies(
    etcd_client_type: type[EtcdClientBase],
) -> None:
    writers, per_writer = 4, 25
    with etcd_cluster(3) as cluster:
        endpoints = parse_endpoints(cluster.endpoints)
        clients = [etcd_client_type(endpoints, read_timeout=20) for _ in range(writers)]
        try:
            backends = [EtcdRendezvousBackend(c, "ha", key_prefix="/ha/") for c in clients]
            backends[0].set_state(b"")
            acked: list[list[bytes]] = [[] for _ in range(writers)]
            attempted: set[bytes] = set()
            errors: list[BaseException] = []
            halfway = threading.Event()
            lock = threading.Lock()

            def run(i: int) -> None:
                try:
                    backend = backends[i]
                    current = backend.get_state()
                    assert current is not None
                    state, token = current
                    for n in range(per_writer):
                        item = f"<{i}.{n}>".encode()
                        with lock:
                            attempted.add(item)
                        for _ in range(1000):
                            result = backend.set_state(state + item, token)
                            assert result is not None
                            state, token, written = result
                            if written:
                                acked[i].append(item)
                                break
                        else:
                            raise AssertionError("writer starved")  # noqa: TRY301 - recorded below
                        if i == 0 and n == per_writer // 3:
                            halfway.set()
                except BaseException as exc:
                    errors.append(exc)
                    halfway.set()

            threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
            for t in threads:
                t.start()
            assert halfway.wait(60)
            leader = cluster.leader()
            assert leader.proc is not None
            kill_process(leader.proc)
            for t in threads:
                t.join(timeout=100)
            assert not any(t.is_alive() for t in threads)
            assert not errors, errors

            final = backends[1].get_state()
            assert final is not None
            items = [x + b">" for x in final[0].split(b">") if x]
            every_ack = [x for per in acked for x in per]
            assert len(every_ack) == writers * per_writer
            assert set(every_ack) <= set(items), "an acknowledged write was lost"
            assert set(items) <= attempted
            # Each writer's items appear in its own order (a write whose reply was
            # lost and that lost the retry too may appear twice; never out of order).
            for i in range(writers):
                mine = list(dict.fromkeys(x for x in items if x.startswith(f"<{i}.".encode())))
                assert mine == sorted(mine, key=lambda x: int(x[1:-1].split(b".")[1]))

            # Every surviving member converges to the same value.
            survivors = [m for m in cluster.members if m.alive]
            assert len(survivors) == 2
            key = backends[0].key
            wait_until(
                lambda: (
                    {_local_read(m.endpoint, key) for m in survivors}
                    == {b"rdzv-state/1\n" + final[0]}
                ),
                "the survivors to converge",
                20,
            )
        finally:
            for c in clients:
                c.close()
