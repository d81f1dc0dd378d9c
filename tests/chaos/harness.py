"""The chaos harness: many agent processes, random faults, invariants checked.

Theory of operation
-------------------
A :class:`ChaosRun` starts the store host (``rdzv serve`` in a subprocess),
a :class:`~tests.chaos.proxy.FaultProxy` in front of it, and a population of
agent processes (:mod:`tests.nodes.agent` ``loop``) that re-rendezvous forever through
the proxy. A seeded random schedule injects one fault every one to three
seconds: an agent SIGKILLed (and a fresh one started later: a late joiner),
an agent paused with SIGSTOP past the heartbeat bound and resumed, every
proxied connection cut, the proxy delaying traffic, the store host killed
and restarted (a new epoch: the state is gone), an extra agent joining.

A :class:`Checker` receives every line the agents print and the harness's own
fault log, and checks the invariants: the members of a completed round agree
on its participants and ranks (so no two groups complete the same round); a
node SIGKILLed is in no round first completed later than the detection bound
after the kill; no ``next_rendezvous`` runs past its deadline (join timeout
plus store timeouts, plus any time the agent spent paused); and the stored
state, read by a monitor every half second, always decodes. Rounds are told
apart per store epoch; a round whose call straddled a store restart is not
attributed to either epoch and is counted as straddled.

With ``net="netns"`` every agent and every server runs in its own network
namespace and partitions replace the proxy's cuts and delays
(:mod:`tests.chaos.netns`).

Everything is driven by one seed, printed first, so a run replays (as far as
process scheduling allows).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdzv.errors import RendezvousStateError
from rdzv.retry import deadline_within
from tests.chaos.clusters import EPOCH_KEY, RUN_ID, Cluster, make_cluster
from tests.chaos.netns import FAULTS, NetnsTopology
from tests.procs import subprocess_env

READ_TIMEOUT = 5.0
_HARNESS_CALL = 1.0
"""Seconds the harness's own reads and writes of the servers may take (a paused store)."""
_FINAL_READ = 15.0
"""Seconds the harness tries at most to read the state once the faults are over."""


@dataclass
class Settings:
    """The shape of a run.

    Attributes:
        seed: Drives every random choice.
        backend: ``tcp``, ``etcd`` (one member), ``etcd3`` (three) or ``redis``.
        agents: Agents started at first (and kept running).
        min_nodes: ``min_nodes`` of the rendezvous.
        max_nodes: ``max_nodes`` of the rendezvous.
        seconds: Stop after this long.
        rounds: Stop once this many distinct rounds completed (0: no limit).
        min_faults: Run past ``seconds`` until the seeded schedule injected
            this many faults (bounded by ``seconds + 60``), so a short run on
            a loaded machine still meets every fault it plans.
        min_rounds: Likewise, run past ``seconds`` until this many distinct
            rounds completed (the same bound).
        join_timeout: The agents' join timeout.
        interval: The agents' keep-alive interval.
        attempts: The agents' keep-alive attempts (dead after interval x attempts).
        faults: Inject faults (False: a fault-free baseline).
        store_restarts: Allow the server-side fault (store host, Redis or an
            etcd member killed).
        log_dir: Each agent writes rdzv's debug log to a file here (None: no logs).
        steady: Agents stay in their round until another node waits (a
            training job), instead of leaving after a random stint; the
            liveness check then holds: without a fault, rounds stay flat.
        kinds: Inject these fault kinds in this order, cycling (empty: a
            seeded random mix), so a short run meets each of them.
        quiet_tail: Inject no fault in the last this many seconds (a quiet
            window the liveness check covers).
        net: ``loopback`` (everything on 127.0.0.1, faults through proxies) or
            ``netns`` (a host per agent and per server, partition faults).
    """

    seed: int
    backend: str = "tcp"
    agents: int = 4
    min_nodes: int = 2
    max_nodes: int = 4
    seconds: float = 40.0
    rounds: int = 0
    min_faults: int = 0
    min_rounds: int = 0
    join_timeout: float = 30.0
    interval: float = 0.3
    attempts: int = 3
    faults: bool = True
    store_restarts: bool = True
    log_dir: str | None = None
    steady: bool = False
    kinds: tuple[str, ...] = ()
    quiet_tail: float = 0.0
    net: str = "loopback"

    @property
    def dead_after(self) -> float:
        """Seconds without heartbeats after which a node is dead."""
        return self.interval * self.attempts

    @property
    def detection_bound(self) -> float:
        """Latest a killed node may still be in a newly completed round.

        The handler's bound (``dead_after``) plus the last-call window, two
        keep-alive periods of watcher lag and 3 s of scheduling slack on a
        loaded two-core host.
        """
        return self.dead_after + 0.3 + 2 * self.interval + 3.0

    @property
    def settle(self) -> float:
        """Seconds after a disturbance within which steady agents may still re-form.

        The detection bound, two last calls, and 4 s for a server restarted
        after its fault (an etcd member comes back 1-4 s later).
        """
        return self.detection_bound + 2 * 0.3 + 4.0

    @property
    def call_deadline(self) -> float:
        """Longest a ``next_rendezvous`` may take (not counting pauses)."""
        return self.join_timeout + 2 * READ_TIMEOUT + 5.0


@dataclass
class Figures:
    """What a run did and found."""

    seed: int
    backend: str = "tcp"
    seconds: float = 0.0
    rounds: int = 0
    round_records: int = 0
    straddled: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    agent_starts: int = 0
    agent_errors: Counter[str] = field(default_factory=Counter)
    error_samples: dict[str, str] = field(default_factory=dict)
    """The first message seen of each error class (by phase and class)."""
    state_reads: int = 0
    quiet_seconds: float = 0.0
    violations: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One human-readable block of the figures."""
        lines = [
            (
                f"backend={self.backend} seed={self.seed} seconds={self.seconds:.1f} "
                f"rounds={self.rounds} "
                f"round_records={self.round_records} straddled={self.straddled}"
            ),
            f"faults={sum(self.faults.values())} {dict(sorted(self.faults.items()))}",
            f"agent_starts={self.agent_starts} agent_errors={dict(self.agent_errors)}",
            f"state_reads={self.state_reads} violations={len(self.violations)}",
            f"quiet_seconds_checked={self.quiet_seconds:.1f}",
        ]
        lines += [f"  first {name}: {text}" for name, text in sorted(self.error_samples.items())]
        lines += [f"  VIOLATION {v}" for v in self.violations[:20]]
        return "\n".join(lines)


class Checker:
    """Checks the invariants over agent lines and the fault log (thread-safe)."""

    def __init__(self, settings: Settings, figures: Figures) -> None:
        self.settings = settings
        self.figures = figures
        self._lock = threading.Lock()
        self.groups: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        self.killed_at: dict[str, float] = {}
        self.paused: dict[str, float] = defaultdict(float)
        # Wall-clock times at which the group may change (faults, resumed
        # agents, new agents), and windows in which the store was paused.
        self.disturbances: list[float] = []
        self.stalls: list[tuple[float, float]] = []
        # Wall-clock windows in which the harness itself got no CPU (a
        # loaded machine): the agents were starved too.
        self.starved: list[tuple[float, float]] = []

    def disturbed(self, at: float) -> None:
        """Record that the group may change at wall-clock time ``at``."""
        with self._lock:
            self.disturbances.append(at)

    def store_stalled(self, start: float, end: float) -> None:
        """Record a store pause (wall clock): dead nodes cannot be judged meanwhile."""
        with self._lock:
            self.stalls.append((start, end))

    def harness_starved(self, start: float, end: float) -> None:
        """Record a window (wall clock) in which the harness's sampler got no CPU."""
        with self._lock:
            self.starved.append((start, end))

    def _stalled_between(self, start: float, end: float) -> float:
        return _overlap(self.stalls, start, end)

    def violation(self, text: str) -> None:
        with self._lock:
            self.figures.violations.append(text)

    def node_killed(self, node: str, at: float) -> None:
        with self._lock:
            self.killed_at[node] = at

    def node_paused(self, node: str, seconds: float) -> None:
        with self._lock:
            self.paused[node] += seconds

    def call_took(self, node: str, took: float, what: str) -> None:
        """Check one ``next_rendezvous`` duration against the deadline."""
        with self._lock:
            allowed = self.settings.call_deadline + self.paused[node]
        if took > allowed:
            self.violation(f"{node}: next_rendezvous {what} after {took:.1f} s > {allowed:.1f} s")

    def round_line(self, line: dict[str, Any]) -> None:
        """Check one completed-round line as it arrives."""
        node, rank, participants = line["node"], line["rank"], line["participants"]
        self.call_took(node, float(line["took"]), "returned")
        with self._lock:
            self.figures.round_records += 1
            if line["epoch"] is None:
                self.figures.straddled += 1
                return
        if not 0 <= rank < len(participants) or participants[rank] != node:
            self.violation(f"{node}: rank {rank} does not match participants {participants}")
        if line["world_size"] != len(participants):
            self.violation(f"{node}: world size {line['world_size']} != {len(participants)}")
        key = (int(line["epoch"]), int(line["round"]))
        with self._lock:
            group = self.groups[key]
            group.append(line)
            first = group[0]
        if first["participants"] != participants:
            self.violation(
                f"epoch {key[0]} round {key[1]} completed by two groups: "
                f"{first['participants']} and {participants}"
            )

    def finish(self, ended: float | None = None) -> None:
        """The checks that need every line: dead nodes left in time; with steady agents, liveness."""
        bound = self.settings.detection_bound
        with self._lock:
            groups = dict(self.groups)
            killed = dict(self.killed_at)
            self.figures.rounds = len(groups)
        for (epoch, round_id), lines in groups.items():
            completed = min(float(line["at"]) for line in lines)
            for node in lines[0]["participants"]:
                at = killed.get(node)
                if at is not None and completed > at + bound + self._stalled_between(at, completed):
                    self.violation(
                        f"epoch {epoch} round {round_id} first completed {completed - at:.1f} s "
                        f"after {node} was killed (bound {bound:.1f} s) and includes it"
                    )
        if self.settings.steady and ended is not None:
            completions = [min(float(line["at"]) for line in lines) for lines in groups.values()]
            self._check_liveness(sorted(completions), ended)

    def _check_liveness(self, completions: list[float], ended: float) -> None:
        """Without a disturbance, steady agents form no new round once settled."""
        settle = self.settings.settle
        with self._lock:
            marks = sorted(self.disturbances)
        if not marks:
            return
        with self._lock:
            starved = list(self.starved)
        for completed in completions:
            last = max((d for d in marks if d <= completed), default=marks[0])
            # Time in which the machine gave no CPU does not count towards settling.
            late = completed - last - _overlap(starved, last, completed)
            if late > settle:
                self.violation(
                    f"endless re-formation: a round completed {completed - last:.1f} s after the "
                    f"last disturbance ({late:.1f} s not counting starvation; settled after "
                    f"{settle:.1f} s)"
                )
        ends = [*marks[1:], ended]
        self.figures.quiet_seconds = sum(
            max(0.0, b - a - settle) for a, b in zip(marks, ends, strict=True)
        )


def _overlap(windows: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``windows`` within ``[start, end]``."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in windows)


STARVE_TICK = 0.05
"""The starvation sampler's sleep; an oversleep past ``STARVE_SLACK`` is a starved window."""
STARVE_SLACK = 0.1


def _parse(raw: str) -> dict[str, Any] | None:
    """Decode one agent line; None for anything that is not a JSON object."""
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    return line if isinstance(line, dict) else None


class _Agent:
    """One agent subprocess and the thread forwarding its lines."""

    def __init__(self, run: ChaosRun, seed: int) -> None:
        settings = run.settings
        inside = [] if run.topology is None else run.topology.place(self, _Agent.running)
        self.proc = subprocess.Popen(
            [
                *inside,
                sys.executable,
                "-m",
                "tests.nodes.agent",
                "loop",
                "--backend",
                run.cluster.rdzv_backend,
                "--endpoint",
                run.cluster.agent_endpoint,
                "--run-id",
                RUN_ID,
                "--epoch-key",
                EPOCH_KEY,
                *(["--is-host", "false"] if run.cluster.rdzv_backend == "c10d" else []),
                "--last-call",
                "0.3",
                "--read-timeout",
                str(READ_TIMEOUT),
                "--min",
                str(settings.min_nodes),
                "--max",
                str(settings.max_nodes),
                "--seed",
                str(seed),
                "--join",
                str(settings.join_timeout),
                "--interval",
                str(settings.interval),
                "--attempts",
                str(settings.attempts),
                *self._log_option(settings, run.figures.agent_starts),
                "--hold",
                "0" if settings.steady else "1.5",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=subprocess_env(),
            text=True,
        )
        self.node: str | None = None
        self.begun: float | None = None
        self.paused_until: float | None = None
        self._reader = threading.Thread(target=self._read, args=(run.lines,), daemon=True)
        self._reader.start()

    @staticmethod
    def _log_option(settings: Settings, number: int) -> list[str]:
        if settings.log_dir is None:
            return []
        return ["--log", os.path.join(settings.log_dir, f"agent-{number}.log")]

    def _read(self, lines: queue.Queue[tuple[_Agent, dict[str, Any]]]) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = _parse(raw)
            if line is not None:
                lines.put((self, line))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @staticmethod
    def running(agent: _Agent | None) -> bool:
        return agent is not None and agent.alive

    def signal(self, signum: int) -> None:
        if self.alive:
            os.kill(self.proc.pid, signum)

    def stop(self) -> None:
        if self.alive:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class ChaosRun:
    """One chaos run on the TCP store backend.

    Args:
        settings: The shape of the run.
        log: Where progress lines go (None: silent).
    """

    def __init__(self, settings: Settings, log: Any = None) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.figures = Figures(settings.seed, settings.backend)
        self.checker = Checker(settings, self.figures)
        self.lines: queue.Queue[tuple[_Agent, dict[str, Any]]] = queue.Queue()
        self.agents: list[_Agent] = []
        self.log = log
        self.epoch = 0
        self.topology: NetnsTopology | None = None
        if settings.net == "netns":
            self.topology = NetnsTopology(settings.backend, settings.max_nodes + 2)
            self.cluster: Cluster = self.topology.cluster
        else:
            self.cluster = make_cluster(settings.backend)
        self._cluster_lock = threading.Lock()
        self._monitor_stop = threading.Event()
        # Actions a fault schedules for later (a cut, a resumed store), by monotonic time.
        self._pending: list[tuple[float, Callable[[], None]]] = []
        self._cycle = 0
        self._extra_faults: dict[str, Callable[[list[_Agent]], None]] = {
            "kill-cut": self._fault_kill_during_eviction,
            "store-pause": self._fault_store_pause,
            "poison": self._fault_poison,
        }

    def _sample_starvation(self) -> None:
        """Record the windows in which this process got no CPU for a while."""
        while not self._monitor_stop.is_set():
            before = time.monotonic()
            time.sleep(STARVE_TICK)
            late = time.monotonic() - before - STARVE_TICK
            if late > STARVE_SLACK:
                now = time.time()
                self.checker.harness_starved(now - late, now)

    def _monitor(self) -> None:
        """Read and decode the stored state every half second."""
        while not self._monitor_stop.wait(0.5):
            self._check_state(_HARNESS_CALL)

    def _check_state(self, seconds: float) -> bool:
        """Read and decode the stored state once; False when it could not be read."""
        with self._cluster_lock, deadline_within(seconds):
            try:
                data = self.cluster.read_state()
            except Exception:
                return False
        if data is None:
            return False
        self.figures.state_reads += 1
        try:
            self.cluster.decode(data)
        except RendezvousStateError as exc:
            self.checker.violation(f"the stored state does not decode: {exc}")
        return True

    def _final_state_check(self) -> None:
        """Read the state once more after the faults, with a loaded machine's time.

        The monitor's reads have a short deadline (a paused store must not
        hold the harness); on a loaded machine, with the faults of a short
        run, every one of them can miss. This read comes after the last
        partition healed and the store resumed.
        """
        if self.topology is not None:
            self.topology.heal_now()
        give_up = time.monotonic() + _FINAL_READ
        while not self._check_state(_FINAL_READ / 3) and time.monotonic() < give_up:
            time.sleep(0.2)

    # -- agents --------------------------------------------------------------

    def _spawn(self) -> None:
        self.agents.append(_Agent(self, self.rng.randrange(1 << 30)))
        self.figures.agent_starts += 1
        self.checker.disturbed(time.time())

    def _live_agents(self) -> list[_Agent]:
        return [a for a in self.agents if a.alive]

    def _handle(self, agent: _Agent, line: dict[str, Any]) -> None:
        event = line.get("event")
        if "node" in line:
            agent.node = line["node"]
        if event == "begin":
            agent.begun = time.monotonic()
        elif event == "returned":
            agent.begun = None  # the call is over; the epoch read after it is not checked
        elif event == "round":
            agent.begun = None
            self.checker.round_line(line)
        elif event == "error":
            agent.begun = None
            self.figures.agent_errors[str(line.get("error"))] += 1
            sample = f"{line.get('phase')} {line.get('error')}"
            self.figures.error_samples.setdefault(sample, str(line.get("message", ""))[:300])
            if agent.node is not None and "took" in line:
                self.checker.call_took(agent.node, float(line["took"]), "raised")

    def _watchdog(self) -> None:
        """Flag agents stuck in ``next_rendezvous`` past their deadline."""
        now = time.monotonic()
        for agent in self._live_agents():
            if agent.begun is None or agent.node is None or agent.paused_until is not None:
                continue
            allowed = self.settings.call_deadline + self.checker.paused[agent.node]
            if now - agent.begun > allowed:
                self.checker.violation(f"{agent.node}: blocked for more than {allowed:.1f} s")
                agent.begun = None

    # -- faults --------------------------------------------------------------

    def _inject(self) -> None:
        self.checker.disturbed(time.time())
        kinds = ["kill", "pause", "cut", "delay", "join", *self._extra_faults]
        weights = [3, 2, 2, 2, 1, *([1] * len(self._extra_faults))]
        network = ["cut", "delay"]
        if self.topology is not None:  # no proxies: partitions instead of cuts and delays
            kinds, weights = ["kill", "pause", "join", *FAULTS], [3, 2, 1, *FAULTS.values()]
            network = ["split", "split"]
        if self.settings.store_restarts:
            kinds.append(self.cluster.server_fault)
            weights.append(1)
        if self.settings.kinds:
            kind = self.settings.kinds[self._cycle % len(self.settings.kinds)]
            self._cycle += 1
        else:
            kind = self.rng.choices(kinds, weights)[0]
        live = [a for a in self._live_agents() if a.paused_until is None]
        if kind in ("kill", "pause", "kill-cut") and (len(live) <= 1 or not live):
            kind = network[0]
        if kind == "join" and len(self._live_agents()) >= self.settings.max_nodes + 1:
            kind = network[1]
        self.figures.faults[kind] += 1
        if kind in self._extra_faults:
            self._extra_faults[kind](live)
        elif kind == "kill":
            victim = self.rng.choice(live)
            victim.signal(signal.SIGKILL)
            if victim.node is not None:
                self.checker.node_killed(victim.node, time.time())
        elif kind == "pause":
            victim = self.rng.choice(live)
            seconds = self.settings.dead_after * self.rng.uniform(1.5, 3.0)
            victim.signal(signal.SIGSTOP)
            victim.paused_until = time.monotonic() + seconds
            if victim.node is not None:
                self.checker.node_paused(victim.node, seconds + 1.0)
        elif kind == "cut":
            for proxy in self.cluster.proxies:
                proxy.cut()
        elif kind == "delay":
            delay = self.rng.uniform(0.01, 0.15)
            for proxy in self.cluster.proxies:
                proxy.delay = delay
            self._delay_until = time.monotonic() + self.rng.uniform(1.0, 3.0)
        elif kind == "join":
            self._spawn()
        elif kind in FAULTS and self.topology is not None:
            kind = self.topology.inject(kind, self.rng)  # the fault log names the groups
        else:
            with self._cluster_lock:
                if self.cluster.fault(self.rng):
                    self.epoch += 1
                    self.cluster.set_epoch(self.epoch)
        self._say(f"fault {kind}")

    def _fault_kill_during_eviction(self, live: list[_Agent]) -> None:
        """SIGKILL an agent, then cut every connection about when its ring neighbour evicts it."""
        victim = self.rng.choice(live)
        victim.signal(signal.SIGKILL)
        if victim.node is not None:
            self.checker.node_killed(victim.node, time.time())
        lag = self.rng.uniform(0.0, 2 * self.settings.interval)
        self._pending.append((time.monotonic() + self.settings.dead_after + lag, self._cut_all))

    def _cut_all(self) -> None:
        for proxy in self.cluster.proxies:
            proxy.cut()
        self.checker.disturbed(time.time())

    def _fault_store_pause(self, live: list[_Agent]) -> None:
        """SIGSTOP every server process for 1.5-3x the heartbeat bound, then SIGCONT them."""
        pids = self.cluster.server_pids()
        started = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

        def resume() -> None:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):  # killed meanwhile by a fault
                    os.kill(pid, signal.SIGCONT)
            self.checker.store_stalled(started, time.time())
            self.checker.disturbed(time.time())

        seconds = self.settings.dead_after * self.rng.uniform(1.5, 3.0)
        self._pending.append((time.monotonic() + seconds, resume))

    def _fault_poison(self, live: list[_Agent]) -> None:
        """Write a value that is no heartbeat mark into a live agent's heartbeat key."""
        nodes = [a.node for a in live if a.node is not None]
        if nodes:
            with self._cluster_lock, deadline_within(_HARNESS_CALL):
                self.cluster.poison_heartbeat(self.rng.choice(nodes))

    def _run_pending(self, now: float) -> None:
        due = [action for at, action in self._pending if at <= now]
        self._pending = [(at, action) for at, action in self._pending if at > now]
        for action in due:
            action()

    def _say(self, text: str) -> None:
        if self.log is not None:
            print(f"[chaos {time.monotonic() - self._t0:7.1f}s] {text}", file=self.log, flush=True)

    # -- the run -------------------------------------------------------------

    def run(self) -> Figures:
        """Run until the time or round budget is spent; return the figures."""
        settings = self.settings
        self._t0 = time.monotonic()
        self._delay_until = 0.0
        self._say(f"backend={settings.backend} seed={settings.seed}")
        self.cluster.start()
        self.epoch = 1
        self.cluster.set_epoch(self.epoch)
        monitor = threading.Thread(target=self._monitor, daemon=True)
        monitor.start()
        sampler = threading.Thread(target=self._sample_starvation, daemon=True)
        sampler.start()
        try:
            for _ in range(settings.agents):
                self._spawn()
            next_fault = time.monotonic() + self.rng.uniform(2.0, 4.0)
            end = self._t0 + settings.seconds
            hard_end = end + (60.0 if settings.min_faults or settings.min_rounds else 0.0)
            hard_end += settings.quiet_tail
            # The quiet tail runs from the last fault, however late a loaded machine made it.
            quiet_from = 0.0
            while True:
                now = time.monotonic()
                injected = sum(self.figures.faults.values())
                settled = now >= quiet_from + settings.quiet_tail
                enough = len(self.checker.groups) >= settings.min_rounds
                done = injected >= settings.min_faults and settled and enough
                if now >= hard_end or (now >= end and done):
                    break
                if settings.rounds and len(self.checker.groups) >= settings.rounds:
                    break
                try:
                    agent, line = self.lines.get(timeout=0.1)
                    self._handle(agent, line)
                except queue.Empty:
                    pass
                now = time.monotonic()
                for agent in self.agents:
                    if agent.paused_until is not None and now >= agent.paused_until:
                        agent.signal(signal.SIGCONT)
                        agent.paused_until = None
                        self.checker.disturbed(time.time())
                if self._delay_until and now >= self._delay_until:
                    for proxy in self.cluster.proxies:
                        proxy.delay = 0.0
                    self._delay_until = 0.0
                    self.checker.disturbed(time.time())
                with self._cluster_lock:
                    self.cluster.tick()
                self._run_pending(now)
                if self.topology is not None and self.topology.tick():
                    self._say("heal")
                    self.checker.disturbed(time.time())
                # Keep the population up: replace agents that died or exited.
                while len(self._live_agents()) < settings.agents:
                    self._spawn()
                faults_due = injected < settings.min_faults or now < end - settings.quiet_tail
                if settings.faults and now >= next_fault and faults_due:
                    self._inject()
                    next_fault = now + self.rng.uniform(1.0, 3.0)
                    quiet_from = now
                # Lines that queued up while the harness itself was slow end calls first.
                while not self.lines.empty():
                    self._handle(*self.lines.get_nowait())
                self._watchdog()
            while not self.lines.empty():
                self._handle(*self.lines.get_nowait())
        finally:
            self._run_pending(float("inf"))  # resume a paused store before stopping
            self._monitor_stop.set()
            monitor.join(30)
            self._final_state_check()
            sampler.join(30)
            for agent in self.agents:
                agent.stop()
            while not self.lines.empty():
                self._handle(*self.lines.get_nowait())
            self.cluster.stop()
            if self.topology is not None:
                self.topology.close()
        for start, end in self.cluster.outages:
            self.checker.store_stalled(start, end)
        self.checker.finish(time.time())
        self.figures.seconds = time.monotonic() - self._t0
        return self.figures
