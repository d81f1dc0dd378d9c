"""The options of ``rdzv run``: torchrun's, with torchrun's names and ``PET_*`` variables.

Every option of torchrun 2.13's parser is here under the same names (both
``--dash-names`` and ``--underscore_names``), the same destination, type and
choices, so a torchrun command line parses the same way. Like torchrun, an
option's default comes from the environment variable ``PET_<DEST>`` (how
Kubeflow's PyTorchJob configures torchrun): ``PET_NPROC_PER_NODE=2`` is
``--nproc-per-node 2``, and a flag such as ``--standalone`` is on when
``PET_STANDALONE`` is a non-zero integer. The command line wins over the
environment. ``--stop-grace``, ``--reform-grace``, ``--hang-timeout``,
``--no-warm-restart``, ``--warm-preload``, ``--log-level``, ``--verbose``, the
health options (``--health-check``, ``--health-check-timeout``,
``--exclude-after``, ``--exclude-cooldown``) and the operations options
(``--metrics-port``, ``--ready-file``) are rdzv's own.

The values are checked and turned into a rendezvous and an agent by
:mod:`rdzv.launch.run`; the parsing helpers for values with a format of
their own (``--nnodes``, ``--redirects``, ...) are here;
``--nproc-per-node``'s in :mod:`rdzv.launch.nproc`.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Sequence
from typing import Any

from rdzv.dynamic.state import MAX_PARTICIPANTS
from rdzv.exclusion import MAX_COOLDOWN, ExclusionPolicy
from rdzv.launch.config import (
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_SIGNALS,
    MAX_SECONDS,
    seconds_in_range,
)
from rdzv.launch.ranks import DEFAULT_SIGNALS_TO_HANDLE

__all__ = [
    "LOG_LEVELS",
    "BadEnvironment",
    "EnvDefault",
    "EnvFlag",
    "NUMA_BINDINGS",
    "START_METHODS",
    "RunOptionsError",
    "add_run_arguments",
    "check_seconds",
    "comma_separated_list",
    "from_environment",
    "given",
    "parse_hang_timeout",
    "parse_health_options",
    "parse_local_ranks_filter",
    "parse_nnodes",
    "parse_signals",
]

#: The values of ``--log-level``.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: torchrun's ``--start-method`` choices.
START_METHODS = ("spawn", "fork", "forkserver")

#: torchrun 2.13's ``--numa-binding`` choices (``torch.numa.binding.AffinityMode``).
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")


class RunOptionsError(ValueError):
    """A ``rdzv run`` option has a bad value; the message names it."""


def _env_name(dest: str) -> str:
    return f"PET_{dest.upper()}"


def given(namespace: argparse.Namespace) -> set[str]:
    """Return the live set of the options given on the command line (so far).

    Options with a ``PET_*`` default record themselves in it.
    """
    found: set[str] | None = getattr(namespace, "_given", None)
    if found is None:
        found = set()
        namespace._given = found
    return found


def from_environment(dest: str) -> bool:
    """Tell whether the ``PET_*`` variable of ``dest`` is set."""
    return _env_name(dest) in os.environ


class EnvDefault(argparse.Action):
    """An option whose default comes from ``PET_<DEST>`` (torchrun's ``env`` action).

    Args:
        option_strings: The option's names.
        dest: Its destination; the variable is ``PET_`` + ``dest`` in capitals.
        default: The default when the variable is unset.
        **kwargs: The other ``add_argument`` settings.
    """

    def __init__(
        self, option_strings: Sequence[str], dest: str, default: Any = None, **kwargs: Any
    ) -> None:
        default = os.environ.get(_env_name(dest), default)
        super().__init__(option_strings, dest, default=default, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        """Store the value given on the command line (and remember that it was given)."""
        setattr(namespace, self.dest, values)
        given(namespace).add(self.dest)


class BadEnvironment(str):
    """The default of a flag whose ``PET_*`` variable is not an integer: an error to report."""

    __slots__ = ()


class EnvFlag(argparse._StoreConstAction):
    """A flag that is also on when ``PET_<DEST>`` is a non-zero integer (``check_env``).

    Args:
        option_strings: The flag's names.
        dest: Its destination; the variable is ``PET_`` + ``dest`` in capitals.
        **kwargs: The other ``add_argument`` settings.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        name = _env_name(dest)
        text = os.environ.get(name, "0")
        default: bool | BadEnvironment
        try:
            default = bool(int(text))
        except ValueError:
            # ``rdzv run`` reports it as a bad option; building the parser must
            # not fail, or every other command would fail with it.
            default = BadEnvironment(f"{name}={text!r} is not an integer (0 or 1)")
        super().__init__(option_strings, dest, const=True, default=default, **kwargs)


def comma_separated_list(value: str) -> list[str]:
    """Split torchrun's duplicate filters at commas; ``,,`` is a literal comma."""
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rdzv run`` to a parser."""
    nodes = parser.add_argument_group("nodes and workers")
    rendezvous = parser.add_argument_group("rendezvous")
    workers = parser.add_argument_group("worker processes")
    output = parser.add_argument_group("output and logs")
    accepted = parser.add_argument_group(
        "accepted for torchrun compatibility (rdzv run prints why it does not apply)"
    )

    def grouped(group: argparse._ArgumentGroup) -> Any:
        def add(name: str, *short: str, **kwargs: Any) -> None:
            names = [*short, f"--{name}"]
            if "-" in name:
                names.append("--" + name.replace("-", "_"))
            group.add_argument(*names, **kwargs)

        return add

    node, rdzv, work, out, compat = map(grouped, (nodes, rendezvous, workers, output, accepted))
    node("nnodes", action=EnvDefault, default="1:1", help="nodes: N, or MIN:MAX (1:1)")
    node(
        "nproc-per-node",
        action=EnvDefault,
        default="1",
        help="workers on this node: N, 'cpu' (one per usable CPU), 'gpu' (one per CUDA "
        "device), 'xpu', or 'auto' (one per accelerator, else per CPU) (1)",
    )
    node("node-rank", action=EnvDefault, type=int, default=0, help="this node's rank (0)")
    node("local-addr", action=EnvDefault, help="this node's address, published to the others")
    node("role", action=EnvDefault, default="default", help="the workers' role (default)")
    rdzv(
        "rdzv-backend",
        action=EnvDefault,
        help="rendezvous backend (c10d with --rdzv-endpoint; otherwise torchrun's static "
        "rendezvous at --master-addr:--master-port, or --standalone for one node)",
    )
    rdzv("rdzv-endpoint", action=EnvDefault, default="", help="backend endpoint, host[:port]")
    rdzv("rdzv-id", action=EnvDefault, default="none", help="the job's run id (none)")
    rdzv("rdzv-conf", action=EnvDefault, default="", help="backend settings, k=v,k2=v2")
    rdzv(
        "standalone",
        action=EnvFlag,
        help="one machine: an embedded store on a free port, a fresh run id",
    )
    rdzv(
        "master-addr",
        action=EnvDefault,
        help="the static rendezvous' host (node rank 0) when there is no --rdzv-endpoint "
        "(127.0.0.1; IPv6 as [addr])",
    )
    rdzv(
        "master-port",
        action=EnvDefault,
        type=int,
        help="the static rendezvous' port when there is no --rdzv-endpoint (29500)",
    )
    rdzv(
        "health-check",
        metavar="CMD",
        help="run CMD (/bin/sh -c) before each join; a non-zero exit or a timeout keeps this "
        "node out of the round, and it checks again after a back-off (off; rdzv only)",
    )
    rdzv(
        "health-check-timeout",
        type=float,
        default=DEFAULT_HEALTH_CHECK_TIMEOUT,
        metavar="SECONDS",
        help=f"a health check running longer fails (its process group is killed) "
        f"({DEFAULT_HEALTH_CHECK_TIMEOUT:g}; rdzv only)",
    )
    rdzv(
        "exclude-after",
        type=int,
        default=0,
        metavar="K",
        help="K failures in a row of this node (failed health checks, or attempts in which "
        "its workers failed first) exclude it from the run for a cool-down (0: off; rdzv only)",
    )
    rdzv(
        "exclude-cooldown",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="the first exclusion's length; each next one is twice as long (60; rdzv only)",
    )
    work("max-restarts", action=EnvDefault, type=int, default=0, help="restarts (0)")
    work(
        "monitor-interval",
        action=EnvDefault,
        type=float,
        default=0.1,
        help="seconds between checks (0.1)",
    )
    work("module", "-m", action=EnvFlag, help="run the entry point as a module (python -m)")
    work("no-python", action=EnvFlag, help="run the entry point itself, not with python")
    work(
        "run-path",
        action=EnvFlag,
        help="run the script with runpy.run_path in a new interpreter (wins over "
        "--no-python and -m)",
    )
    work(
        "signals-to-handle",
        action=EnvDefault,
        default=DEFAULT_SIGNALS_TO_HANDLE,
        help="signals that stop the agent and are forwarded to the workers "
        f"({DEFAULT_SIGNALS_TO_HANDLE})",
    )
    work(
        "shutdown-timeout",
        action=EnvDefault,
        type=int,
        help="seconds between the signal and SIGKILL when stopping workers (torchrun's name "
        "of --stop-grace; else $TORCH_ELASTIC_SHUTDOWN_TIMEOUT)",
    )
    work(
        "stop-grace",
        type=float,
        help="seconds between the signal and SIGKILL when stopping workers (10; rdzv only)",
    )
    work(
        "reform-grace",
        type=float,
        metavar="SECONDS",
        help="after a worker failure with no restart left, wait this long for a change of "
        "the group (a node waiting, a member found dead) that makes it a re-form instead "
        "(default: the time to find a dead member; rdzv only)",
    )
    work(
        "hang-timeout",
        type=float,
        metavar="SECONDS",
        help="a worker that called rdzv.progress() and then does not call it for SECONDS is "
        "hung: every worker's Python stacks are written to the log directory and the group "
        "restarts (off; rdzv only)",
    )
    work(
        "no-warm-restart",
        action="store_true",
        help="start every worker as a new process; by default a preloaded spare per local "
        "rank waits for the next attempt (rdzv only)",
    )
    work(
        "warm-preload",
        type=comma_separated_list,
        default=[],
        metavar="MODULES",
        help="modules the spares also import, after the script's leading imports: ones the "
        "worker imports later, e.g. torch._dynamo (comma-separated; rdzv only)",
    )
    work(
        "virtual-local-rank",
        action=EnvFlag,
        help="LOCAL_RANK=0 for every worker; each sees only its device in CUDA_VISIBLE_DEVICES",
    )
    out(
        "log-dir",
        action=EnvDefault,
        help="one log file per worker per attempt: DIR/<run id>/attempt_<k>/rank_<r>.log",
    )
    out(
        "redirects",
        "-r",
        action=EnvDefault,
        default="0",
        help="streams that go only to the log file: 0-3 (none, out, err, both) or "
        "LOCAL_RANK:0-3,... (0)",
    )
    out(
        "tee",
        "-t",
        action=EnvDefault,
        default="0",
        help="streams that go to the log file and the console (same format) (0)",
    )
    out(
        "local-ranks-filter",
        action=EnvDefault,
        default="",
        help="only these local ranks reach the console, e.g. 0,1 (log files keep all)",
    )
    out(
        "duplicate-stdout-filters",
        action=EnvDefault,
        type=comma_separated_list,
        default=[],
        help="copy stdout lines containing one of these to filtered_stdout.log in the log "
        "directory (comma-separated; ,, is a comma)",
    )
    out(
        "duplicate-stderr-filters",
        action=EnvDefault,
        type=comma_separated_list,
        default=[],
        help="the same for stderr (filtered_stderr.log)",
    )
    out(
        "log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="WARNING",
        metavar="LEVEL",
        help=f"the least severe record of the rdzv loggers printed: {', '.join(LOG_LEVELS)} "
        "(WARNING; INFO adds the rendezvous events; rdzv only)",
    )
    out(
        "verbose",
        "-v",
        action="store_const",
        const="INFO",
        dest="log_level",
        help="the same as --log-level INFO (rdzv only)",
    )
    _add_admission_arguments(grouped(parser.add_argument_group("admission (rdzv only)")))
    ops = grouped(parser.add_argument_group("operations (rdzv only)"))
    ops(
        "no-slurm",
        action="store_true",
        help="do not take --nnodes, --node-rank, --rdzv-id and --rdzv-endpoint from SLURM_* "
        "variables (they are used, when set, for the options not given otherwise)",
    )
    ops(
        "ready-file",
        metavar="PATH",
        help="write PATH once the first round completed and the workers started; removed "
        "at exit (a Kubernetes readiness probe: test -e PATH)",
    )
    ops(
        "metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port, "
        "printed at start)",
    )
    ops(
        "metrics-host",
        default="0.0.0.0",  # noqa: S104 - scraped from other machines
        metavar="HOST",
        help="the address the metrics endpoint listens on (0.0.0.0)",
    )
    compat(
        "start-method",
        action=EnvDefault,
        default="spawn",
        choices=START_METHODS,
        help="workers are always new processes running the command",
    )
    compat(
        "event-log-handler",
        action=EnvDefault,
        default="null",
        help="torch's elastic event handlers are not called",
    )
    compat("logs-specs", help="rdzv run writes its own log files (--log-dir, -r, -t)")
    compat("numa-binding", choices=NUMA_BINDINGS, help="workers are not bound to CPUs")
    parser.add_argument("training_script", help="the worker script, module with -m, or command")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)


def _add_admission_arguments(add: Any) -> None:
    """The admission rules' flags: each sets the ``--rdzv-conf`` key of its name."""
    add(
        "target-nodes",
        metavar="N",
        help="seal a round at once when N nodes joined; between the minimum and N wait the "
        "last call ('slurm': $SLURM_NNODES)",
    )
    add("node-multiple", type=int, metavar="K", help="every round's size is a multiple of K")
    add(
        "keep-ranks",
        action="store_true",
        default=None,
        help="members keep their rank across re-formations; a newcomer takes a lost one's",
    )
    add(
        "rank-order-key",
        metavar="VAR",
        help="order ranks by this environment variable's value on each node (a switch, a rack)",
    )
    add(
        "segment-size",
        type=int,
        metavar="S",
        help="a round holds only whole groups of S nodes sharing --rank-order-key's value",
    )


#: The ``--rdzv-conf`` keys the admission flags set.
ADMISSION_FLAGS = ("target_nodes", "node_multiple", "keep_ranks", "rank_order_key", "segment_size")


def admission_conf(args: argparse.Namespace, config: dict[str, str]) -> dict[str, str]:
    """Return ``config`` with the admission flags given set as its keys.

    Raises:
        ValueError: A flag and a ``--rdzv-conf`` key of the same name disagree.
    """
    merged = dict(config)
    for key in ADMISSION_FLAGS:
        value = getattr(args, key, None)
        if value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if key in merged and merged[key] != text:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"{flag} {text} and --rdzv-conf {key}={merged[key]} disagree")
        merged[key] = text
    return merged


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parse ``--nnodes``: ``N`` or ``MIN:MAX``.

    Raises:
        RunOptionsError: The value is not ``N`` or ``MIN:MAX`` with
            ``1 <= MIN <= MAX``.
    """
    parts = text.split(":")
    if len(parts) not in (1, 2):
        raise RunOptionsError(f"--nnodes {text!r} is not N or MIN:MAX")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise RunOptionsError(f"--nnodes {text!r} is not N or MIN:MAX (integers)") from None
    low, high = numbers[0], numbers[-1]
    if low < 1 or high < low:
        raise RunOptionsError(f"--nnodes {text!r} needs 1 <= MIN <= MAX")
    if high > MAX_PARTICIPANTS:
        raise RunOptionsError(
            f"--nnodes {text!r} asks for more than {MAX_PARTICIPANTS:,} nodes, "
            "the most a round holds"
        )
    return low, high


def check_seconds(option: str, value: float, positive: bool = False) -> float:
    """Check a duration: positive (or non-negative), finite, at most :data:`MAX_SECONDS`.

    Args:
        option: The option and its value as the message names them
            (``--stop-grace -1``).
        value: The seconds.
        positive: Refuse 0 too.

    Raises:
        RunOptionsError: The value is out of range, infinite or not a number.
    """
    if seconds_in_range(value, positive):
        return value
    kind = "positive" if positive else "non-negative"
    raise RunOptionsError(f"{option} must be {kind}: a number of seconds up to {MAX_SECONDS:,.0f}")


def parse_hang_timeout(value: float | None) -> float | None:
    """Check ``--hang-timeout``: None (off) or a positive, finite number of seconds.

    Raises:
        RunOptionsError: The value is zero, negative, not a number, or over
            :data:`MAX_SECONDS`.
    """
    if value is not None:
        check_seconds(f"--hang-timeout {value:g}", value, positive=True)
    return value


def parse_health_options(args: argparse.Namespace) -> tuple[str | None, float, ExclusionPolicy]:
    """Check the health options: the command (None: none), its timeout, the exclusion policy.

    Raises:
        RunOptionsError: An empty command, a timeout or cool-down that is not
            a positive number of seconds, or a negative ``--exclude-after``.
    """
    command = args.health_check
    if command is not None and not command.strip():
        raise RunOptionsError("--health-check is empty; give a command, e.g. 'nvidia-smi -L'")
    timeout = args.health_check_timeout
    if not 0 < timeout < float("inf"):
        raise RunOptionsError(f"--health-check-timeout {timeout:g} must be positive seconds")
    if args.exclude_after < 0:
        raise RunOptionsError(f"--exclude-after {args.exclude_after} must be 0 (off) or more")
    if not 0 < args.exclude_cooldown <= MAX_COOLDOWN:
        raise RunOptionsError(
            f"--exclude-cooldown {args.exclude_cooldown:g} must be positive seconds up to "
            f"{MAX_COOLDOWN:g}"
        )
    return command, timeout, ExclusionPolicy(args.exclude_after, args.exclude_cooldown)


def parse_local_ranks_filter(text: str) -> frozenset[int] | None:
    """Parse ``--local-ranks-filter``: comma-separated local ranks, or empty (None) for all.

    Raises:
        RunOptionsError: Not a comma-separated list of non-negative integers.
    """
    if not text.strip():
        return None
    try:
        ranks = frozenset(int(part) for part in text.split(","))
    except ValueError:
        ranks = frozenset({-1})
    if any(rank < 0 for rank in ranks):
        raise RunOptionsError(
            f"--local-ranks-filter {text!r} is not a comma-separated list of local ranks "
            "(e.g. 0,1,2)"
        )
    return ranks


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """Parse ``--signals-to-handle``: comma-separated signal names, kept in order without repeats.

    Raises:
        RunOptionsError: A name is not a signal, or names one that cannot be
            handled (SIGKILL, SIGSTOP), or the list is empty.
    """
    found: list[signal.Signals] = []
    for part in text.split(","):
        name = part.strip()
        if not name:
            continue
        member = signal.Signals.__members__.get(name)
        if member is None or member in (signal.SIGKILL, signal.SIGSTOP):
            raise RunOptionsError(
                f"--signals-to-handle {text!r}: {name!r} is not a signal that can be handled"
            )
        if member not in found:
            found.append(member)
    if not found:
        raise RunOptionsError(
            f"--signals-to-handle {text!r} names no signal (default: "
            f"{','.join(s.name for s in DEFAULT_SIGNALS)})"
        )
    return tuple(found)
