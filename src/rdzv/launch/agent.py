"""The elastic agent: rendezvous, start workers, watch them, repeat.

Theory of operation. One agent runs per node and drives any
:class:`~rdzv.api.RendezvousHandler`:

1. ``next_rendezvous()`` joins a round, with a progress line a couple of
   seconds into the wait and every few seconds after
   (:mod:`rdzv.launch.progress`). A spare node told to leave
   (``RendezvousGracefulExitError``) exits 0; any other rendezvous error
   ends the agent with :data:`EXIT_RENDEZVOUS`.
2. The agents of the round exchange their local world sizes through the
   round's store to number the workers, group rank 0 starts a fresh
   bootstrap store for this attempt, and the workers start.
3. Every ``monitor_interval`` the agent polls its workers and asks the
   handler whether nodes are waiting:

   * all workers exited 0: wait at an exit barrier for the other agents of
     the round (so the bootstrap store outlives every worker); the last to
     arrive closes the run; every agent leaves the rendezvous and waits at a
     second barrier until all have left (so an agent hosting the rendezvous
     store outlives the others' last writes); exit 0;
   * a worker failed: record it as the round's first failure unless another
     agent did (:mod:`rdzv.launch.failures`: the lines about the restart or
     re-form name that first failure), stop the others and, while the
     restart budget lasts, go back to 1 (the restart is counted); when it is
     spent, close the run and exit :data:`EXIT_WORKER_FAILED` naming the
     failed rank;
   * nodes are waiting (a newcomer, or a member declared dead): stop the
     workers and go back to 1 without counting a restart;
   * a worker is hung (:mod:`rdzv.launch.watchdog`: torch's expiration
     timers, ``hang_timeout``): it was ended there; a failure as above.

A worker failure that coincides with a change of the group is a re-form,
not a restart: when a node dies, the survivors' collective calls usually
fail before its heartbeats are missed. So a failure is not counted when
nodes are already waiting; with restarts left the agent re-joins at once
and gives the restart back if the next round's members differ from the
failed round's; with none left it first waits up to ``reform_grace``
seconds (by default the time the dynamic rendezvous takes to find a dead
member) for nodes to wait or a member to be evicted, and re-forms if one
is, instead of closing the run.

The signals to handle (torchrun's default: SIGTERM, SIGINT, SIGHUP and
SIGQUIT) raise :class:`AgentInterrupted` in the main thread; the agent then
stops the workers (the same signal to each worker's process group, grace,
SIGKILL), leaves the rendezvous without closing it and exits
``128 + signal``. SIGUSR1 and SIGUSR2 (SLURM's pre-emption warning) are
passed on to the running workers, and everything goes on.

Each worker gets an error file (``TORCHELASTIC_ERROR_FILE``) next to its log
(in a private temporary directory, removed at the end, without a log
directory); a failed worker's ``@record`` root cause is part of the line that
reports the failure.

Size: over the project's ~600-line guide: one loop whose steps share an
attempt's state; ranks, bootstrap, workers and progress have their own modules.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import string
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rdzv.api import RendezvousHandler, RendezvousInfo
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
    StoreTimeoutError,
)
from rdzv.keys import LAUNCH_ROOT, agent_key
from rdzv.launch.bootstrap import (
    BootstrapFactory,
    BootstrapServer,
    exchange_bootstrap,
    tcp_store_server,
)
from rdzv.launch.explain import describe_change, describe_timeout
from rdzv.launch.failures import FirstFailure
from rdzv.launch.progress import FIRST_LINE_AFTER, LINE_EVERY, EventListener, WaitProgress
from rdzv.launch.ranks import (
    DEFAULT_SIGNALS_TO_HANDLE,
    NodeRanks,
    assign_ranks,
    visible_device,
    worker_environment,
)
from rdzv.launch.warm import WarmSpares, check_module_names
from rdzv.launch.watchdog import HangWatch
from rdzv.launch.workers import (
    OutputSink,
    Std,
    StdChoice,
    WorkerExit,
    WorkerGroup,
    WorkerSpec,
    agent_line,
)
from rdzv.store.base import Store

__all__ = [
    "DEFAULT_FORWARDED",
    "DEFAULT_SIGNALS",
    "EXIT_OK",
    "EXIT_RENDEZVOUS",
    "EXIT_WORKER_FAILED",
    "AgentConfig",
    "AgentInterrupted",
    "AgentResult",
    "AgentStats",
    "ElasticAgent",
]

EXIT_OK = 0
EXIT_WORKER_FAILED = 1
EXIT_RENDEZVOUS = 3

#: The signals torchrun's agent handles by default.
DEFAULT_SIGNALS = tuple(signal.Signals[name] for name in DEFAULT_SIGNALS_TO_HANDLE.split(","))

#: Signals passed on to the workers without stopping anything (SLURM's
#: pre-emption warning, ``#SBATCH --signal=USR1@90``, is SIGUSR1).
DEFAULT_FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)


@dataclass(frozen=True)
class AgentConfig:
    """What the agent runs and how.

    Args:
        entrypoint: The worker's arguments after the interpreter:
            ``["script.py", *args]`` or ``["-m", "module", *args]``; with
            ``python=None`` the whole command line.
        nproc_per_node: Workers on this node.
        max_restarts: Restarts allowed after worker failures.
        monitor_interval: Seconds between checks of the workers.
        role: The role name of this node's workers.
        log_dir: A directory for per-worker, per-attempt log files, or None.
        local_addr: The address group rank 0 publishes for the bootstrap store.
        stop_grace: Seconds between SIGTERM and SIGKILL when stopping workers.
        exit_barrier_timeout: Seconds to wait for the other agents after success.
        python: The interpreter that runs the workers unbuffered (``-u``, as
            torchrun does), or None to run ``entrypoint`` as the command
            (torchrun's ``--no-python``).
        env: The environment workers start from (the agent's when None).
        redirects: Streams that go only to the log file, not the console
            (torchrun's ``--redirects``).
        tee: Streams that go to the log file and the console (torchrun's
            ``--tee``; every stream does when there is a log directory, so
            this undoes ``redirects``).
        local_ranks_filter: The local ranks whose output reaches the
            console (all when None); the log files keep everything.
        duplicate_stdout_filters: Copy stdout lines containing one of these
            to ``filtered_stdout.log`` in the attempt's log directory.
        duplicate_stderr_filters: The same for stderr (``filtered_stderr.log``).
        log_line_prefix_template: A ``string.Template`` for the prefix of
            workers' lines (``${role_name}``, ``${rank}``, ``${local_rank}``;
            torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``), or None
            for ``[rank N]: ``.
        signals: The signals that stop the agent and are forwarded to the workers.
        forwarded: Signals passed on to the running workers' process groups
            while the agent and the workers go on (a signal also in
            ``signals`` stops the agent instead).
        virtual_local_rank: ``LOCAL_RANK=0`` for every worker, which sees
            only its own device in ``CUDA_VISIBLE_DEVICES``.
        reform_grace: Seconds a worker failure with no restart left waits
            for a change of the group (a node waiting, a member evicted)
            that makes it a re-form; None: the handler's time to find a
            dead member (``keep_alive_interval * (keep_alive_max_attempt +
            1)`` for the dynamic rendezvous, 0 for others).
        hang_timeout: Seconds after which a worker that called
            ``rdzv.progress()`` and stopped calling it is hung (its node's
            stacks written, the group restarted), or None: no watchdog.
        warm_restart: Keep a preloaded spare per local rank for the next
            attempt (:mod:`rdzv.launch.warm`).
        warm_preload: Modules the spares import after the script's leading
            imports (ones the worker imports later, e.g. ``torch._dynamo``).

    Raises:
        ValueError: A value is out of range; the message names it.
    """

    entrypoint: Sequence[str]
    nproc_per_node: int = 1
    max_restarts: int = 0
    monitor_interval: float = 0.1
    role: str = "default"
    log_dir: Path | None = None
    local_addr: str | None = None
    stop_grace: float = 10.0
    exit_barrier_timeout: float = 300.0
    python: str | None = sys.executable
    env: Mapping[str, str] | None = field(default=None)
    redirects: StdChoice = field(default_factory=StdChoice)
    tee: StdChoice = field(default_factory=StdChoice)
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: Sequence[str] = ()
    duplicate_stderr_filters: Sequence[str] = ()
    log_line_prefix_template: str | None = None
    signals: Sequence[signal.Signals] = DEFAULT_SIGNALS
    forwarded: Sequence[signal.Signals] = DEFAULT_FORWARDED
    virtual_local_rank: bool = False
    reform_grace: float | None = None
    hang_timeout: float | None = None
    warm_restart: bool = True
    warm_preload: Sequence[str] = ()

    def __post_init__(self) -> None:
        if not self.entrypoint:
            raise ValueError("the worker entry point is empty; give a script or -m module")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be at least 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be non-negative, got {self.max_restarts}")
        if not self.monitor_interval > 0:
            raise ValueError(f"monitor_interval must be positive, got {self.monitor_interval}")
        if self.stop_grace < 0:
            raise ValueError(f"stop_grace must be non-negative, got {self.stop_grace}")
        if not self.role:
            raise ValueError("role must be a non-empty name")
        if self.reform_grace is not None and not self.reform_grace >= 0:
            raise ValueError(f"reform_grace must be non-negative, got {self.reform_grace}")
        if self.hang_timeout is not None and not 0 < self.hang_timeout < float("inf"):
            raise ValueError(f"hang_timeout must be positive seconds, got {self.hang_timeout}")
        files = self.redirects or self.tee
        if self.log_dir is None and (
            files or self.duplicate_stdout_filters or self.duplicate_stderr_filters
        ):
            raise ValueError("redirects, tee and duplicate filters write log files: give log_dir")
        if not self.signals:
            raise ValueError("signals must name at least one signal to handle")
        check_module_names(self.warm_preload)
        if self.virtual_local_rank:
            visible_device(os.environ if self.env is None else self.env, self.nproc_per_node - 1)

    def console(self, local_rank: int) -> Std:
        """Return the streams of a worker that reach the agent's console.

        Every stream, less the redirected ones that are not teed; none for a
        local rank outside ``local_ranks_filter``.
        """
        if self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            return Std.NONE
        return Std.ALL & ~(self.redirects.of(local_rank) & ~self.tee.of(local_rank))


@dataclass(frozen=True)
class AgentResult:
    """How the agent ended.

    Args:
        exit_code: The process exit status to use.
        reason: One line saying what happened.
        restarts: Restarts after failures that happened.
        failure: The worker failure that ended the run, if any.
    """

    exit_code: int
    reason: str
    restarts: int = 0
    failure: WorkerExit | None = None


@dataclass
class AgentStats:
    """What an agent has done so far, for metrics (read from any thread).

    Args:
        rounds: Rendezvous rounds this node completed.
        reforms: Times the workers stopped for a change of the group
            (not counted as restarts).
        restarts: Restarts counted after worker failures.
        evictions: Members this node evicted after missed heartbeats.
        join_seconds_sum: Seconds spent in completed rendezvous calls.
        join_seconds_last: Seconds the last completed rendezvous took.
        workers: Workers running now.
        world_size: Nodes in the current round (0 before the first).
        first_round: Whether a round has completed.
    """

    rounds: int = 0
    reforms: int = 0
    restarts: int = 0
    evictions: int = 0
    join_seconds_sum: float = 0.0
    join_seconds_last: float = 0.0
    workers: int = 0
    world_size: int = 0
    first_round: bool = False


class AgentInterrupted(Exception):  # noqa: N818 - a signal, not an error
    """Raised in the agent's main thread when it receives SIGINT or SIGTERM.

    Args:
        signum: The signal number.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


_PEER_WAIT_SLICE = 1.0
_LEAVE_BARRIER_TIMEOUT = 30.0
_GRACE_POLL = 0.2


def reform_grace(handler: RendezvousHandler) -> float:
    """Return how long a worker failure waits for a change of the group by default.

    For the dynamic rendezvous, the time it takes to find a dead member and
    one beat more (``keep_alive_interval * (keep_alive_max_attempt + 1)``);
    0 for other handlers.
    """
    if not isinstance(handler, DynamicRendezvousHandler):
        return 0.0
    settings = handler.settings
    beat = settings.keep_alive_interval.total_seconds()
    return beat * (settings.keep_alive_max_attempt + 1)


class _GroupChanged(Exception):  # noqa: N818 - control flow, not an error
    """A node joined or left while this node was setting up its workers."""


@dataclass
class _Attempt:
    info: RendezvousInfo
    ranks: NodeRanks
    workers: WorkerGroup
    server: BootstrapServer | None


class ElasticAgent:
    """Runs one node's workers under a rendezvous handler.

    Args:
        handler: The rendezvous handler (any backend).
        config: What to run.
        bootstrap_factory: Starts the workers' store on group rank 0 (a
            fresh ``rdzv.TCPStore`` server per attempt by default).
        sink: Where workers' prefixed output goes (the agent's stdout/stderr).
        log: Receives the agent's own one-line messages (by default they go to
            the sink's stderr, time-stamped: see :func:`agent_line`).
        progress_intervals: Seconds into a wait for the other nodes before
            the first progress line, and between lines.
        on_round: Called (in the agent's thread) once the workers of each
            round started, with the round's info.
    """

    def __init__(
        self,
        handler: RendezvousHandler,
        config: AgentConfig,
        bootstrap_factory: BootstrapFactory = tcp_store_server,
        sink: OutputSink | None = None,
        log: Callable[[str], None] | None = None,
        progress_intervals: tuple[float, float] = (FIRST_LINE_AFTER, LINE_EVERY),
        on_round: Callable[[RendezvousInfo], None] | None = None,
    ) -> None:
        self._handler = handler
        self._config = config
        self._bootstrap_factory = bootstrap_factory
        self._sink = sink or OutputSink()
        self._log = log or self._log_to_stderr
        self._run_id = handler.get_run_id()
        self._attempt: _Attempt | None = None
        self._attempts_started = 0
        self._restarts = 0
        self._cleaning_up = False
        self._signalled: int | None = None
        self._left = False
        self._scratch: Path | None = None
        self._progress = WaitProgress(self._run_id, self._log, *progress_intervals)
        node = handler.node if isinstance(handler, DynamicRendezvousHandler) else None
        self._node = node
        self._events = EventListener(self._on_event, self._run_id, node)
        self._failures = FirstFailure(self._run_id, node, self._log)
        self._on_round = on_round
        self._grace = reform_grace(handler) if config.reform_grace is None else config.reform_grace
        # The members of the round whose workers failed while restarts were
        # left: the restart is given back if the next round differs.
        self._failed_round: tuple[str, ...] | None = None
        self.stats = AgentStats()
        env = os.environ if config.env is None else config.env
        self._watch = HangWatch(config.hang_timeout, config.log_dir, env, self._log)
        self._warm = WarmSpares(
            config.python, config.entrypoint, config.warm_restart, config.warm_preload
        )

    def _on_event(self, event: Mapping[str, Any]) -> None:
        self._progress.event(event)
        if event.get("action") == "evict":
            evicted = event.get("evicted")
            if isinstance(evicted, list):
                self.stats.evictions += sum(1 for n in evicted if n != self._node)

    def run(self) -> AgentResult:
        """Run the job on this node until it finishes, fails or is interrupted; say how it ended."""
        with self._signal_handlers(), self._events.attached(), self._watch.serving():
            try:
                return self._loop()
            except AgentInterrupted as exc:
                self._cleaning_up = True
                self._end_attempt(signal.Signals(exc.signum))
                return AgentResult(
                    128 + exc.signum,
                    f"interrupted by {exc}: stopped the workers and left the rendezvous "
                    f"of run {self._run_id!r} (it stays open for the other nodes)",
                    self._restarts,
                )
            finally:
                self._cleaning_up = True
                self._warm.close()
                self._end_attempt()
                self._shutdown_handler()
                if self._scratch is not None:
                    shutil.rmtree(self._scratch, ignore_errors=True)

    @contextlib.contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            if self._cleaning_up:
                return
            # Remembered as well as raised: raised where nothing may raise (a
            # logging lock released after a fork, a finally) the exception is
            # swallowed, and _check_signalled raises it again at the next
            # step.
            self._signalled = signum
            raise AgentInterrupted(signum)

        def forward(signum: int, _frame: FrameType | None) -> None:
            attempt = self._attempt
            if attempt is not None and not self._cleaning_up:
                attempt.workers.send_signal(signal.Signals(signum))

        previous = {sig: signal.signal(sig, on_signal) for sig in self._config.signals}
        for sig in self._config.forwarded:
            if sig not in previous:
                previous[sig] = signal.signal(sig, forward)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _check_signalled(self) -> None:
        """Raise :class:`AgentInterrupted` for a signal whose exception was swallowed."""
        if self._signalled is not None:
            raise AgentInterrupted(self._signalled)

    def _loop(self) -> AgentResult:
        while True:
            self._check_signalled()
            try:
                started = time.monotonic()
                with self._progress.waiting():
                    info = self._handler.next_rendezvous()
                self._round_completed(info, time.monotonic() - started)
            except RendezvousGracefulExitError as exc:
                return AgentResult(
                    EXIT_OK,
                    f"this node is a spare that run {self._run_id!r} does not need; "
                    f"exiting cleanly ({exc})",
                    self._restarts,
                )
            except RendezvousClosedError as exc:
                return AgentResult(
                    EXIT_RENDEZVOUS,
                    self._failures.after(
                        f"the rendezvous of run {self._run_id!r} is closed "
                        f"(the job finished or gave up): {exc}"
                    ),
                    self._restarts,
                )
            except RendezvousError as exc:
                reason = (
                    f"the rendezvous of run {self._run_id!r} failed: {type(exc).__name__}: {exc}"
                )
                if isinstance(exc, RendezvousTimeoutError):
                    details = describe_timeout(self._handler)
                    reason += f" ({details})" if details else ""
                return AgentResult(EXIT_RENDEZVOUS, reason, self._restarts)
            try:
                self._start_attempt(info)
            except _GroupChanged:
                self._log(
                    "the group changed while the workers were being set up: re-rendezvous "
                    "(not counted as a restart)"
                )
                self._end_attempt()
                continue
            except RendezvousError as exc:
                return AgentResult(
                    EXIT_RENDEZVOUS,
                    f"setting up the workers of run {self._run_id!r} failed: "
                    f"{type(exc).__name__}: {exc}",
                    self._restarts,
                )
            if self._on_round is not None:
                self._on_round(info)
            result = self._monitor()
            if result is not None:
                return result

    def _round_completed(self, info: RendezvousInfo, took: float) -> None:
        stats = self.stats
        stats.rounds += 1
        stats.join_seconds_last = took
        stats.join_seconds_sum += took
        stats.world_size = info.world_size
        stats.first_round = True
        failed, self._failed_round = self._failed_round, None
        if failed is None or self._restarts == 0:
            return
        # Read only after a failure: the list is O(N) bytes, which every
        # agent of a large job would read at every round.
        members = _members(info)
        if members != failed:
            self._restarts -= 1
            stats.restarts = self._restarts
            stats.reforms += 1
            self._log(
                f"the group changed since the workers failed ({len(failed)} -> "
                f"{len(members)} nodes): that counts as a re-form, not a restart "
                f"(restart {self._restarts}/{self._config.max_restarts})"
            )

    def _wait_for_peers(self, store: Store, keys: Sequence[str]) -> None:
        # Wait in short slices so that a member dying during set-up (its
        # record never comes) sends everyone back to the rendezvous instead
        # of hanging until the store timeout.
        budget = store.timeout.total_seconds()
        deadline = time.monotonic() + budget
        while True:
            remaining = deadline - time.monotonic()
            try:
                store.wait(keys, timeout=max(min(_PEER_WAIT_SLICE, remaining), 0.0))
                return
            except StoreTimeoutError:
                if remaining <= _PEER_WAIT_SLICE:
                    raise
            if self._handler.num_nodes_waiting() > 0:
                raise _GroupChanged

    def _start_attempt(self, info: RendezvousInfo) -> None:
        cfg = self._config
        ranks = assign_ranks(
            info.store,
            info.rank,
            info.world_size,
            cfg.nproc_per_node,
            cfg.role,
            self._wait_for_peers,
        )
        master, server = exchange_bootstrap(
            info.store, info.rank, self._bootstrap_factory, cfg.local_addr, self._wait_for_peers
        )
        base_env = dict(os.environ if cfg.env is None else cfg.env)
        attempt_dir = Path(self._run_id, f"attempt_{self._attempts_started}")
        log_dir = None if cfg.log_dir is None else cfg.log_dir / attempt_dir
        error_dir = (log_dir or self._scratch_dir() / attempt_dir).resolve()
        base_env.update(self._watch.begin(attempt_dir))
        command = [*cfg.entrypoint] if cfg.python is None else [cfg.python, "-u", *cfg.entrypoint]
        specs = []
        for local_rank in range(cfg.nproc_per_node):
            rank = ranks.base_rank + local_rank
            error_file = error_dir / f"rank_{rank}.error.json"
            prefix = None
            if cfg.log_line_prefix_template is not None:
                prefix = string.Template(cfg.log_line_prefix_template).safe_substitute(
                    role_name=cfg.role, rank=rank, local_rank=local_rank
                )
            env = worker_environment(
                base_env,
                ranks,
                local_rank,
                master,
                self._restarts,
                cfg.max_restarts,
                self._run_id,
                error_file=str(error_file),
                signals_to_handle=",".join(s.name for s in cfg.signals),
                virtual_local_rank=cfg.virtual_local_rank,
            )
            specs.append(
                WorkerSpec(
                    rank, local_rank, command, env, cfg.console(local_rank), prefix, error_file
                )
            )
        workers = WorkerGroup(
            specs,
            self._sink,
            log_dir,
            cfg.duplicate_stdout_filters,
            cfg.duplicate_stderr_filters,
            self._warm.start,
        )
        self._attempt = _Attempt(info, ranks, workers, server)
        self._failures.round_started(info, ranks.group_rank, self._restarts)
        self._attempts_started += 1
        self._log(
            f"node {ranks.group_rank}/{ranks.group_world_size} starting workers "
            f"{ranks.base_rank}-{ranks.base_rank + ranks.local_world_size - 1} of "
            f"{ranks.world_size} (restart {self._restarts}/{cfg.max_restarts}, "
            f"MASTER_ADDR={master.master_addr} MASTER_PORT={master.master_port})"
        )
        try:
            workers.start()
        except OSError as exc:
            raise RendezvousError(f"could not start the workers: {exc}") from exc
        self._check_signalled()
        if self._restarts < cfg.max_restarts or self._node is not None:
            self._warm.prepare(specs)  # another attempt may come
        self.stats.workers = len(specs)
        self._publish(info.store, ranks.group_rank, len(specs))

    def _publish(self, store: Store, group_rank: int, workers: int) -> None:
        """Say in the round's store how this node runs, for ``rdzv status``."""
        record = {"host": socket.gethostname(), "workers": workers, "restarts": self._restarts}
        try:
            store.set(agent_key(group_rank), json.dumps(record))
        except RendezvousError as exc:
            self._log(f"could not publish this node's status: {type(exc).__name__}: {exc}")

    def _monitor(self) -> AgentResult | None:
        attempt = self._attempt
        assert attempt is not None
        cfg = self._config
        waiting_error = ""
        while True:
            self._check_signalled()
            exits = attempt.workers.poll()
            if exits is not None:
                if exits and exits[0].returncode != 0:
                    return self._on_failure(exits[0], attempt.info)
                return self._on_success(attempt)
            hung = self._watch.check(attempt.workers)
            if hung is not None:
                return self._on_failure(hung, attempt.info)
            try:
                waiting = self._handler.num_nodes_waiting()
                waiting_error = ""
            except RendezvousError as exc:
                message = f"{type(exc).__name__}: {exc}"
                if message != waiting_error:
                    self._log(f"cannot ask the rendezvous for waiting nodes: {message}")
                waiting_error = message
                waiting = 0
            if waiting > 0:
                self._failures.say(
                    f"{describe_change(self._handler, waiting)}: stopping the workers to "
                    "re-rendezvous (not counted as a restart)"
                )
                self.stats.reforms += 1
                self._end_attempt()
                return None
            time.sleep(cfg.monitor_interval)

    def _nodes_waiting(self) -> int:
        try:
            return self._handler.num_nodes_waiting()
        except RendezvousError:
            return 0

    def _group_changes(self, within: float) -> bool:
        """Tell whether nodes wait or a member left within ``within`` seconds.

        It ends early, with False, when another node closed the run.
        """
        deadline = time.monotonic() + within
        while True:
            try:
                if self._handler.is_closed():
                    return False
            except RendezvousError:
                pass
            if self._nodes_waiting() > 0:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(_GRACE_POLL, remaining))

    def _on_failure(self, failure: WorkerExit, info: RendezvousInfo) -> AgentResult | None:
        self._failures.report(failure)
        self._end_attempt()
        cfg = self._config
        waiting = self._nodes_waiting()
        if waiting > 0:
            self.stats.reforms += 1
            self._failures.say(
                f"{failure.describe()} as the group changed "
                f"({describe_change(self._handler, waiting)}): re-rendezvous "
                "(not counted as a restart)"
            )
            return None
        if self._restarts < cfg.max_restarts:
            self._restarts += 1
            self.stats.restarts = self._restarts
            self._failed_round = _members(info)
            self._failures.say(
                f"{failure.describe()}; restarting the group "
                f"(restart {self._restarts}/{cfg.max_restarts})"
            )
            return None
        if self._grace > 0:
            self._failures.say(
                f"{failure.describe()}; no restart left: waiting up to {self._grace:g} s "
                "for a change of the group that would make it a re-form"
            )
            if self._group_changes(self._grace):
                self.stats.reforms += 1
                change = describe_change(self._handler, self._nodes_waiting() or 1)
                self._failures.say(
                    f"the failure came with a change of the group ({change}): "
                    "re-rendezvous (not counted as a restart)"
                )
                return None
        self._close_run()
        spent = f"after {self._restarts} restart(s)" if cfg.max_restarts else "(no restarts)"
        return AgentResult(
            EXIT_WORKER_FAILED,
            self._failures.after(f"run {self._run_id!r} failed {spent}: {failure.describe()}"),
            self._restarts,
            failure,
        )

    def _on_success(self, attempt: _Attempt) -> AgentResult:
        self._warm.close()
        attempt.workers.close()
        self._exit_barrier(attempt)
        self._end_attempt()
        self._shutdown_handler()
        self._leave_barrier(attempt)
        return AgentResult(
            EXIT_OK,
            f"all {attempt.ranks.local_world_size} worker(s) of node "
            f"{attempt.ranks.group_rank} finished; run {self._run_id!r} succeeded",
            self._restarts,
        )

    def _exit_barrier(self, attempt: _Attempt) -> None:
        # The last agent to arrive knows that every node of the group
        # succeeded: it alone closes the run, before releasing the others, so
        # nobody writes to a store whose host may already be gone.
        store = attempt.info.store
        total = attempt.ranks.group_world_size
        try:
            if store.add(f"{LAUNCH_ROOT}/exit/count", 1) >= total:
                self._close_run()
                store.set(f"{LAUNCH_ROOT}/exit/done", "1")
            store.wait([f"{LAUNCH_ROOT}/exit/done"], timeout=self._config.exit_barrier_timeout)
        except RendezvousError as exc:
            self._log(f"not every node reached the exit barrier: {type(exc).__name__}: {exc}")

    def _close_run(self) -> None:
        try:
            self._handler.set_closed()
        except RendezvousError as exc:
            self._log(f"could not close run {self._run_id!r}: {type(exc).__name__}: {exc}")

    def _scratch_dir(self) -> Path:
        """A private directory for the error files when there is no log directory."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="rdzv-run-"))
        return self._scratch

    def _end_attempt(self, signum: signal.Signals = signal.SIGTERM) -> None:
        attempt = self._attempt
        if attempt is None:
            return
        attempt.workers.stop(self._config.stop_grace, signum)
        self._attempt = None
        self.stats.workers = 0
        if attempt.server is not None:
            attempt.server.close()

    def _log_to_stderr(self, message: str) -> None:
        # Through the sink, so that it never splits a worker's line.
        self._sink.write_line(agent_line(message), to_stderr=True)

    def _leave_barrier(self, attempt: _Attempt) -> None:
        # Whichever agent hosts the rendezvous store must outlive the others'
        # shutdown writes: every agent counts itself out after leaving and
        # waits (briefly) for the rest before its process, and maybe the
        # store, goes away.
        store = attempt.info.store
        total = attempt.ranks.group_world_size
        try:
            if store.add(f"{LAUNCH_ROOT}/left/count", 1) >= total:
                store.set(f"{LAUNCH_ROOT}/left/done", "1")
            store.wait([f"{LAUNCH_ROOT}/left/done"], timeout=_LEAVE_BARRIER_TIMEOUT)
        except RendezvousConnectionError:
            # The store went away after this node counted itself out: its
            # host left as the barrier completed. Nothing is lost.
            pass
        except RendezvousError as exc:
            self._log(f"not every node confirmed leaving: {type(exc).__name__}: {exc}")

    def _shutdown_handler(self) -> None:
        if self._left:
            return
        self._left = True
        try:
            self._handler.shutdown()
        except RendezvousError as exc:
            self._log(f"leaving the rendezvous failed: {type(exc).__name__}: {exc}")


def _members(info: RendezvousInfo) -> tuple[str, ...]:
    """The members of a round, as far as the info tells them (addresses, sorted)."""
    return tuple(sorted(info.participants)) or (str(info.world_size),)
