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

The agent's configuration and results are :mod:`rdzv.launch.config`'s;
ranks, bootstrap, workers, warm spares, hangs, first failures, progress
and the end-of-job barriers have their own modules.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from rdzv.api import RendezvousHandler, RendezvousInfo
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
    StoreTimeoutError,
)
from rdzv.keys import agent_key
from rdzv.launch.barriers import exit_barrier, leave_barrier
from rdzv.launch.bootstrap import (
    BootstrapFactory,
    BootstrapServer,
    BootstrapSpec,
    bootstrap_server,
    exchange_bootstrap,
)
from rdzv.launch.config import (
    EXIT_OK,
    EXIT_RENDEZVOUS,
    EXIT_WORKER_FAILED,
    AgentConfig,
    AgentInterrupted,
    AgentResult,
    AgentStats,
)
from rdzv.launch.exits import WorkerExit
from rdzv.launch.explain import describe_change, describe_timeout
from rdzv.launch.failures import FirstFailure
from rdzv.launch.health import NodeHealth
from rdzv.launch.progress import FIRST_LINE_AFTER, LINE_EVERY, EventListener, WaitProgress
from rdzv.launch.ranks import (
    NodeRanks,
    assign_ranks,
)
from rdzv.launch.warm import WarmSpares
from rdzv.launch.watchdog import HangWatch
from rdzv.launch.workers import OutputSink, WorkerGroup, agent_line
from rdzv.net import listen_addresses, primary_address
from rdzv.store.base import Store
from rdzv.store.foreign import as_store

__all__ = ["ElasticAgent", "reform_grace"]


_PEER_WAIT_SLICE = 1.0
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
        bootstrap_factory: Starts the workers' store on group rank 0, given
            the round's :class:`~rdzv.launch.bootstrap.BootstrapSpec` (a fresh
            server per attempt, sized for the round, by default:
            :func:`~rdzv.launch.bootstrap.bootstrap_server`). It is told to
            listen on the address the agent publishes and loopback (every
            address with ``config.listen_all``, or when that address is not
            this machine's own: :func:`~rdzv.net.listen_addresses`).
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
        bootstrap_factory: BootstrapFactory = bootstrap_server,
        sink: OutputSink | None = None,
        log: Callable[[str], None] | None = None,
        progress_intervals: tuple[float, float] = (FIRST_LINE_AFTER, LINE_EVERY),
        on_round: Callable[[RendezvousInfo], None] | None = None,
    ) -> None:
        self._handler = handler
        self._config = config
        listen = listen_addresses(
            config.local_addr or primary_address(), listen_all=config.listen_all
        )
        self._listen = None if listen is None else tuple(listen)
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
        self._health = NodeHealth.for_agent(handler, config, self._log)
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
            self._health.before_join()
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
        round_store = as_store(info.store)
        ranks = assign_ranks(
            round_store,
            info.rank,
            info.world_size,
            cfg.nproc_per_node,
            cfg.role,
            self._wait_for_peers,
        )
        master, server = exchange_bootstrap(
            round_store,
            info.rank,
            self._bootstrap_factory,
            BootstrapSpec(ranks.world_size, info.world_size, self._listen),
            cfg.local_addr,
            self._wait_for_peers,
        )
        base_env = dict(os.environ if cfg.env is None else cfg.env)
        attempt_dir = Path(self._run_id, f"attempt_{self._attempts_started}")
        log_dir = None if cfg.log_dir is None else cfg.log_dir / attempt_dir
        error_dir = (log_dir or self._scratch_dir() / attempt_dir).resolve()
        base_env.update(self._watch.begin(attempt_dir))
        specs = cfg.worker_specs(ranks, master, base_env, error_dir, self._restarts, self._run_id)
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
        self._publish(round_store, ranks.group_rank, len(specs))

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
                self._health.attempt_ended(None)
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
        first = self._failures.report(failure)
        own = first is not None and first.node == self._node
        self._health.attempt_ended(failure.describe() if own else None)
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
        store, total = as_store(attempt.info.store), attempt.ranks.group_world_size
        exit_barrier(store, total, self._config.exit_barrier_timeout, self._close_run, self._log)
        self._end_attempt()
        self._shutdown_handler()
        leave_barrier(store, total, self._log)
        return AgentResult(
            EXIT_OK,
            f"all {attempt.ranks.local_world_size} worker(s) of node "
            f"{attempt.ranks.group_rank} finished; run {self._run_id!r} succeeded",
            self._restarts,
        )

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
