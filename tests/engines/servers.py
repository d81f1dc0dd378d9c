"""Private etcd and Redis servers for tests, on free loopback ports.

Every server runs in its own temporary directory, is started with fast timers,
is waited for with a bounded health loop and is stopped by pid (SIGTERM, then
SIGKILL) before its directory is deleted. The default ports (2379, 2380,
6379) are never used. A missing binary is an error, not a skip: CI installs
both with ``scripts/setup``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
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

from tests.certs import TLSFiles
from tests.procs import free_port, require_binary


def stop_process(proc: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """Stop a process by pid: SIGTERM, wait up to ``grace`` seconds, then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def kill_process(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a process by pid and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def etcd_env() -> dict[str, str]:
    """This process's environment less the ``ETCD*`` variables (etcd reads each as a flag)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}


@dataclass
class EtcdMember:
    """One etcd process."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    scheme: str = "http"
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    """One or more etcd members on loopback, started together."""

    members: list[EtcdMember]
    base_dir: Path
    tls: TLSFiles | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def endpoints(self) -> str:
        """The members' client endpoints, comma-separated."""
        return ",".join(m.endpoint for m in self.members)

    @property
    def endpoint(self) -> str:
        """The first member's client endpoint."""
        return self.members[0].endpoint

    def start_member(self, member: EtcdMember, state: str = "new") -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        args = [
            require_binary("etcd"),
            "--name",
            member.name,
            "--data-dir",
            str(member.data_dir),
            "--listen-client-urls",
            member.client_url,
            "--advertise-client-urls",
            member.client_url,
            "--listen-peer-urls",
            member.peer_url,
            "--initial-advertise-peer-urls",
            member.peer_url,
            "--initial-cluster",
            initial,
            "--initial-cluster-state",
            state,
            "--initial-cluster-token",
            f"rdzv-test-{self.base_dir.name}",
            "--heartbeat-interval",
            "10",
            "--election-timeout",
            "100",
            "--logger",
            "zap",
            "--log-level",
            "warn",
            *self.extra_args,
        ]
        if self.tls is not None:
            args += [
                "--cert-file",
                self.tls.server_cert,
                "--key-file",
                self.tls.server_key,
                "--trusted-ca-file",
                self.tls.ca_cert,
                "--client-cert-auth",
            ]
        member.log = member.data_dir.parent / f"{member.name}.log"
        with member.log.open("ab") as log:
            member.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=etcd_env()
            )

    def _healthy(self, member: EtcdMember) -> bool:
        url = f"{member.client_url}/health"
        context = None
        if self.tls is not None:
            import ssl

            context = ssl.create_default_context(cafile=self.tls.ca_cert)
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                body = json.loads(resp.read())
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return bool(body.get("health") == "true")

    def wait_healthy(self, timeout: float = 30.0, members: list[EtcdMember] | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = list(members if members is not None else self.members)
        while pending:
            for member in list(pending):
                if not member.alive:
                    raise RuntimeError(f"etcd {member.name} exited: {self.log_tail(member)}")
                if self._healthy(member):
                    pending.remove(member)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"etcd members {[m.name for m in pending]} not healthy after {timeout} s"
                )
            if pending:
                time.sleep(0.05)

    def log_tail(self, member: EtcdMember) -> str:
        if member.log is None or not member.log.exists():
            return ""
        return member.log.read_text(errors="replace")[-2000:]

    def leader(self) -> EtcdMember:
        """Return the member that is the raft leader (bounded wait)."""
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            for member in self.members:
                if not member.alive:
                    continue
                status = self.status(member)
                if status is not None and status.get("leader") == status.get("header", {}).get(
                    "member_id"
                ):
                    return member
            time.sleep(0.05)
        raise RuntimeError("no etcd leader within 15 s")

    def status(self, member: EtcdMember) -> dict[str, Any] | None:
        request = urllib.request.Request(
            f"{member.client_url}/v3/maintenance/status", data=b"{}", method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=1.0) as resp:
                result: dict[str, Any] = json.loads(resp.read())
                return result
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        for member in self.members:
            if member.proc is not None:
                stop_process(member.proc)


_PORT_ATTEMPTS = 3
"""Starts of a server on fresh free ports: between picking a free port and a
server binding it, another process (a second test suite) may take it."""


def _port_taken(exc: RuntimeError) -> bool:
    return "address already in use" in str(exc).lower()


@contextlib.contextmanager
def etcd_cluster(
    size: int = 1, tls: TLSFiles | None = None, extra_args: Sequence[str] = ()
) -> Iterator[EtcdCluster]:
    """Start ``size`` etcd members on free loopback ports; stop and delete them afterwards.

    ``extra_args`` come after the test flags, so they override them (etcd
    takes a flag's last value).
    """
    require_binary("etcd")
    names = "abcdefg"
    for attempt in range(_PORT_ATTEMPTS):
        base = Path(tempfile.mkdtemp(prefix="rdzv-etcd-"))
        members = [
            EtcdMember(
                name=names[i],
                client_port=free_port(),
                peer_port=free_port(),
                data_dir=base / names[i],
                scheme="https" if tls is not None else "http",
            )
            for i in range(size)
        ]
        cluster = EtcdCluster(members=members, base_dir=base, tls=tls, extra_args=list(extra_args))
        try:
            try:
                for member in members:
                    cluster.start_member(member)
                cluster.wait_healthy()
            except RuntimeError as exc:
                if _port_taken(exc) and attempt + 1 < _PORT_ATTEMPTS:
                    continue
                raise
            yield cluster
            return
        finally:
            cluster.stop()
            shutil.rmtree(base, ignore_errors=True)


@dataclass
class RedisServer:
    """One private redis-server process."""

    port: int
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    tls: TLSFiles | None = None
    extra_args: Sequence[str] = ()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            require_binary("redis-server"),
            "--bind",
            "127.0.0.1",
            *(
                ["--port", str(self.port)]
                if self.tls is None
                else [
                    "--port",
                    "0",
                    "--tls-port",
                    str(self.port),
                    "--tls-cert-file",
                    self.tls.server_cert,
                    "--tls-key-file",
                    self.tls.server_key,
                    "--tls-ca-cert-file",
                    self.tls.ca_cert,
                ]
            ),
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.data_dir / "redis.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = self.data_dir / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {tail}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as raw:
                    sock = raw
                    if self.tls is not None:
                        import ssl

                        context = ssl.create_default_context(cafile=self.tls.ca_cert)
                        context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
                        sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
                    sock.sendall(b"PING\r\n")
                    reply = sock.recv(64)
                    if sock is not raw:
                        sock.close()
                    if reply.startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server not ready after {timeout} s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


@contextlib.contextmanager
def redis_server(
    tls: TLSFiles | None = None, extra_args: Sequence[str] = ()
) -> Iterator[RedisServer]:
    """Start a private redis-server on a free loopback port; stop and delete it afterwards."""
    require_binary("redis-server")
    for attempt in range(_PORT_ATTEMPTS):
        base = Path(tempfile.mkdtemp(prefix="rdzv-redis-"))
        server = RedisServer(port=free_port(), data_dir=base, tls=tls, extra_args=extra_args)
        try:
            try:
                server.start()
                server.wait_ready()
            except RuntimeError as exc:
                if _port_taken(exc) and attempt + 1 < _PORT_ATTEMPTS:
                    continue
                raise
            yield server
            return
        finally:
            server.stop()
            shutil.rmtree(base, ignore_errors=True)


ETCD_TIMERS = ("--heartbeat-interval", "100", "--election-timeout", "1000")
"""etcd's own defaults, which the benchmarks' clusters run with: the tests' fast timers
(10 and 100 ms) made the members of a cluster loaded by thousands of agents on
two cores elect a new leader about ten times in one formation."""


REDIS_CLIENTS = ("--maxclients", "65536")
"""The benchmarks' Redis takes as many clients as its file limit allows: its default of
10,000 refused 1,930 of 8,192 simulated nodes (each holds two connections)."""


@contextlib.contextmanager
def engine_servers(names: Sequence[str], etcd_members: int = 1) -> Iterator[dict[str, str]]:
    """Start a private etcd and/or redis-server for those of ``names`` that are engines.

    A name counts for its engine when it is the engine's or starts with it
    and a dash (``etcd-floor`` needs etcd). etcd runs ``etcd_members``
    members. Yields ``{engine: endpoints, f"{engine}-pid": pids}`` (each
    comma-separated); every server is stopped by pid on exit. etcd runs
    with its default timers (:data:`ETCD_TIMERS`), Redis with room for every
    node's clients (:data:`REDIS_CLIENTS`).
    """

    def wanted(engine: str) -> bool:
        return any(name == engine or name.startswith(f"{engine}-") for name in names)

    with contextlib.ExitStack() as stack:
        endpoints: dict[str, str] = {}
        if wanted("etcd"):
            cluster = stack.enter_context(etcd_cluster(etcd_members, extra_args=ETCD_TIMERS))
            endpoints["etcd"] = cluster.endpoints
            endpoints["etcd-pid"] = ",".join(str(m.proc.pid) for m in cluster.members if m.proc)
        if wanted("redis"):
            server = stack.enter_context(redis_server(extra_args=REDIS_CLIENTS))
            endpoints["redis"] = server.endpoint
            endpoints["redis-pid"] = str(server.proc.pid) if server.proc else ""
        yield endpoints
