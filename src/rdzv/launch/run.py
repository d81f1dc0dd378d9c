"""``rdzv run``: the command-line options and how they become an agent.

The option names are torchrun's (both ``--dash-names`` and
``--underscore_names`` are accepted), so a torchrun command line works after
replacing ``torchrun`` with ``rdzv run``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from rdzv.api import RendezvousHandler, RendezvousParameters
from rdzv.endpoint import parse_config
from rdzv.errors import RendezvousError
from rdzv.launch.agent import EXIT_RENDEZVOUS, AgentConfig, AgentResult, ElasticAgent
from rdzv.launch.workers import OutputSink, agent_line
from rdzv.registry import create_handler

__all__ = [
    "EXIT_USAGE",
    "LOG_LEVELS",
    "RunOptionsError",
    "add_run_arguments",
    "parse_nnodes",
    "run_command",
]

EXIT_USAGE = 2

#: The values of ``--log-level``.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class RunOptionsError(ValueError):
    """A ``rdzv run`` option has a bad value; the message names it."""


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parse ``--nnodes``: ``N`` or ``MIN:MAX``.

    Args:
        text: The option value.

    Returns:
        ``(min_nodes, max_nodes)``.

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
    return low, high


def _nproc(text: str) -> int:
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise RunOptionsError(
            f"--nproc-per-node {text!r} is not a positive integer, 'auto' or 'cpu'"
        ) from None
    if value < 1:
        raise RunOptionsError(f"--nproc-per-node {text!r} must be at least 1")
    return value


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rdzv run`` to a parser.

    Args:
        parser: The ``run`` sub-parser.
    """

    def option(name: str, **kwargs: object) -> None:
        names = [f"--{name}"]
        if "-" in name:
            names.append("--" + name.replace("-", "_"))
        parser.add_argument(*names, **kwargs)  # type: ignore[arg-type]  # argparse's kwargs are untyped

    option("nnodes", default="1:1", help="nodes: N, or MIN:MAX for an elastic job (1:1)")
    option("nproc-per-node", default="1", help="workers per node: N, 'auto' or 'cpu' (1)")
    option("rdzv-backend", default="c10d", help="rendezvous backend (c10d)")
    option("rdzv-endpoint", default="", help="rendezvous endpoint, host[:port]")
    option("rdzv-id", default="none", help="run id shared by the job's nodes (none)")
    option("rdzv-conf", default="", help="backend settings, k=v,k2=v2")
    option(
        "standalone",
        action="store_true",
        help="one machine: an embedded store on a free port, a fresh run id",
    )
    option("node-rank", type=int, default=0, help="this node's rank (static backend) (0)")
    option("local-addr", default=None, help="this node's address, published to the others")
    option("max-restarts", type=int, default=0, help="restarts after worker failures (0)")
    option("monitor-interval", type=float, default=0.1, help="seconds between checks (0.1)")
    option("role", default="default", help="role name of this node's workers (default)")
    option("log-dir", default=None, help="directory for one log file per worker per attempt")
    option(
        "stop-grace",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping workers (10)",
    )
    parser.add_argument(
        "--log-level",
        "--log_level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="WARNING",
        metavar="LEVEL",
        help="the least severe message of the rdzv loggers printed on stderr: "
        f"{', '.join(LOG_LEVELS)} (WARNING; INFO shows the rendezvous events)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_const",
        const="INFO",
        dest="log_level",
        help="the same as --log-level INFO",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the entry point as a Python module (python -m)",
    )
    parser.add_argument("training_script", help="the worker script, or module with -m")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)


def _build_handler(args: argparse.Namespace, nproc: int) -> RendezvousHandler:
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    if args.standalone:
        if (min_nodes, max_nodes) != (1, 1):
            raise RunOptionsError(f"--standalone runs one node; --nnodes {args.nnodes} asks more")
        from rdzv.static import StaticTCPRendezvous  # noqa: PLC0415 - needs the TCP store

        return StaticTCPRendezvous(
            "127.0.0.1", master_port=0, rank=0, world_size=1, run_id=str(uuid.uuid4())
        )
    if not args.rdzv_endpoint:
        raise RunOptionsError(
            "--rdzv-endpoint is required without --standalone (e.g. --rdzv-endpoint host:29400)"
        )
    if args.node_rank < 0:
        raise RunOptionsError(f"--node-rank {args.node_rank} must be non-negative")
    try:
        config = parse_config(args.rdzv_conf)
    except ValueError as exc:
        raise RunOptionsError(f"--rdzv-conf {args.rdzv_conf!r}: {exc}") from None
    try:
        params = RendezvousParameters(
            args.rdzv_backend,
            args.rdzv_endpoint,
            args.rdzv_id,
            min_nodes,
            max_nodes,
            local_addr=args.local_addr,
            node_rank=args.node_rank,
            local_world_size=nproc,
            config=config,
        )
        return create_handler(params)
    except ValueError as exc:
        raise RunOptionsError(str(exc)) from None


def _agent_config(args: argparse.Namespace, nproc: int) -> AgentConfig:
    entrypoint = [args.training_script, *args.training_script_args]
    if args.module:
        entrypoint.insert(0, "-m")
    elif not Path(args.training_script).is_file():
        raise RunOptionsError(f"the worker script {args.training_script!r} does not exist")
    if args.max_restarts < 0:
        raise RunOptionsError(f"--max-restarts {args.max_restarts} must be non-negative")
    if not args.monitor_interval > 0:
        raise RunOptionsError(f"--monitor-interval {args.monitor_interval} must be positive")
    if args.stop_grace < 0:
        raise RunOptionsError(f"--stop-grace {args.stop_grace} must be non-negative")
    if not args.role:
        raise RunOptionsError("--role must be a non-empty name")
    local_addr = "127.0.0.1" if args.standalone else args.local_addr
    return AgentConfig(
        entrypoint=entrypoint,
        nproc_per_node=nproc,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        role=args.role,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        local_addr=local_addr,
        stop_grace=args.stop_grace,
    )


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
    """Print the ``rdzv`` loggers' records of ``level`` and above through ``sink``."""
    logger = logging.getLogger("rdzv")
    handler = _SinkLogHandler(sink, level)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(logger.getEffectiveLevel(), handler.level))
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def run_command(args: argparse.Namespace) -> int:
    """Run ``rdzv run`` with parsed arguments.

    Prints one line saying how the run ended (``rdzv run: ...``) on stderr.

    Args:
        args: The namespace produced by a parser set up with
            :func:`add_run_arguments`.

    Returns:
        The exit status: 0 success (or a spare leaving), 1 a worker failed
        and restarts are spent, 2 bad options, 3 the rendezvous failed,
        128+N interrupted by signal N.
    """
    try:
        nproc = _nproc(args.nproc_per_node)
        config = _agent_config(args, nproc)
        handler = _build_handler(args, nproc)
    except RunOptionsError as exc:
        print(f"rdzv run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RendezvousError as exc:
        print(
            f"rdzv run: cannot set up the rendezvous: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return EXIT_RENDEZVOUS
    sink = OutputSink()
    with _rdzv_logs_to(sink, args.log_level):
        result: AgentResult = ElasticAgent(handler, config, sink=sink).run()
    sink.write_line(agent_line(result.reason), to_stderr=True)
    return result.exit_code
