"""Seconds from a failure to training again: ``rdzv run`` beside torchrun, on real gloo DDP jobs.

Run:  python benchmarks/recovery_bench.py [--reps 3] [--faults worker-kill,...]
          [--launchers rdzv,torchrun,torchrun-unshared] [--nproc 1] [--timeout 120]

Each run is one job of 3 agents on this machine (loopback), ``--nproc``
workers each, ``--nnodes 2:3 --max-restarts 3``, the c10d rendezvous on a
free port (the first agent hosts it), running ``recovery_worker.py`` (gloo
DDP on a tiny model, one step every 0.1 s, a time-stamped line per step).
Once every rank trains, the harness makes one fault:

* ``worker-kill``: SIGKILL of a worker of the third agent;
* ``worker-stop``: SIGSTOP of that worker (a hang; ``rdzv run`` gets
  ``--hang-timeout``, when it has that option);
* ``agent-kill``: a node lost: SIGKILL of the third agent and its workers
  at once;
* ``node-join``: the job starts with 2 agents, the third joins; recovered
  means training at the larger size;
* ``link-cut``: a host vanishes without a FIN: the three agents run in
  network namespaces (``rdzv.testing.netns``, root only) and the third
  host's link is cut (``rdzv run`` only).

and measures, from the worker and agent logs and from ``/proc``, the
seconds from the fault until an agent reacts, the old workers are gone, the
new round is formed, the new workers started, their process group is
ready and they all finished a step (see ``recovery_timeline.py``). A run
that does not train again within ``--timeout`` is ``never (> T s)``. Then
the harness ends the job (a stop file: the workers end at the same step),
or, when it did not recover, SIGTERMs the agents; it records the agents'
exit statuses and the processes of the run still running after the agents
ended (orphans), and kills every process of the run by pid and process
group. The launchers alternate within each repetition. The table gives the
minimum, median and maximum of the time to the first step, the restarts
the workers were given, the exit statuses, the orphans and the load
average at the fault; a second table gives each phase's median.

``rdzv run`` runs with ``--log-level INFO`` (its rendezvous events give the
round's completion), torchrun with ``LOGLEVEL=INFO``; neither changes
timing. ``torchrun-unshared`` is torchrun with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the workers get a new store per
round instead of the rendezvous one). See docs/recovery.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import recovery_procs as procs
from _common import free_port, stamp, subprocess_env
from recovery_report import Result, describe, report
from recovery_timeline import LogTail, WorkerEvent, first_training, phases

WORKER = Path(__file__).resolve().with_name("recovery_worker.py")
FAULTS = ("worker-kill", "worker-stop", "agent-kill", "node-join", "link-cut")
DEFAULT_FAULTS = ("worker-kill", "worker-stop", "agent-kill", "node-join")
NODES = 3
SETUP_BOUND = 240.0
"""Seconds a job may take to train at its first size (torchrun's last call alone is 30 s)."""
END_BOUND = 60.0
"""Seconds for a recovered job to end after the stop file, and for agents to end after SIGTERM."""
STEADY_STEPS = 5


class JobFailed(Exception):  # noqa: N818 - reads as the outcome it names
    """The job cannot reach what was waited for: its agents exited."""


@dataclass(frozen=True)
class Launcher:
    """One column: how an agent is started."""

    key: str
    title: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


PY = sys.executable
LAUNCHERS = {
    launcher.key: launcher
    for launcher in (
        Launcher("rdzv", "rdzv run", (PY, "-m", "rdzv", "run", "--log-level", "INFO")),
        Launcher(
            "rdzv-dynamo",
            "rdzv run --warm-preload torch._dynamo",
            (PY, "-m", "rdzv", "run", "--log-level", "INFO", "--warm-preload", "torch._dynamo"),
        ),
        Launcher(
            "torchrun", "torchrun", (PY, "-m", "torch.distributed.run"), (("LOGLEVEL", "INFO"),)
        ),
        Launcher(
            "torchrun-unshared",
            "torchrun, unshared store",
            (PY, "-m", "torch.distributed.run"),
            (("LOGLEVEL", "INFO"), ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")),
        ),
    )
}

DEFAULT_LAUNCHERS = ("rdzv", "torchrun", "torchrun-unshared")


@dataclass(frozen=True)
class Settings:
    """The options every run of one benchmark shares."""

    nproc: int
    timeout: float
    step_interval: float
    hang_timeout: float | None
    """``rdzv run --hang-timeout`` for ``worker-stop``; None: rdzv run lacks the option."""
    step_expiry: float | None
    rdzv_conf: str | None
    tmp: Path
    settle: float = 0.0
    """Seconds of training before the fault, once every rank stepped STEADY_STEPS times."""


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def hang_option_supported() -> bool:
    """Whether ``rdzv run --help`` lists ``--hang-timeout``."""
    done = subprocess.run(
        [PY, "-m", "rdzv", "run", "--help"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return "--hang-timeout" in done.stdout


class Job:
    """The agents of one run, their logs, and every process they started; ``close`` kills them all.

    ``wrap`` turns an agent's command into the one to start (a network
    namespace's ``ip netns exec``); ``endpoint_host`` is the rendezvous
    host's address.
    """

    def __init__(
        self,
        launcher: Launcher,
        fault: str,
        settings: Settings,
        run_dir: Path,
        wrap: Callable[[int, list[str]], list[str]] = lambda _i, args: args,
        endpoint_host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
    ) -> None:
        self.launcher = launcher
        self.settings = settings
        self.dir = run_dir
        self.out = run_dir / "out"
        self.out.mkdir(parents=True)
        self.port = free_port()
        self.wrap = wrap
        self.agents: list[subprocess.Popen[bytes]] = []
        self.tails: list[LogTail] = []
        self.harness_stopped: set[int] = set()
        args = [
            *launcher.command,
            "--nnodes=2:3",
            f"--nproc-per-node={settings.nproc}",
            "--max-restarts=3",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint_host}:{self.port}",
            f"--rdzv-id=recovery-{uuid.uuid4().hex[:12]}",
        ]
        if settings.rdzv_conf:
            args.append(f"--rdzv-conf={settings.rdzv_conf}")
        if fault == "worker-stop" and launcher.key.startswith("rdzv") and settings.hang_timeout:
            args.append(f"--hang-timeout={settings.hang_timeout:g}")
        self.args = [*args, str(WORKER), str(self.out), f"{settings.step_interval:g}"]
        extra = {"OMP_NUM_THREADS": "1", **dict(launcher.env), **(env or {})}
        if settings.step_expiry is not None:
            extra.update(
                RECOVERY_STEP_EXPIRY=f"{settings.step_expiry:g}", TORCHELASTIC_ENABLE_FILE_TIMER="1"
            )
        self.env = subprocess_env(**extra)

    def start_agent(self) -> subprocess.Popen[bytes]:
        index = len(self.agents)
        log = self.dir / f"agent-{index}.log"
        with log.open("wb") as f:
            proc = subprocess.Popen(
                self.wrap(index, self.args),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.agents.append(proc)
        self.tails.append(LogTail(log, index))
        return proc

    def start(self, count: int) -> None:
        """Start ``count`` agents, the first (the rendezvous host) alone until it listens."""
        first = self.start_agent()
        self.until(lambda: procs.listening(first.pid, self.port), "the rendezvous store", 60)
        for _ in range(count - 1):
            self.start_agent()

    def read(self) -> None:
        for tail in self.tails:
            tail.read()

    @property
    def events(self) -> list[WorkerEvent]:
        return [e for tail in self.tails for e in tail.events]

    def until(
        self,
        predicate: Callable[[], object],
        what: str,
        bound: float,
        broken: Callable[[], str] | None = None,
    ) -> None:
        """Poll ``predicate`` (logs read first) until true.

        Raises:
            TimeoutError: not within ``bound`` seconds.
            JobFailed: ``broken()`` said why it never will be (by default:
                an agent exited).
        """
        broken = broken or self.any_exited
        deadline = time.monotonic() + bound
        while True:
            self.read()
            if predicate():
                return
            why = broken()
            if why:
                raise JobFailed(f"{what}: {why}\n{self.tail_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {bound:g} s\n{self.tail_text()}")
            time.sleep(0.1)

    def any_exited(self) -> str:
        dead = {i: a.returncode for i, a in enumerate(self.agents) if a.poll() is not None}
        return f"agent(s) exited: {dead}" if dead else ""

    def too_few(self, skip: set[int]) -> str:
        """Why the job cannot train again: fewer than 2 agents (--nnodes 2:3) still run."""
        live = [i for i, a in enumerate(self.agents) if i not in skip and a.poll() is None]
        if len(live) >= 2:
            return ""
        dead = {
            i: a.returncode
            for i, a in enumerate(self.agents)
            if i not in skip and a.poll() is not None
        }
        return f"fewer than 2 agents left (exited: {dead})"

    def training(self, world: int) -> bool:
        """Whether every rank of ``world`` stepped at least STEADY_STEPS times, lately."""
        latest: dict[int, WorkerEvent] = {}
        for e in self.events:
            if e.event == "step" and e.world == world:
                latest[e.rank] = e
        now = time.time()
        return set(latest) == set(range(world)) and all(
            e.step >= STEADY_STEPS and now - e.t < 2.0 for e in latest.values()
        )

    def workers(self, agent: int | None = None) -> set[int]:
        """The agents' running workers: descendants that printed an event.

        A warm spare of ``rdzv run`` (a preloaded process waiting to become
        the next attempt's worker) has printed nothing: it is no old worker.
        """
        chosen = self.agents if agent is None else [self.agents[agent]]
        printed = {e.pid for e in self.events}
        return procs.descendants(a.pid for a in chosen if a.poll() is None) & printed

    def end(self, recovered: bool, skip: set[int]) -> None:
        """Let the job end (the stop file), or SIGTERM agents that do not; SIGKILL last."""
        (self.out / "stop").touch()
        live = [i for i, a in enumerate(self.agents) if i not in skip and a.poll() is None]
        if recovered:
            with contextlib.suppress(TimeoutError):
                self.until_exit(live, END_BOUND)
        late = [i for i in live if self.agents[i].poll() is None]
        self.harness_stopped.update(late)
        procs.kill((self.agents[i].pid for i in late), signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            self.until_exit(late, END_BOUND)
        procs.kill_groups(self.agents[i].pid for i in late if self.agents[i].poll() is None)

    def until_exit(self, indices: Sequence[int], bound: float) -> None:
        deadline = time.monotonic() + bound
        while any(self.agents[i].poll() is None for i in indices):
            if time.monotonic() > deadline:
                raise TimeoutError("agents still running")
            time.sleep(0.1)

    def leftovers(self) -> set[int]:
        """Running processes of this run (its directory in their command line, or their groups)."""
        pids = {a.pid for a in self.agents} | {e.pid for e in self.events}
        return procs.leftovers(f"{self.dir}/", pids)

    def close(self) -> None:
        """SIGKILL every process of the run still running, by pid and process group; reap the agents."""
        procs.kill_groups(a.pid for a in self.agents)
        for _ in range(3):
            left = self.leftovers()
            if not left:
                break
            procs.kill_groups(left)
            procs.kill(left)
            time.sleep(0.2)
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=30)

    def exits(self, skip: set[int]) -> list[str]:
        codes = []
        for i, agent in enumerate(self.agents):
            if i in skip:
                continue
            code = agent.poll()
            mark = "*" if i in self.harness_stopped else ""
            codes.append(("running" if code is None else str(code)) + mark)
        return codes

    def tail_text(self, lines: int = 15) -> str:
        return "\n".join(
            f"--- {t.path.name}\n"
            + "\n".join(t.path.read_text(errors="replace").splitlines()[-lines:])
            for t in self.tails
        )


@dataclass
class Fault:
    """A fault as made: when, which agents' lines count, which agents are gone, what must stop."""

    t: float
    observers: set[int]
    gone: set[int]
    must_stop: set[int]
    world: int | None
    """The size the job must train at again (None: any)."""


def make_fault(job: Job, fault: str, old: set[int], cut: Callable[[int], None] | None) -> Fault:
    """Make ``fault`` on the running ``job`` (workers ``old``), to the third agent.

    The third agent is never the rendezvous host (the first one).
    """
    victim = NODES - 1
    others = set(range(NODES)) - {victim}
    smaller = (NODES - 1) * job.settings.nproc
    if fault in ("worker-kill", "worker-stop"):
        worker = min(job.workers(victim))
        signum = signal.SIGKILL if fault == "worker-kill" else signal.SIGSTOP
        t = time.time()
        procs.kill([worker], signum)
        return Fault(t, set(range(NODES)), set(), old, None)
    if fault == "agent-kill":
        agent = job.agents[victim].pid
        node = procs.descendants([agent])  # its workers and any warm spare: the node is lost
        t = time.time()
        procs.kill([agent, *node])
        return Fault(t, others, {victim}, old, smaller)
    if fault == "link-cut":
        assert cut is not None
        isolated = job.workers(victim)
        t = time.time()
        cut(victim)
        return Fault(t, others, {victim}, old - isolated, smaller)
    t = time.time()  # node-join
    job.start_agent()
    return Fault(t, others, set(), old, NODES * job.settings.nproc)


def follow(job: Job, made: Fault, old: set[int], result: Result) -> None:
    """Wait until the job trains again (or cannot, or --timeout passed); fill ``result``."""
    watch = procs.EndWatch(made.must_stop)
    try:
        job.until(
            lambda: first_training(job.events, made.t, old, made.world) is not None,
            "training again",
            job.settings.timeout,
            broken=lambda: job.too_few(made.gone),
        )
        result.outcome = "recovered"
    except TimeoutError:
        result.outcome = "timeout"
    except JobFailed as exc:
        result.outcome = "failed"
        result.note = str(exc).splitlines()[0]
    finally:
        ended = watch.stop()
    job.read()
    lines = [x for tail in job.tails for x in tail.lines]
    result.recovery = phases(made.t, job.events, lines, old, ended, made.observers, made.world)


def one_run(job: Job, fault: str, result: Result, cut: Callable[[int], None] | None = None) -> None:
    """Start ``job``, make ``fault``, follow the recovery, end the job; fill ``result``.

    Every process of the run is stopped, whatever happens.
    """
    start_nodes = NODES - 1 if fault == "node-join" else NODES
    world = start_nodes * job.settings.nproc
    try:
        try:
            job.start(start_nodes)
            job.until(lambda: job.training(world), f"training at world {world}", SETUP_BOUND)
        except (TimeoutError, JobFailed) as exc:
            result.note = f"setup failed: {str(exc).splitlines()[0]}"
            print(str(exc), file=sys.stderr, flush=True)
            return
        time.sleep(job.settings.settle)
        old = job.workers()
        result.load = load1()
        made = make_fault(job, fault, old, cut)
        follow(job, made, old, result)
        for gone in made.gone:  # the cut-off host's processes are not the survivors' business
            procs.kill([job.agents[gone].pid, *procs.descendants([job.agents[gone].pid])])
        job.end(result.outcome == "recovered", made.gone)
        result.exits = job.exits(made.gone)
        result.orphans = len(job.leftovers())
    finally:
        job.close()


@contextlib.contextmanager
def netns_bed() -> Iterator[Any]:
    """Three hosts in network namespaces (``rdzv.testing.netns``), or None where they cannot be made."""
    from rdzv.testing.netns import NetnsBed, NetnsUnavailable

    bed = NetnsBed(NODES)
    try:
        bed.__enter__()
    except NetnsUnavailable as exc:
        print(f"link-cut: network namespaces unavailable ({exc})", flush=True)
        yield None
        return
    try:
        yield bed
    finally:
        bed.close()


def run_one(launcher: Launcher, fault: str, rep: int, settings: Settings, bed: Any) -> Result:
    """One run of ``fault`` under ``launcher`` (``bed``: the network namespaces of ``link-cut``)."""
    result = Result(fault, launcher.title, rep)
    if fault == "worker-stop" and launcher.key.startswith("rdzv") and settings.hang_timeout is None:
        result.note = "not supported"
        return result
    if fault == "link-cut" and (launcher.key != "rdzv" or bed is None):
        result.note = "rdzv run only" if launcher.key != "rdzv" else "no network namespaces"
        return result
    run_dir = settings.tmp / f"{rep}-{fault}-{launcher.key}"
    if fault == "link-cut":
        bed.heal()
        hosts = bed.hosts
        job = Job(
            launcher,
            fault,
            settings,
            run_dir,
            wrap=lambda i, args: hosts[i].command(args),
            endpoint_host=hosts[0].ipv4,
            env={"GLOO_SOCKET_IFNAME": "eth0"},
        )
        try:
            one_run(job, fault, result, cut=bed.isolate)
        finally:
            bed.heal()
    else:
        one_run(Job(launcher, fault, settings, run_dir), fault, result)
    return result


def names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """The comma-separated names of ``text``; ValueError naming ``--what`` when one is unknown."""
    chosen = [n.strip() for n in text.split(",") if n.strip()]
    if not chosen or any(n not in allowed for n in chosen):
        raise ValueError(f"--{what} {text!r}: choose from {', '.join(allowed)}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--faults", default=",".join(DEFAULT_FAULTS), help=f"of {', '.join(FAULTS)}"
    )
    parser.add_argument(
        "--launchers", default=",".join(DEFAULT_LAUNCHERS), help=f"of {', '.join(LAUNCHERS)}"
    )
    parser.add_argument("--nproc", type=int, default=1, choices=(1, 2))
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds a run may take to train again"
    )
    parser.add_argument(
        "--hang-timeout", type=float, default=10.0, help="rdzv run's, for worker-stop"
    )
    parser.add_argument("--step-interval", type=float, default=0.1)
    parser.add_argument(
        "--step-expiry",
        type=float,
        help="each step under torch's expires(after=S); torchrun serves the timers "
        "(TORCHELASTIC_ENABLE_FILE_TIMER=1)",
    )
    parser.add_argument("--rdzv-conf", help="--rdzv-conf for every launcher (default: none)")
    parser.add_argument(
        "--settle",
        type=float,
        default=12.0,
        help="seconds of training before the fault: a job fails in its steady state, when "
        "rdzv run's warm spares (preloaded 10 s after the workers start) are ready",
    )
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--logs", type=Path, help="keep each run's agent logs under this directory")
    args = parser.parse_args()
    try:
        faults = names(args.faults, FAULTS, "faults")
        launchers = [LAUNCHERS[k] for k in names(args.launchers, tuple(LAUNCHERS), "launchers")]
    except ValueError as exc:
        parser.error(str(exc))
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    hang = args.hang_timeout if hang_option_supported() else None
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix="recovery-", dir=args.logs))
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="recovery-")))
        bed = stack.enter_context(netns_bed()) if "link-cut" in faults else None
        settings = Settings(
            args.nproc,
            args.timeout,
            args.step_interval,
            hang,
            args.step_expiry,
            args.rdzv_conf,
            tmp,
            args.settle,
        )
        print(f"rdzv run --hang-timeout: {'supported' if hang else 'not supported'}")
        stamp("start")
        for rep in range(1, args.reps + 1):
            for fault in faults:
                for launcher in launchers:
                    results.append(run_one(launcher, fault, rep, settings, bed))
                    print(describe(results[-1]), flush=True)
        stamp("end")
    title = (
        f"{NODES} agents x {args.nproc} worker(s), --nnodes 2:3 --max-restarts 3, c10d, "
        f"{args.reps} rep(s), timeout {args.timeout:g} s; seconds from the fault to every "
        "rank's first step after it"
    )
    report(results, title, args.timeout, LAUNCHERS["rdzv"].title)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
