"""The servers a chaos run drives, one class per backend, each behind proxies.

A cluster starts its servers on free loopback ports with one
:class:`~tests.chaos.proxy.FaultProxy` in front of each, gives the agents the
proxied endpoint, reads the stored state through the backend's own
``create_backend`` (never through a proxy), and knows its server-side fault:
the TCP store host or the Redis server SIGKILLed and restarted empty, or an
etcd member SIGKILLed and restarted later from its data directory. Every
server-side fault that loses the state starts a new epoch (see
:mod:`tests.chaos.harness`).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from typing import Any

from rdzv.api import RendezvousParameters
from rdzv.backends.base import RendezvousBackend
from rdzv.dynamic.state import decode_state
from rdzv.registry import open_backend
from rdzv.store.base import Store
from tests.chaos.proxy import FaultProxy
from tests.procs import subprocess_env, wait_until

EPOCH_KEY = "chaos/epoch"
"""The store key the harness writes each time it starts the store host."""
RUN_ID = "chaos"

_SERVE = [sys.executable, "-m", "rdzv.cli", "serve", "--host", "127.0.0.1"]


class Cluster(ABC):
    """The servers of one backend, behind fault-injecting proxies."""

    rdzv_backend: str
    """The rendezvous backend name the agents pass to ``create_handler``."""
    server_fault: str
    """The name of this cluster's server-side fault."""

    def __init__(self) -> None:
        self.proxies: list[FaultProxy] = []
        self._reader: tuple[RendezvousBackend, Store] | None = None
        # Wall-clock windows in which no server could answer (nobody can judge then).
        self.outages: list[tuple[float, float]] = []

    @property
    def agent_endpoint(self) -> str:
        """The endpoint agents use: the proxies, comma-separated."""
        return ",".join(f"127.0.0.1:{p.port}" for p in self.proxies)

    @property
    @abstractmethod
    def direct_endpoint(self) -> str:
        """The servers' own endpoint, for the harness (not proxied)."""

    @abstractmethod
    def start(self) -> None:
        """Start the servers and the proxies."""

    @abstractmethod
    def fault(self, rng: random.Random) -> bool:
        """Inject this cluster's server-side fault; return whether the state was lost."""

    def tick(self) -> None:  # noqa: B027 - most clusters have nothing pending
        """Called often by the harness: finish delayed actions (restarts)."""

    @abstractmethod
    def stop(self) -> None:
        """Stop everything (by pid)."""

    def _params(self) -> RendezvousParameters:
        extra: dict[str, Any] = {"is_host": False} if self.rdzv_backend == "c10d" else {}
        return RendezvousParameters(
            self.rdzv_backend, self.direct_endpoint, RUN_ID, 1, 1, read_timeout=2, **extra
        )

    def _create_backend(self) -> tuple[RendezvousBackend, Store]:
        return open_backend(self._params())

    def _close_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            backend, store = reader
            with contextlib.suppress(Exception):
                backend.close()
            with contextlib.suppress(Exception):
                store.close()

    def _try_set_epoch(self, epoch: int) -> bool:
        try:
            if self._reader is None:
                self._reader = self._create_backend()
            self._reader[1].set(EPOCH_KEY, str(epoch))
        except Exception:
            self._close_reader()
            return False
        return True

    def set_epoch(self, epoch: int) -> None:
        """Write the epoch key, retrying for up to 30 s while the servers come up.

        Raises:
            NotReachedError: The key could not be written in time.
        """
        wait_until(
            lambda: self._try_set_epoch(epoch),
            f"the chaos epoch written to {self.direct_endpoint}",
            30,
            every=0.2,
        )

    def read_state(self) -> bytes | None:
        """Return the stored state's bytes (None if absent); raises on I/O errors."""
        try:
            if self._reader is None:
                self._reader = self._create_backend()
            found = self._reader[0].get_state()
        except Exception:
            self._close_reader()
            raise
        return None if found is None else bytes(found[0])

    @staticmethod
    def decode(data: bytes) -> None:
        """Decode a stored state (raises ``RendezvousStateError``)."""
        decode_state(data)

    def close_proxies(self) -> None:
        self._close_reader()
        for proxy in self.proxies:
            proxy.close()

    def server_pids(self) -> list[int]:
        """The pids of the running server processes (paused by the store-pause fault)."""
        return []

    def poison_heartbeat(self, node: str) -> bool:
        """Write a value that is no heartbeat mark into ``node``'s heartbeat key.

        Returns:
            Whether the value was written (False while the servers are down).
        """
        from rdzv.backends.etcd import EtcdRendezvousBackend
        from rdzv.backends.redis import RedisRendezvousBackend

        try:
            if self._reader is None:
                self._reader = self._create_backend()
            backend, store = self._reader
            if isinstance(backend, RedisRendezvousBackend):
                backend.client.set(f"{backend.key}:alive:{node}", b"poison")
            elif isinstance(backend, EtcdRendezvousBackend):
                backend.client.put(backend.run_prefix + f"alive/{node}".encode(), b"poison")
            else:
                store.set(f"rdzv.handler/{RUN_ID}/hb/{node}", b"poison")
        except Exception:
            self._close_reader()
            return False
        return True


class TcpStoreCluster(Cluster):
    """``rdzv serve`` in a subprocess: the TCP store host of the c10d backend."""

    rdzv_backend = "c10d"
    server_fault = "store-host-kill"

    def __init__(self) -> None:
        super().__init__()
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None

    @property
    def direct_endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        proc = subprocess.Popen(
            [*_SERVE, "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=subprocess_env(),
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("rdzv store listening on "):
            proc.kill()
            proc.wait(30)
            proc.stdout.close()
            raise RuntimeError(f"the store host did not start: {line!r}")
        self.port = int(line.split()[4].rsplit(":", 1)[1])
        self.proc = proc

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()

    def start(self) -> None:
        self._serve()
        self.proxies = [FaultProxy(self.port)]

    def fault(self, rng: random.Random) -> bool:
        self._close_reader()
        self._kill()
        self._serve()
        self.proxies[0].target_port = self.port
        return True

    def server_pids(self) -> list[int]:
        proc = self.proc
        return [] if proc is None or proc.poll() is not None else [proc.pid]

    def stop(self) -> None:
        self.close_proxies()
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
            proc.wait(30)
            if proc.stdout is not None:
                proc.stdout.close()


class EtcdChaosCluster(Cluster):
    """A private etcd cluster of ``size`` members (tests/engines/servers.py)."""

    rdzv_backend = "etcd"
    server_fault = "etcd-member-kill"

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self._stack = contextlib.ExitStack()
        self.cluster: Any = None
        self._restarts: list[tuple[float, Any]] = []
        self._down_since = 0.0

    @property
    def direct_endpoint(self) -> str:
        return str(self.cluster.endpoints)

    def start(self) -> None:
        from tests.engines.servers import etcd_cluster

        self.cluster = self._stack.enter_context(etcd_cluster(self.size))
        self.proxies = [FaultProxy(m.client_port) for m in self.cluster.members]

    def fault(self, rng: random.Random) -> bool:
        from tests.engines.servers import kill_process

        running = [m for m in self.cluster.members if m.alive]
        if not running:
            return False
        member = rng.choice(running)
        kill_process(member.proc)
        self._restarts.append((time.monotonic() + rng.uniform(1.0, 4.0), member))
        if self.size == 1:
            self._down_since = time.time()
        return False  # a member restarts from its data directory: nothing is lost

    def tick(self) -> None:
        now = time.monotonic()
        due = [(at, m) for at, m in self._restarts if at <= now]
        self._restarts = [(at, m) for at, m in self._restarts if at > now]
        for _, member in due:
            self.cluster.start_member(member, state="existing")
            if self.size == 1:
                self.outages.append((self._down_since, time.time()))

    def server_pids(self) -> list[int]:
        return [m.proc.pid for m in self.cluster.members if m.alive]

    def stop(self) -> None:
        self.close_proxies()
        self._stack.close()


class RedisChaosCluster(Cluster):
    """A private redis-server (no persistence: a restart starts empty)."""

    rdzv_backend = "redis"
    server_fault = "redis-kill"

    def __init__(self) -> None:
        super().__init__()
        self._stack = contextlib.ExitStack()
        self.server: Any = None

    @property
    def direct_endpoint(self) -> str:
        return str(self.server.endpoint)

    def start(self) -> None:
        from tests.engines.servers import redis_server

        self.server = self._stack.enter_context(redis_server())
        self.proxies = [FaultProxy(self.server.port)]

    def fault(self, rng: random.Random) -> bool:
        from tests.engines.servers import kill_process

        self._close_reader()
        kill_process(self.server.proc)
        self.server.start()
        self.server.wait_ready()
        return True  # no persistence: the restarted server is empty

    def server_pids(self) -> list[int]:
        proc = self.server.proc
        return [] if proc is None or proc.poll() is not None else [proc.pid]

    def stop(self) -> None:
        self.close_proxies()
        self._stack.close()


def make_cluster(name: str) -> Cluster:
    """Build the cluster of a backend name: ``tcp``, ``etcd``, ``etcd3`` or ``redis``.

    Raises:
        ValueError: The name is unknown.
    """
    if name == "tcp":
        return TcpStoreCluster()
    if name == "etcd":
        return EtcdChaosCluster(1)
    if name == "etcd3":
        return EtcdChaosCluster(3)
    if name == "redis":
        return RedisChaosCluster()
    raise ValueError(f"unknown chaos backend {name!r}; expected tcp, etcd, etcd3 or redis")
