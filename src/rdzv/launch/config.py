"""What the elastic agent runs and how it ended: its configuration, result, statistics and exit codes.

The agent itself is :mod:`rdzv.launch.agent`; these are the values it is
given and gives back, and the ones ``rdzv run``, the metrics and the tests
share with it.
"""

from __future__ import annotations

import os
import signal
import string
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rdzv.api import RendezvousStoreInfo
from rdzv.exclusion import ExclusionPolicy
from rdzv.launch.exits import WorkerExit
from rdzv.launch.ranks import (
    DEFAULT_SIGNALS_TO_HANDLE,
    NodeRanks,
    visible_device,
    worker_environment,
)
from rdzv.launch.warm import check_module_names
from rdzv.launch.workers import Std, StdChoice, WorkerSpec

__all__ = [
    "DEFAULT_FORWARDED",
    "DEFAULT_HEALTH_CHECK_TIMEOUT",
    "DEFAULT_SIGNALS",
    "EXIT_OK",
    "EXIT_RENDEZVOUS",
    "EXIT_WORKER_FAILED",
    "MAX_SECONDS",
    "AgentConfig",
    "AgentInterrupted",
    "AgentResult",
    "AgentStats",
    "seconds_in_range",
]

#: Seconds a health check may run by default (``--health-check-timeout``).
DEFAULT_HEALTH_CHECK_TIMEOUT = 60.0

EXIT_OK = 0
EXIT_WORKER_FAILED = 1
EXIT_RENDEZVOUS = 3

#: The signals torchrun's agent handles by default.
DEFAULT_SIGNALS = tuple(signal.Signals[name] for name in DEFAULT_SIGNALS_TO_HANDLE.split(","))

#: Signals passed on to the workers without stopping anything (SLURM's
#: pre-emption warning, ``#SBATCH --signal=USR1@90``, is SIGUSR1).
DEFAULT_FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)

#: The longest duration in seconds the agent takes: a billion seconds (about
#: 31 years); Python's sleeps and lock timeouts overflow about ten times above it.
MAX_SECONDS = 1e9


def seconds_in_range(value: float, positive: bool = False) -> bool:
    """Tell whether ``value`` is a duration the agent takes (a number up to :data:`MAX_SECONDS`).

    It must be non-negative, or positive when ``positive``.
    """
    return (value > 0 if positive else value >= 0) and value <= MAX_SECONDS


def _check_seconds(name: str, value: float, positive: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a duration the agent takes."""
    if not seconds_in_range(value, positive):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be {kind} seconds up to {MAX_SECONDS:g}, got {value}")


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
        listen_all: The bootstrap store listens on every address, not only on
            the address it publishes and loopback (``--rdzv-conf listen_all=true``).
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
        health_check: A shell command run before each join; while it fails
            the node stays out (:mod:`rdzv.launch.health`), or None.
        health_check_timeout: Seconds the health check may run.
        exclusion: When this node's failures in a row exclude it, and for
            how long (off by default).

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
    listen_all: bool = False
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
    health_check: str | None = None
    health_check_timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT
    exclusion: ExclusionPolicy = field(default_factory=ExclusionPolicy)

    def __post_init__(self) -> None:
        if not self.entrypoint:
            raise ValueError("the worker entry point is empty; give a script or -m module")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be at least 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be non-negative, got {self.max_restarts}")
        _check_seconds("monitor_interval", self.monitor_interval, positive=True)
        _check_seconds("stop_grace", self.stop_grace)
        if not self.role:
            raise ValueError("role must be a non-empty name")
        if self.reform_grace is not None:
            _check_seconds("reform_grace", self.reform_grace)
        if self.hang_timeout is not None:
            _check_seconds("hang_timeout", self.hang_timeout, positive=True)
        files = self.redirects or self.tee
        if self.log_dir is None and (
            files or self.duplicate_stdout_filters or self.duplicate_stderr_filters
        ):
            raise ValueError("redirects, tee and duplicate filters write log files: give log_dir")
        if not self.signals:
            raise ValueError("signals must name at least one signal to handle")
        check_module_names(self.warm_preload)
        if self.health_check is not None and not self.health_check.strip():
            raise ValueError("health_check is an empty command")
        if not 0 < self.health_check_timeout < float("inf"):
            raise ValueError(
                f"health_check_timeout must be positive seconds, got {self.health_check_timeout}"
            )
        if self.virtual_local_rank:
            visible_device(os.environ if self.env is None else self.env, self.nproc_per_node - 1)

    def worker_specs(
        self,
        ranks: NodeRanks,
        master: RendezvousStoreInfo,
        base_env: Mapping[str, str],
        error_dir: Path,
        restarts: int,
        run_id: str,
    ) -> list[WorkerSpec]:
        """Return how this node's workers of an attempt start: command, environment, streams.

        Args:
            ranks: This node's ranks in the attempt.
            master: The workers' bootstrap store (``MASTER_ADDR``/``MASTER_PORT``).
            base_env: The environment every worker starts from.
            error_dir: Where each worker's ``TORCHELASTIC_ERROR_FILE`` goes.
            restarts: Restarts counted so far (``TORCHELASTIC_RESTART_COUNT``).
            run_id: The run.
        """
        command = (
            [*self.entrypoint] if self.python is None else [self.python, "-u", *self.entrypoint]
        )
        specs = []
        for local_rank in range(self.nproc_per_node):
            rank = ranks.base_rank + local_rank
            error_file = error_dir / f"rank_{rank}.error.json"
            prefix = None
            if self.log_line_prefix_template is not None:
                prefix = string.Template(self.log_line_prefix_template).safe_substitute(
                    role_name=self.role, rank=rank, local_rank=local_rank
                )
            env = worker_environment(
                base_env,
                ranks,
                local_rank,
                master,
                restarts,
                self.max_restarts,
                run_id,
                error_file=str(error_file),
                signals_to_handle=",".join(s.name for s in self.signals),
                virtual_local_rank=self.virtual_local_rank,
            )
            console = self.console(local_rank)
            specs.append(WorkerSpec(rank, local_rank, command, env, console, prefix, error_file))
        return specs

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
