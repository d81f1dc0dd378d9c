"""The chaos harness across network namespaces (``--net netns``): topology and partitions.

Theory of operation
-------------------
A :class:`NetnsTopology` makes a :class:`~rdzv.testing.netns.NetnsBed` with
one host per server (the ``rdzv serve`` store host, each etcd member, or the
Redis server) and ``max_nodes + 2`` agent hosts. Each agent the harness
starts runs inside a free agent host (``ip netns exec``), so agents, members
and the store host reach each other only over the bridge, and a partition
can separate any of them. There are no proxies here: the harness's
connection cuts and delays need them and are left out; partitions take
their place.

Faults (added to the harness's mix, see :data:`FAULTS`):

* ``split`` -- the hosts (servers and agents) are split into two random
  non-empty groups;
* ``isolate-leader`` -- the etcd raft leader's host (or the store or Redis
  host) is cut off together with a random minority of the agent hosts.

Each partition heals after a random 0.5-4 s, some shorter and some longer
than the keep-alive bound, and a new partition replaces the one in force.
The harness reads the stored state and writes its epoch key from inside
the first server host (:meth:`rdzv.testing.netns.Host.call`): this
process's own namespace does not reach the bed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

from rdzv.testing.netns import Host, NetnsBed
from tests.chaos.clusters import Cluster
from tests.netns.engines import NetnsEtcd, NetnsRedis
from tests.procs import subprocess_env

STORE_PORT = 29400
FAULTS = {"split": 2, "isolate-leader": 1}
"""The partition faults and their weights in the harness's random choice."""
SERVER_HOSTS = {"tcp": 1, "etcd": 1, "etcd3": 3, "redis": 1}


class _NetnsCluster(Cluster):
    """A cluster whose servers run in bed hosts; read and written from inside ``observer``."""

    def __init__(self, hosts: list[Host]) -> None:
        super().__init__()
        self.hosts = hosts
        self.observer = hosts[0]

    @property
    def agent_endpoint(self) -> str:
        return self.direct_endpoint

    def _try_set_epoch(self, epoch: int) -> bool:
        return self.observer.call(super()._try_set_epoch, epoch)

    def read_state(self) -> bytes | None:
        return self.observer.call(super().read_state)

    def leader_host(self) -> Host:
        """The host to cut off in an ``isolate-leader`` fault."""
        return self.hosts[0]


class NetnsStoreCluster(_NetnsCluster):
    """``rdzv serve`` on its own host: the c10d backend's store host."""

    rdzv_backend = "c10d"
    server_fault = "store-host-kill"

    def __init__(self, hosts: list[Host]) -> None:
        super().__init__(hosts)
        self.proc: subprocess.Popen[str] | None = None

    @property
    def direct_endpoint(self) -> str:
        return f"{self.hosts[0].ipv4}:{STORE_PORT}"

    def start(self) -> None:
        host = self.hosts[0]
        args = [sys.executable, "-m", "rdzv.cli", "serve", "--host", host.ipv4]
        proc = host.popen(
            [*args, "--port", str(STORE_PORT)], env=subprocess_env(), stderr=subprocess.DEVNULL
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("rdzv store listening on "):
            self._kill(proc)
            raise RuntimeError(f"the store host did not start: {line!r}")
        self.proc = proc

    @staticmethod
    def _kill(proc: subprocess.Popen[str]) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()

    def fault(self, rng: random.Random) -> bool:
        self._close_reader()
        proc, self.proc = self.proc, None
        if proc is not None:
            self._kill(proc)
        self.start()
        return True

    def stop(self) -> None:
        self._close_reader()
        proc, self.proc = self.proc, None
        if proc is not None:
            self._kill(proc)


class NetnsEtcdCluster(_NetnsCluster):
    """An etcd member per server host; a killed member restarts later from its data."""

    rdzv_backend = "etcd"
    server_fault = "etcd-member-kill"

    def __init__(self, hosts: list[Host]) -> None:
        super().__init__(hosts)
        self.etcd = NetnsEtcd(hosts)
        self._restarts: list[tuple[float, Host]] = []

    @property
    def direct_endpoint(self) -> str:
        return self.etcd.endpoints

    def start(self) -> None:
        self.etcd.__enter__()

    def fault(self, rng: random.Random) -> bool:
        running = [h for h in self.hosts if self.etcd.alive(h)]
        if running:
            member = rng.choice(running)
            self.etcd.kill(member)
            self._restarts.append((time.monotonic() + rng.uniform(1.0, 4.0), member))
        return False  # a member restarts from its data directory: nothing is lost

    def tick(self) -> None:
        now = time.monotonic()
        due = [h for at, h in self._restarts if at <= now]
        self._restarts = [(at, h) for at, h in self._restarts if at > now]
        for host in due:
            self.etcd.start(host, state="existing")

    def leader_host(self) -> Host:
        try:
            return self.etcd.leader(timeout=2.0)
        except RuntimeError:
            return self.hosts[0]  # no leader right now (a member down, an election)

    def stop(self) -> None:
        self._close_reader()
        self.etcd.close()


class NetnsRedisCluster(_NetnsCluster):
    """redis-server on its own host (no persistence: a restart starts empty)."""

    rdzv_backend = "redis"
    server_fault = "redis-kill"

    def __init__(self, hosts: list[Host]) -> None:
        super().__init__(hosts)
        self.redis = NetnsRedis(hosts[0])

    @property
    def direct_endpoint(self) -> str:
        return self.redis.endpoint

    def start(self) -> None:
        self.redis.start()

    def fault(self, rng: random.Random) -> bool:
        self._close_reader()
        self.redis.kill()
        self.redis.start()
        return True

    def stop(self) -> None:
        self._close_reader()
        self.redis.close()


class NetnsTopology:
    """The bed of one ``--net netns`` chaos run: server hosts, agent hosts, partitions.

    Args:
        backend: ``tcp``, ``etcd``, ``etcd3`` or ``redis``.
        agent_slots: How many agent hosts to make.
    """

    def __init__(self, backend: str, agent_slots: int) -> None:
        if backend not in SERVER_HOSTS:
            raise ValueError(f"unknown chaos backend {backend!r}; expected one of {SERVER_HOSTS}")
        self.servers = SERVER_HOSTS[backend]
        self.bed = NetnsBed(self.servers + agent_slots)
        self.bed.__enter__()
        try:
            hosts = self.bed.hosts[: self.servers]
            self.cluster: _NetnsCluster
            if backend == "tcp":
                self.cluster = NetnsStoreCluster(hosts)
            elif backend == "redis":
                self.cluster = NetnsRedisCluster(hosts)
            else:
                self.cluster = NetnsEtcdCluster(hosts)
        except BaseException:
            self.bed.close()
            raise
        self.agent_hosts = self.bed.hosts[self.servers :]
        self._occupants: dict[int, Any] = {}
        self._heal_at = 0.0

    def place(self, agent: Any, alive: Any) -> list[str]:
        """Choose a host for a new agent; return the command prefix that runs inside it.

        Args:
            agent: The new agent (remembered as the host's occupant).
            alive: Tells whether an earlier occupant still runs.
        """
        free = [h for h in self.agent_hosts if not alive(self._occupants.get(h.index))]
        host = free[0] if free else self.agent_hosts[0]
        self._occupants[host.index] = agent
        return host.command([])

    def inject(self, kind: str, rng: random.Random) -> str:
        """Start a partition of ``kind`` (see :data:`FAULTS`); return what was cut."""
        everyone = [h.index for h in self.bed.hosts]
        if kind == "split":
            shuffled = rng.sample(everyone, len(everyone))
            cut = rng.randrange(1, len(everyone))
            groups = [sorted(shuffled[:cut]), sorted(shuffled[cut:])]
        else:
            leader = self.cluster.leader_host().index
            agents = [h.index for h in self.agent_hosts]
            minority = rng.sample(agents, rng.randrange(0, (len(agents) - 1) // 2 + 1))
            groups = [sorted([leader, *minority])]
        self.bed.partition(groups)
        self._heal_at = time.monotonic() + rng.uniform(0.5, 4.0)
        return f"{kind} {groups}"

    def tick(self) -> bool:
        """Heal the partition once its time is up; return whether it healed now."""
        if self._heal_at and time.monotonic() >= self._heal_at:
            self._heal_at = 0.0
            self.bed.heal()
            return True
        return False

    def heal_now(self) -> None:
        """Heal the partition now, if one is in place."""
        if self._heal_at:
            self._heal_at = 0.0
            self.bed.heal()

    def close(self) -> None:
        """Remove the bed (killing whatever still runs in it)."""
        with contextlib.suppress(Exception):
            self.cluster.stop()
        self.bed.close()
