"""Helpers shared by the tests and the benchmarks: one home each.

Child processes (``subprocess_env``: a ``python`` that imports this tree's
rdzv; ``require_binary``; ``Children``, a test's child processes, and
``LoggedAgents``, agent processes with log files; ``read_markers``, the JSON files their workers write), loopback
ports (``free_port``), bounded polling (``wait_until``), a store that
counts its calls (``CountingStore``) and a process's memory and CPU time
(``rss_bytes``, ``cpu_seconds``). The benchmarks reach this module
through ``benchmarks/_common.py``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rdzv.store.base import Store

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = SRC.parent

T = TypeVar("T")


def subprocess_env(**extra: str) -> dict[str, str]:
    """Return an environment in which a child ``python`` imports this tree's rdzv."""
    env = dict(os.environ)
    parts = [str(SRC), str(ROOT)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra)
    return env


def require_binary(name: str) -> str:
    """Return the path of ``name`` or fail loudly (never skip)."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(
            f"the {name!r} binary is not on PATH; run `bash scripts/setup` "
            "(it installs etcd-server, redis-server and openssl)"
        )
    return path


class NotReachedError(AssertionError):
    """What :func:`wait_until` raises: the condition was not met in time, or never will be."""


def wait_until(
    predicate: Callable[[], T],
    what: str = "a condition",
    timeout: float = 60.0,
    *,
    every: float = 0.05,
    broken: Callable[[], object] | None = None,
    detail: Callable[[], object] | None = None,
) -> T:
    """Call ``predicate`` every ``every`` seconds until it returns a true value; return that.

    Raises:
        NotReachedError: ``timeout`` seconds passed, or ``broken()`` returned
            a true value (why the condition never will be met, e.g. the
            processes that exited). The message names ``what``, that value
            and ``detail()`` (logs worth reading).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        reason = broken() if broken is not None else None
        if reason or time.monotonic() > deadline:
            why = f"broken: {reason}" if reason else f"not within {timeout:g} s"
            extra = f"\n{detail()}" if detail is not None else ""
            raise NotReachedError(f"{what}: {why}{extra}")
        time.sleep(every)


def read_markers(directory: Path, pattern: str) -> list[dict[str, Any]]:
    """The JSON objects of the files ``pattern`` in ``directory`` (an empty one is being written)."""
    return [json.loads(text) for p in directory.glob(pattern) if (text := p.read_text())]


def rss_bytes(pid: int | str = "self") -> int:
    """Return the resident memory of process ``pid`` (default: this one) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS line for {pid}: not running")


def cpu_seconds(pid: int) -> float:
    """Return the CPU seconds (user and system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Children:
    """Child processes of a test; ``stop`` SIGKILLs every one still running and reaps it.

    A child started in a session of its own (``new_session``) is killed with
    its process group, so its own children (workers) go along.
    """

    def __init__(self, new_session: bool = False) -> None:
        self.new_session = new_session
        self.procs: list[subprocess.Popen[Any]] = []

    def popen(
        self,
        args: Sequence[str],
        popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``args`` with ``popen`` (``subprocess.Popen``, or e.g. a netns host's)."""
        if self.new_session:
            kwargs["start_new_session"] = True
        proc = popen(args, **kwargs)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                kill = os.killpg if self.new_session else os.kill
                kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)


class LoggedAgents(Children):
    """Agent processes of one test, each logging to ``<logs>/agent-<name>.log``.

    ``until`` and ``wait`` give up after ``bound`` seconds (a bound that only
    catches hangs) or as soon as an agent failed, naming the logs' tails.
    """

    def __init__(self, logs: Path, new_session: bool = False, bound: float = 120) -> None:
        super().__init__(new_session)
        self.logs = logs
        self.bound = bound

    def start(
        self,
        args: Sequence[str],
        env: dict[str, str],
        name: object = None,
        popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen,
    ) -> subprocess.Popen[Any]:
        """Start ``args`` with ``popen`` (e.g. a netns host's), output to its log."""
        name = len(self.procs) if name is None else name
        with (self.logs / f"agent-{name}.log").open("w") as log:
            return self.popen(args, popen, env=env, stdout=log, stderr=subprocess.STDOUT)

    def output(self, lines: int = 40) -> str:
        """The last ``lines`` of every agent's log."""
        return "\n".join(
            f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            for path in sorted(self.logs.glob("agent-*.log"))
        )

    def until(self, what: str, predicate: Callable[[], object], timeout: float = 0) -> None:
        """:func:`wait_until` ``predicate``, given up as soon as an agent exited non-zero."""
        wait_until(
            predicate,
            what,
            timeout or self.bound,
            every=0.1,
            broken=lambda: [p.args for p in self.procs if p.poll() not in (None, 0)],
            detail=self.output,
        )

    def wait(self, timeout: float = 0) -> list[int | None]:
        """The agents' exit codes, once every one exited."""
        wait_until(
            lambda: all(p.poll() is not None for p in self.procs),
            "the agents to exit",
            timeout or self.bound,
            every=0.1,
            detail=self.output,
        )
        return [p.returncode for p in self.procs]


class CountingStore:
    """Forwards every call to the store ``inner`` and tells ``count(name, args, result)`` of each.

    ``close``, ``clone`` and attributes pass through uncounted. A method's
    wrapper is made on its first call and kept in the instance, so a counted
    call costs one Python call more (the benchmarks count thousands of
    handlers' calls). A call that raises is not counted. It is registered as
    an rdzv :class:`~rdzv.store.base.Store`, so rdzv uses it as the rdzv
    store it wraps (its watch included) instead of as a foreign store.
    """

    def __init__(self, inner: Any, count: Callable[[str, tuple[Any, ...], Any], None]) -> None:
        self.inner = inner
        self._count = count

    @property
    def supports_watch(self) -> bool:
        return bool(self.inner.supports_watch)

    @property
    def timeout(self) -> Any:
        return self.inner.timeout

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr) or name in ("close", "clone"):
            return attr
        count = self._count

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            count(name, (*args, *kwargs.values()), result)
            return result

        setattr(self, name, call)
        return call


Store.register(CountingStore)


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 when unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_FREE_PORT_FLOOR = 15000
ENGINE_PORTS = frozenset({2379, 2380, 6379})
"""etcd's and Redis's default ports: never handed out (a system daemon may own them)."""
_ports = random.Random()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (never an engine's default).

    The port is below the kernel's ephemeral range when there is room: a port
    from that range can be taken, between this check and the test's own
    bind, as the local port of any outgoing connection on the machine (a
    second suite beside this one, a busy CI host), and the test then meets a
    stranger or nobody on it. A port below the range is only ever taken by
    an explicit bind.
    """
    low = _ephemeral_low()
    for _ in range(200 if low - _FREE_PORT_FLOOR >= 1000 else 0):
        port = _ports.randrange(_FREE_PORT_FLOOR, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in ENGINE_PORTS:
            return port
