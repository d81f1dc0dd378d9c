"""Health before admission: a node checks itself before each join and stays out while it fails.

Theory of operation. With ``rdzv run --health-check CMD`` the agent runs
``CMD`` (with ``/bin/sh -c``, in its own session, stdin and stdout closed
to it) before every join, and kills its process group when it takes longer
than ``--health-check-timeout``. Exit status 0 lets the node join; anything
else, or the timeout, keeps it out of the round: one line says why (the
command, its exit status or the timeout, the tail of its stderr), and the
agent tries again after a back-off that doubles from 1 s up to 30 s. The
node's other agents' rounds go on without it.

With ``--exclude-after K`` the node keeps an exclusion record in the run's
store (:mod:`rdzv.exclusion`): K failures in a row (failed checks, or
attempts in which this node's workers failed first) exclude it for a
cool-down, which doubles at each exclusion. An excluded node's agent does
not join until the cool-down ends (enforced here, on the node: it never
asks to join); ``rdzv status`` lists the record. Without ``--exclude-after``
a worker failure is handled exactly as before (restarts, re-forms), and
nothing is written unless a health check fails.

Every wait here (back-off, cool-down) is a sleep on the injected clock, in
slices of at most :data:`CLOSED_POLL` seconds after each of which the agent
asks whether the run was closed (it then stops waiting: its join fails as
closed and it exits). A store that cannot be used costs a line in the log;
the record then lives in the agent's memory only.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

from rdzv.api import RendezvousHandler
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.errors import RendezvousError
from rdzv.exclusion import (
    KIND_HEALTH,
    KIND_WORKERS,
    ExclusionPolicy,
    ExclusionRecord,
    ExclusionRecordError,
    check_node_name,
    read_record,
    write_record,
)
from rdzv.launch.config import DEFAULT_HEALTH_CHECK_TIMEOUT, AgentConfig
from rdzv.launch.exits import describe_returncode
from rdzv.launch.workers import signal_group
from rdzv.retry import Clock
from rdzv.store.base import Store

__all__ = [
    "CLOSED_POLL",
    "WALL_CLOCK",
    "HealthCheck",
    "HealthCheckResult",
    "NodeHealth",
]

#: The longest slice of a wait between two questions "is the run closed?".
CLOSED_POLL = 5.0

#: The clock of exclusion records: wall time, so that people and later agents can read it.
WALL_CLOCK = Clock(time.time)

_UNNAMEABLE = re.compile(r"[^A-Za-z0-9._:%\[\]-]")
_RETRY_FIRST = 1.0
_RETRY_CAP = 30.0
_STDERR_TAIL = 300
_REAP_AFTER_KILL = 5.0


@dataclass(frozen=True)
class HealthCheckResult:
    """How one run of the health check ended.

    Args:
        command: The command.
        returncode: Its exit status (negative: killed by that signal), or
            None when it timed out.
        stderr: The tail of its standard error, stripped.
        timeout: The seconds it was allowed.
    """

    command: str
    returncode: int | None
    stderr: str = ""
    timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT

    @property
    def ok(self) -> bool:
        """Whether it passed (exit status 0)."""
        return self.returncode == 0

    def describe(self) -> str:
        """Return one line: the command, how it ended and the tail of its stderr."""
        code = self.returncode
        how = f"timed out after {self.timeout:g} s" if code is None else describe_returncode(code)
        text = f"health check {self.command!r} {how}"
        if self.stderr:
            text += f"; stderr: {' | '.join(self.stderr.splitlines())}"
        return text


class HealthCheck:
    """Runs the health check command.

    Args:
        command: The shell command.
        timeout: Seconds it may run before its process group is killed.
        env: Its environment (the agent's when None).
    """

    def __init__(
        self,
        command: str,
        timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.command = command
        self.timeout = timeout
        self._env = env

    def __call__(self) -> HealthCheckResult:
        """Run the command once; return how it ended (an error starting it is a failure)."""
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", self.command],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=self._env,
                    start_new_session=True,
                )
            except OSError as exc:
                return HealthCheckResult(self.command, 127, f"cannot start: {exc}", self.timeout)
            code: int | None = None
            try:
                code = proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                if proc.returncode is None or code is None:
                    signal_group(proc.pid, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(_REAP_AFTER_KILL)
            return HealthCheckResult(self.command, code, _tail(err), self.timeout)


def _tail(handle: IO[bytes]) -> str:
    """Return the last few hundred characters written to ``handle``, stripped."""
    size = handle.seek(0, os.SEEK_END)
    handle.seek(max(size - _STDERR_TAIL, 0))
    text: str = handle.read().decode("utf-8", "replace").strip()
    return ("..." if size > _STDERR_TAIL else "") + text


class NodeHealth:
    """One agent's health checks and exclusion record: built once, asked before each join.

    Args:
        node: This node's name in the record (its address).
        run_id: The run.
        policy: When failures exclude the node.
        check: The health check, or None.
        store: The run's store, or None (the record then lives here only).
        log: Receives the one-line messages.
        is_closed: Tells whether the run was closed (errors count as open).
        clock: The clock of the waits and of the record (wall time).

    Raises:
        ValueError: ``node`` cannot name a record.
    """

    def __init__(
        self,
        node: str,
        run_id: str,
        policy: ExclusionPolicy,
        check: Callable[[], HealthCheckResult] | None,
        store: Store | None,
        log: Callable[[str], None],
        is_closed: Callable[[], bool],
        clock: Clock = WALL_CLOCK,
    ) -> None:
        self._node = check_node_name(node)
        self._run_id = run_id
        self._policy = policy
        self._check = check
        self._store = store
        self._log = log
        self._is_closed = is_closed
        self._clock = clock
        self._record = ExclusionRecord(node)
        self._stored = False
        self._loaded = not self.active

    @classmethod
    def for_agent(
        cls,
        handler: RendezvousHandler,
        config: AgentConfig,
        log: Callable[[str], None],
    ) -> NodeHealth:
        """Build an agent's gate: its record lives in the dynamic handler's store (else here only).

        The node's name is the address it publishes (``config.local_addr``),
        else its host name, with any character a record's name cannot hold
        made ``_``.
        """
        store = handler.store if isinstance(handler, DynamicRendezvousHandler) else None
        name = _UNNAMEABLE.sub("_", config.local_addr or socket.gethostname())[:200] or "node"
        command = config.health_check
        check = None
        if command is not None:
            check = HealthCheck(command, config.health_check_timeout, config.env)
        run_id = handler.get_run_id()
        return cls(name, run_id, config.exclusion, check, store, log, handler.is_closed)

    @property
    def active(self) -> bool:
        """Whether there is anything to do: a health check, or exclusion on."""
        return self._check is not None or self._policy.enabled

    @property
    def record(self) -> ExclusionRecord:
        """This node's record as this agent knows it."""
        return self._record

    def before_join(self) -> None:
        """Return once this node may join: not excluded and healthy, or once the run is closed."""
        if not self.active:
            return
        self._load()
        while not self._closed():
            left = self._record.left(self._clock())
            if left > 0:
                self._wait(left)
                continue
            if self._check is None:
                return
            result = self._check()
            if result.ok:
                if self._record.kind == KIND_HEALTH:
                    self._log(f"{result.describe()}: this node may join again")
                self._update(self._record.passed_check())
                return
            self._failed(KIND_HEALTH, result.describe())
            if not self._record.excluded(self._clock()):
                delay = min(_RETRY_FIRST * 2.0 ** (self._record.failures - 1), _RETRY_CAP)
                self._log(
                    f"{result.describe()}: this node stays out of the round "
                    f"({self._record.failures} failure(s) in a row); checking again in {delay:g} s"
                )
                self._wait(delay)

    def attempt_ended(self, own_failure: str | None) -> None:
        """Count an attempt of the job: ``own_failure`` says how this node's workers failed first.

        None: the attempt ended otherwise (the count restarts). A failure
        counts only when exclusion is on.
        """
        if not self._policy.enabled:
            return
        if own_failure is None:
            self._update(self._record.attempt_ended_well())
        else:
            self._failed(KIND_WORKERS, own_failure)

    def _failed(self, kind: str, reason: str) -> None:
        before = self._record
        record = before.failed(kind, reason, self._clock(), self._policy)
        self._update(record)
        if record.exclusions > before.exclusions:
            self._log(
                f"node {self._node} is excluded from run {self._run_id!r} for "
                f"{record.cooldown:g} s after {self._policy.after} failure(s) in a row "
                f"(exclusion {record.exclusions}; the next is twice as long): {reason}"
            )

    def _update(self, record: ExclusionRecord) -> None:
        if record == self._record:
            return
        self._record = record
        if self._store is None:
            return
        try:
            write_record(self._store, self._run_id, record, first=not self._stored)
            self._stored = True
        except RendezvousError as exc:
            self._log(f"could not write this node's exclusion record: {type(exc).__name__}: {exc}")

    def _load(self) -> None:
        """Take up the record an earlier agent of this node left (read once)."""
        if self._loaded or self._store is None:
            return
        self._loaded = True
        try:
            found = read_record(self._store, self._run_id, self._node)
        except (RendezvousError, ExclusionRecordError) as exc:
            self._log(f"could not read this node's exclusion record: {type(exc).__name__}: {exc}")
            return
        if found is not None:
            self._record, self._stored = found, True
            if found.excluded(self._clock()):
                self._log(f"this node is still excluded: {found.describe(self._clock())}")

    def _wait(self, seconds: float) -> None:
        """Sleep ``seconds`` on the clock in slices, ending early when the run is closed."""
        end = self._clock() + seconds
        while not self._closed():
            left = end - self._clock()
            if left <= 0:
                return
            self._clock.sleep(min(left, CLOSED_POLL))

    def _closed(self) -> bool:
        try:
            return self._is_closed()
        except RendezvousError:
            return False
