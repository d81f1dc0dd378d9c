"""etcd and Redis on test-bed hosts: one etcd member per host, Redis on one host.

The servers listen on their host's namespace address (fixed ports: every
host has its own network stack, and none is an engine's default port), are
started inside the host with ``ip netns exec``, probed from inside a host with
:meth:`~rdzv.testing.netns.Host.call` (the test process's own namespace does
not reach the bed), and stopped by pid. Every loop is bounded.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rdzv.testing.netns import Host, NetnsBed
from tests.engines.servers import etcd_env, kill_process, stop_process
from tests.procs import require_binary

ETCD_CLIENT_PORT = 2479
ETCD_PEER_PORT = 2480
REDIS_PORT = 16379


def _post(url: str, body: dict[str, Any], timeout: float = 1.0) -> dict[str, Any] | None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            found: dict[str, Any] = json.loads(resp.read())
            return found
    except (OSError, ValueError, urllib.error.URLError):
        return None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as resp:
            return bool(json.loads(resp.read()).get("health") == "true")
    except (OSError, ValueError, urllib.error.URLError):
        return False


@dataclass
class NetnsEtcd:
    """An etcd cluster, member ``i`` on host ``hosts[i]``; a context manager."""

    hosts: Sequence[Host]
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rdzv-netns-etcd-")))
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def url(self, host: Host) -> str:
        return f"http://{host.ipv4}:{ETCD_CLIENT_PORT}"

    @property
    def endpoints(self) -> str:
        """The members' client endpoints, comma-separated."""
        return ",".join(f"{h.ipv4}:{ETCD_CLIENT_PORT}" for h in self.hosts)

    def __enter__(self) -> NetnsEtcd:
        try:
            for host in self.hosts:
                self.start(host)
            self.wait_healthy()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, host: Host, state: str = "new") -> None:
        """Start the member of ``host`` (``state="existing"``: again, from its data directory)."""
        cluster = ",".join(f"m{h.index}=http://{h.ipv4}:{ETCD_PEER_PORT}" for h in self.hosts)
        peer = f"http://{host.ipv4}:{ETCD_PEER_PORT}"
        args = [
            require_binary("etcd"),
            *("--name", f"m{host.index}", "--data-dir", str(self.base / f"m{host.index}")),
            *("--listen-client-urls", self.url(host), "--advertise-client-urls", self.url(host)),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", cluster, "--initial-cluster-state", state),
            *("--initial-cluster-token", f"rdzv-netns-{self.base.name}"),
            *("--heartbeat-interval", "50", "--election-timeout", "500"),
            *("--logger", "zap", "--log-level", "warn"),
        ]
        with (self.base / f"m{host.index}.log").open("ab") as log:
            self.procs[host.index] = subprocess.Popen(
                host.command(args), stdout=log, stderr=subprocess.STDOUT, env=etcd_env()
            )

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Wait until every member answers healthy (from inside its own host)."""
        deadline = time.monotonic() + timeout
        pending = list(self.hosts)
        while pending:
            for host in list(pending):
                if self.procs[host.index].poll() is not None:
                    raise RuntimeError(f"etcd on host {host.index} exited: {self.log(host)}")
                if host.call(_healthy, self.url(host)):
                    pending.remove(host)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"etcd on hosts {[h.index for h in pending]} not healthy")
            time.sleep(0.1)

    def kill(self, host: Host) -> None:
        """SIGKILL the member of ``host`` (its data directory stays)."""
        proc = self.procs.get(host.index)
        if proc is not None:
            kill_process(proc)

    def alive(self, host: Host) -> bool:
        proc = self.procs.get(host.index)
        return proc is not None and proc.poll() is None

    def log(self, host: Host) -> str:
        path = self.base / f"m{host.index}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def leader(self, timeout: float = 30.0) -> Host:
        """Return the host whose member is the raft leader (asked from inside each host).

        Raises:
            RuntimeError: No member said it leads within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for host in self.hosts:
                if not self.alive(host):
                    continue
                status = host.call(_post, f"{self.url(host)}/v3/maintenance/status", {})
                if status and status.get("leader") == status.get("header", {}).get("member_id"):
                    return host
            time.sleep(0.1)
        raise RuntimeError(f"no etcd leader within {timeout} s")

    def close(self) -> None:
        for proc in self.procs.values():
            stop_process(proc)
        shutil.rmtree(self.base, ignore_errors=True)


@dataclass
class NetnsRedis:
    """One redis-server on ``host``; a context manager."""

    host: Host
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rdzv-netns-redis-")))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host.ipv4}:{REDIS_PORT}"

    def __enter__(self) -> NetnsRedis:
        self.start()
        return self

    def start(self) -> None:
        """Start redis-server (empty: nothing persists) and wait until it answers."""
        args = [
            require_binary("redis-server"),
            *("--bind", self.host.ipv4, "--port", str(REDIS_PORT), "--dir", str(self.base)),
            *("--save", "", "--appendonly", "no", "--daemonize", "no"),
            # Without a password Redis refuses every client but loopback ones.
            *("--protected-mode", "no"),
            *("--loglevel", "warning", "--logfile", str(self.base / "redis.log")),
        ]
        self.proc = subprocess.Popen(
            self.host.command(args), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def kill(self) -> None:
        """SIGKILL redis-server."""
        if self.proc is not None:
            kill_process(self.proc)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ping(self) -> bool:
        try:
            with socket.create_connection((self.host.ipv4, REDIS_PORT), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while not self.host.call(self._ping):
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server not ready after {timeout} s")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def engine(bed: NetnsBed, name: str) -> Iterator[str]:
    """Start ``name`` (``etcd``: a member per host; ``redis``: on host 0); yield the endpoint."""
    if name == "etcd":
        with NetnsEtcd(bed.hosts) as etcd:
            yield etcd.endpoints
    else:
        with NetnsRedis(bed.hosts[0]) as redis:
            yield redis.endpoint
