"""``rdzv run``: torchrun's options turned into a rendezvous and an elastic agent.

The options and their ``PET_*`` variables are torchrun's
(:mod:`rdzv.launch.options`), so a torchrun command line works after
replacing ``torchrun`` with ``rdzv run``. The rendezvous is chosen as
torchrun chooses it:

* ``--standalone``, or no ``--rdzv-endpoint``, no ``--master-port`` and one
  node: a static rendezvous of one node on a free loopback port with a
  fresh run id;
* ``--rdzv-backend static``, or no backend and no ``--rdzv-endpoint``:
  torchrun's static rendezvous at ``--rdzv-endpoint`` or else
  ``--master-addr:--master-port`` (127.0.0.1:29500), node ``--node-rank``;
* any other backend (``c10d`` when none is given with an endpoint) at
  ``--rdzv-endpoint``.

Options that cannot apply are accepted with a one-line notice saying why;
an ``--rdzv-conf`` key the backend does not read gets a warning naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from rdzv.api import RendezvousHandler, RendezvousInfo, RendezvousParameters, RendezvousSettings
from rdzv.backends.options import EtcdOptions, RedisOptions, StoreBackendOptions
from rdzv.dynamic.admission_options import ADMISSION_KEYS
from rdzv.endpoint import format_endpoint, parse_config, parse_endpoint
from rdzv.errors import RendezvousConnectionError, RendezvousError, explained
from rdzv.launch.agent import ElasticAgent
from rdzv.launch.config import EXIT_RENDEZVOUS, AgentConfig, AgentResult
from rdzv.launch.metrics import agent_metrics
from rdzv.launch.nproc import local_world_size
from rdzv.launch.options import (
    LOG_LEVELS,
    BadEnvironment,
    RunOptionsError,
    add_run_arguments,
    admission_conf,
    check_seconds,
    from_environment,
    given,
    parse_hang_timeout,
    parse_health_options,
    parse_local_ranks_filter,
    parse_nnodes,
    parse_signals,
)
from rdzv.launch.progress import EventListener
from rdzv.launch.ranks import visible_device
from rdzv.launch.slurm import slurm_settings
from rdzv.launch.warm import check_module_names
from rdzv.launch.workers import OutputSink, StdChoice, agent_line
from rdzv.metrics import MetricsServer
from rdzv.net import advertised_address
from rdzv.registry import BACKEND_FACTORIES, create_handler

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DEFAULT_STOP_GRACE",
    "EXIT_USAGE",
    "LOG_LEVELS",
    "RunOptionsError",
    "add_run_arguments",
    "known_conf_keys",
    "parse_nnodes",
    "run_command",
]

EXIT_USAGE = 2

#: torchrun's ``--master-port`` default.
DEFAULT_MASTER_PORT = 29500

#: rdzv's default grace period between the stop signal and SIGKILL (torchrun's is 30 s).
DEFAULT_STOP_GRACE = 10.0

# ``--run-path``: the script runs through runpy.run_path in a new interpreter.
_RUN_PATH = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)

# The keys of the options class that parses a built-in backend factory's settings.
_FACTORY_KEYS = {
    "rdzv.backends.store:create_backend": StoreBackendOptions.KEYS,
    "rdzv.backends.etcd:create_backend": EtcdOptions.KEYS,
    "rdzv.backends.redis:create_backend": RedisOptions.KEYS,
}


LAUNCH_CONF_KEYS: frozenset[str] = frozenset({"listen_all"})
"""The ``--rdzv-conf`` keys the launcher itself reads, whatever the backend:
``listen_all`` (the workers' bootstrap store listens on every address)."""


def _listen_all(args: argparse.Namespace) -> bool:
    """Read ``--rdzv-conf listen_all`` (false when absent).

    Raises:
        RunOptionsError: The value is not a boolean.
    """
    try:
        value = parse_config(args.rdzv_conf).get("listen_all")
    except ValueError:
        return False  # reported where the handler is built
    if value is None:
        return False
    params = RendezvousParameters("launch", "", "launch", 1, 1, listen_all=value)
    try:
        return bool(params.get_as_bool("listen_all"))
    except ValueError as exc:
        raise RunOptionsError(f"--rdzv-conf {args.rdzv_conf!r}: {exc}") from None


def known_conf_keys(backend: str) -> frozenset[str] | None:
    """Return the ``--rdzv-conf`` keys a built-in dynamic backend reads.

    Args:
        backend: The backend name (``c10d``, ``etcd``, ``redis``, an alias).

    Returns:
        The backend's own keys and the rendezvous settings every dynamic
        backend reads, or None for a backend whose keys rdzv does not know
        (a plugin's, or the static rendezvous).
    """
    keys = _FACTORY_KEYS.get(BACKEND_FACTORIES.get(backend, ""))
    return (
        None if keys is None else keys | RendezvousSettings.KEYS | LAUNCH_CONF_KEYS | ADMISSION_KEYS
    )


class _Notices:
    """One-line messages printed before the agent starts."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def notice(self, option: str, why: str) -> None:
        self.lines.append(f"notice: {option}: {why}")

    def warning(self, text: str) -> None:
        self.lines.append(f"warning: {text}")

    def write(self, sink: OutputSink) -> None:
        for line in self.lines:
            sink.write_line(agent_line(line), to_stderr=True)
        self.lines.clear()


def _check_environment(args: argparse.Namespace) -> None:
    for value in vars(args).values():
        if isinstance(value, BadEnvironment):
            raise RunOptionsError(str(value))


def _stop_grace(args: argparse.Namespace) -> float:
    if args.stop_grace is not None:
        grace: float = args.stop_grace
        option = f"--stop-grace {grace:g}"
    elif args.shutdown_timeout is not None:
        grace = float(args.shutdown_timeout)
        option = f"--shutdown-timeout {args.shutdown_timeout}"
    elif os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        text = os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
        option = f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={text!r}"
        try:
            grace = float(text)
        except ValueError:
            raise RunOptionsError(f"{option} is not a number of seconds") from None
    else:
        return DEFAULT_STOP_GRACE
    return check_seconds(option, grace)


def _entrypoint(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """Return the worker's command after the interpreter, and the interpreter (None: none)."""
    script: str = args.training_script
    python = os.environ.get("PYTHON_EXEC") or sys.executable
    if args.run_path:
        if not Path(script).is_file():
            raise RunOptionsError(f"--run-path: the worker script {script!r} does not exist")
        return ["-c", _RUN_PATH, script, *args.training_script_args], python
    if args.no_python:
        if args.module:
            raise RunOptionsError("--no-python and -m/--module cannot be used together")
        if shutil.which(script) is None:
            raise RunOptionsError(
                f"--no-python: the worker command {script!r} is not an executable file "
                "or a command on PATH"
            )
        return [script, *args.training_script_args], None
    if args.module:
        return ["-m", script, *args.training_script_args], python
    if not Path(script).is_file():
        raise RunOptionsError(f"the worker script {script!r} does not exist")
    return [script, *args.training_script_args], python


def _std_choice(text: str, option: str) -> StdChoice:
    try:
        return StdChoice.parse(text)
    except ValueError as exc:
        raise RunOptionsError(f"{option} {exc}") from None


def _agent_config(args: argparse.Namespace, nproc: int, notes: _Notices) -> AgentConfig:
    entrypoint, python = _entrypoint(args)
    if args.max_restarts < 0:
        raise RunOptionsError(f"--max-restarts {args.max_restarts} must be non-negative")
    check_seconds(f"--monitor-interval {args.monitor_interval:g}", args.monitor_interval, True)
    if not args.role:
        raise RunOptionsError("--role must be a non-empty name")
    if args.reform_grace is not None:
        check_seconds(f"--reform-grace {args.reform_grace:g}", args.reform_grace)
    redirects = _std_choice(args.redirects, "-r/--redirects")
    tee = _std_choice(args.tee, "-t/--tee")
    filters = parse_local_ranks_filter(args.local_ranks_filter)
    stdout_filters = [f for f in args.duplicate_stdout_filters if f]
    stderr_filters = [f for f in args.duplicate_stderr_filters if f]
    signals = parse_signals(args.signals_to_handle)
    health_check, health_check_timeout, exclusion = parse_health_options(args)
    warm_preload = [name.strip() for name in args.warm_preload if name.strip()]
    try:
        check_module_names(warm_preload)
    except ValueError as exc:
        raise RunOptionsError(f"--warm-preload: {exc}") from None
    if args.virtual_local_rank:
        try:
            visible_device(os.environ, nproc - 1)
        except ValueError as exc:
            raise RunOptionsError(f"--virtual-local-rank with {nproc} workers: {exc}") from None
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir is None and (redirects or tee or stdout_filters or stderr_filters):
        log_dir = Path(tempfile.mkdtemp(prefix="rdzv-logs-"))
        notes.notice(
            "-r/-t/--duplicate-*-filters without --log-dir", f"the worker log files go to {log_dir}"
        )
    return AgentConfig(
        entrypoint=entrypoint,
        nproc_per_node=nproc,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        role=args.role,
        log_dir=log_dir,
        local_addr="127.0.0.1" if _standalone(args) else _advertised_addr(args),
        listen_all=_listen_all(args),
        stop_grace=_stop_grace(args),
        python=python,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=filters,
        duplicate_stdout_filters=stdout_filters,
        duplicate_stderr_filters=stderr_filters,
        log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        signals=signals,
        virtual_local_rank=args.virtual_local_rank,
        reform_grace=args.reform_grace,
        hang_timeout=parse_hang_timeout(args.hang_timeout),
        warm_restart=not args.no_warm_restart,
        warm_preload=warm_preload,
        health_check=health_check,
        health_check_timeout=health_check_timeout,
        exclusion=exclusion,
    )


def _advertised_addr(args: argparse.Namespace) -> str | None:
    """Return the address this node publishes: ``--local-addr``, else the one facing the endpoint."""
    if args.local_addr:
        return str(args.local_addr)
    if not args.rdzv_endpoint:
        return None
    return advertised_address(args.rdzv_endpoint)


def _standalone(args: argparse.Namespace) -> bool:
    """Tell whether the job is one node on a private store, as torchrun decides."""
    if args.standalone:
        return True
    implicit = args.rdzv_backend in (None, "static")
    _, max_nodes = parse_nnodes(args.nnodes)
    return implicit and not args.rdzv_endpoint and args.master_port is None and max_nodes == 1


def _compatibility_notices(args: argparse.Namespace, notes: _Notices) -> None:
    if args.start_method != "spawn":
        notes.notice(
            f"--start-method {args.start_method}",
            "ignored; every worker is a new process running the command (torchrun too "
            "uses the start method only for --run-path)",
        )
    if args.event_log_handler != "null":
        notes.notice(
            f"--event-log-handler {args.event_log_handler}",
            "ignored; rdzv run does not call torch's elastic event handlers (its own "
            "events are the rdzv loggers' records: --log-level INFO)",
        )
    if args.logs_specs is not None:
        notes.notice(
            f"--logs-specs {args.logs_specs}",
            "ignored; rdzv run does not load torch's LogsSpecs plugins and writes its own "
            "log files (--log-dir, -r/--redirects, -t/--tee)",
        )
    if args.numa_binding is not None:
        notes.notice(
            f"--numa-binding {args.numa_binding}",
            "ignored; rdzv run does not bind workers to CPUs (start the worker under "
            "numactl with --no-python to bind it)",
        )


def _check_conf_keys(backend: str, config: dict[str, str], notes: _Notices) -> None:
    known = known_conf_keys(backend)
    if known is None:
        return
    for key in sorted(set(config) - known):
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        notes.warning(
            f"--rdzv-conf key {key!r} is not a setting of the {backend!r} backend and is "
            f"ignored{hint} (known: {', '.join(sorted(known))})"
        )


def _build_handler(args: argparse.Namespace, nproc: int, notes: _Notices) -> RendezvousHandler:
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    if args.node_rank < 0:
        raise RunOptionsError(f"--node-rank {args.node_rank} must be non-negative")
    master_given = args.master_addr is not None or args.master_port is not None
    if _standalone(args):
        if (min_nodes, max_nodes) != (1, 1):
            raise RunOptionsError(f"--standalone runs one node; --nnodes {args.nnodes} asks more")
        if master_given:
            notes.notice("--master-addr/--master-port", "ignored; one node needs no master")
        from rdzv.static import StaticTCPRendezvous  # noqa: PLC0415 - needs the TCP store

        return StaticTCPRendezvous(
            "127.0.0.1", master_port=0, rank=0, world_size=1, run_id=str(uuid.uuid4())
        )
    backend = args.rdzv_backend
    endpoint = args.rdzv_endpoint
    if backend is None:
        backend = "c10d" if endpoint else "static"
    if backend == "static" and not endpoint:
        host = (args.master_addr or "127.0.0.1").strip("[]")
        endpoint = format_endpoint(host, args.master_port or DEFAULT_MASTER_PORT)
    elif master_given:
        notes.notice(
            "--master-addr/--master-port",
            "ignored; only the static rendezvous without --rdzv-endpoint uses them",
        )
    if not endpoint:
        raise RunOptionsError(
            f"--rdzv-endpoint is required with --rdzv-backend {backend} "
            "(e.g. --rdzv-endpoint host:29400)"
        )
    try:
        config = parse_config(args.rdzv_conf)
    except ValueError as exc:
        raise RunOptionsError(f"--rdzv-conf {args.rdzv_conf!r}: {exc}") from None
    try:
        config = admission_conf(args, config)
    except ValueError as exc:
        raise RunOptionsError(str(exc)) from None
    _check_conf_keys(backend, config, notes)
    try:
        params = RendezvousParameters(
            backend,
            endpoint,
            args.rdzv_id,
            min_nodes,
            max_nodes,
            local_addr=_advertised_addr(args),
            node_rank=args.node_rank,
            local_world_size=nproc,
            config=config,
        )
        return create_handler(params)
    except ValueError as exc:
        raise RunOptionsError(explained(exc)) from None


_PROBE_TIMEOUT = 2.0


def _endpoint_hint(args: argparse.Namespace) -> str:
    """Say what listens at a store endpoint that could not be used ("" when unknown).

    A TCP connection that is accepted means some program holds the port; one
    that is refused means nothing listens there.
    """
    backend = args.rdzv_backend or "c10d"
    if BACKEND_FACTORIES.get(backend) != "rdzv.backends.store:create_backend":
        return ""
    try:
        host, port = parse_endpoint(args.rdzv_endpoint)
    except ValueError:
        return ""
    where = format_endpoint(host, port)
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT):
            pass
    except ConnectionRefusedError:
        return f" (nothing listens at {where}: is the store's host up, and the port right?)"
    except OSError:
        return ""
    return (
        f" (a program accepts connections at {where} but did not answer as an rdzv or "
        "torch TCP store: is the port used by another program?)"
    )


def _apply_slurm(args: argparse.Namespace, notes: _Notices) -> None:
    """Fill ``--nnodes``, ``--node-rank``, ``--rdzv-id``, ``--rdzv-endpoint`` from SLURM_*.

    Only options given neither on the command line nor as ``PET_*`` are
    filled; ``--standalone`` and ``--no-slurm`` turn it off, and
    ``--master-addr``/``--master-port`` keep the endpoint from being filled.
    """
    if args.no_slurm or args.standalone:
        return
    try:
        found = slurm_settings(os.environ)
    except ValueError as exc:
        raise RunOptionsError(f"{exc} (--no-slurm ignores SLURM_*)") from None
    explicit = given(args)
    taken = []
    for dest, (value, variable) in found.items():
        if dest in explicit or from_environment(dest):
            continue
        if dest == "rdzv_endpoint" and (args.master_addr or args.master_port is not None):
            continue
        setattr(args, dest, int(value) if dest == "node_rank" else value)
        taken.append(f"--{dest.replace('_', '-')} {value} ({variable})")
    if taken:
        notes.notice(
            "SLURM",
            f"{', '.join(taken)}; options on the command line and PET_* variables win, "
            "--no-slurm ignores SLURM_*",
        )


def _ready_file(args: argparse.Namespace) -> Path | None:
    """Return the readiness file, removing a stale one; None without ``--ready-file``."""
    if not args.ready_file:
        return None
    path = Path(args.ready_file)
    if not path.parent.is_dir():
        raise RunOptionsError(f"--ready-file {args.ready_file!r}: {path.parent} is not a directory")
    if path.is_dir():
        raise RunOptionsError(f"--ready-file {args.ready_file!r} is a directory")
    path.unlink(missing_ok=True)
    return path


def _ready_writer(path: Path, run_id: str, sink: OutputSink) -> Callable[[RendezvousInfo], None]:
    """Return the callback that (re)writes the readiness file after each round."""

    def write(info: RendezvousInfo) -> None:
        record = {
            "run_id": run_id,
            "group_rank": info.rank,
            "group_world_size": info.world_size,
            "time": time.time(),
        }
        partial = path.with_name(f".{path.name}.partial")
        try:
            partial.write_text(json.dumps(record) + "\n")
            os.replace(partial, path)
        except OSError as exc:
            line = f"could not write the readiness file {path}: {exc.strerror or exc}"
            sink.write_line(agent_line(line), to_stderr=True)

    return write


class _SinkLogHandler(logging.Handler):
    """Writes log records as time-stamped agent lines through the output sink."""

    def __init__(self, sink: OutputSink, level: str) -> None:
        super().__init__(level)
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{record.levelname} {record.name}: {record.getMessage()}"
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self._sink.write_line(agent_line(text, record.created), to_stderr=True)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


@contextlib.contextmanager
def _rdzv_logs_to(sink: OutputSink, level: str) -> Iterator[None]:
    """Print the ``rdzv`` loggers' records of ``level`` and above through ``sink``.

    The rendezvous events (INFO records of ``rdzv.dynamic``) are enabled
    whatever the level: the agent's progress lines are made from them.
    """
    logger = logging.getLogger("rdzv")
    events = logging.getLogger(EventListener.LOGGER)
    handler = _SinkLogHandler(sink, level)
    previous = logger.level, events.level
    logger.addHandler(handler)
    logger.setLevel(min(logger.getEffectiveLevel(), handler.level))
    events.setLevel(min(events.getEffectiveLevel(), logging.INFO))
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        events.setLevel(previous[1])


def run_command(args: argparse.Namespace) -> int:
    """Run ``rdzv run`` with parsed arguments.

    Prints one line saying how the run ended on stderr.

    Args:
        args: The namespace produced by a parser set up with
            :func:`add_run_arguments`.

    Returns:
        The exit status: 0 success (or a spare leaving), 1 a worker failed
        and restarts are spent, 2 bad options, 3 the rendezvous failed,
        128+N interrupted by signal N.
    """
    sink = OutputSink()
    notes = _Notices()
    try:
        _check_environment(args)
        _apply_slurm(args, notes)
        ready_file = _ready_file(args)
        nproc = local_world_size(args.nproc_per_node)
        config = _agent_config(args, nproc, notes)
        _compatibility_notices(args, notes)
        handler = _build_handler(args, nproc, notes)
    except RunOptionsError as exc:
        notes.write(sink)
        print(f"rdzv run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RendezvousError as exc:
        notes.write(sink)
        hint = _endpoint_hint(args) if isinstance(exc, RendezvousConnectionError) else ""
        print(
            f"rdzv run: cannot set up the rendezvous: {type(exc).__name__}: {exc}{hint}",
            file=sys.stderr,
        )
        return EXIT_RENDEZVOUS
    notes.write(sink)
    on_round = None if ready_file is None else _ready_writer(ready_file, handler.get_run_id(), sink)
    agent = ElasticAgent(handler, config, sink=sink, on_round=on_round)
    with contextlib.ExitStack() as stack:
        if ready_file is not None:
            stack.callback(ready_file.unlink, missing_ok=True)
        if args.metrics_port is not None:
            try:
                metrics = MetricsServer(
                    agent_metrics(agent.stats, handler, config.max_restarts),
                    args.metrics_host,
                    args.metrics_port,
                )
            except (OSError, OverflowError) as exc:
                where = format_endpoint(args.metrics_host, args.metrics_port)
                print(
                    f"rdzv run: error: --metrics-port: cannot listen on {where}: "
                    f"{getattr(exc, 'strerror', None) or exc}",
                    file=sys.stderr,
                )
                return EXIT_USAGE
            stack.callback(metrics.close)
            shown = format_endpoint(metrics.host, metrics.port)
            sink.write_line(agent_line(f"metrics at http://{shown}/metrics"), to_stderr=True)
        with _rdzv_logs_to(sink, args.log_level):
            result: AgentResult = agent.run()
    sink.write_line(agent_line(result.reason), to_stderr=True)
    return result.exit_code
