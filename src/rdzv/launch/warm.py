"""Warm restarts: a preloaded process per local rank, waiting to become the next attempt's worker.

Theory of operation. Right after the workers of an attempt start, the agent
starts one *spare* per local rank for the next attempt: a process started
exactly as a cold worker is (:func:`~rdzv.launch.workers.start_process`: the
same command line ``python -u script.py args``, pipes, session and
``PR_SET_PDEATHSIG``), with the directory ``warm_site`` beside this module
in front of ``PYTHONPATH``. Its ``sitecustomize`` runs inside ``site``,
before Python runs the script. :data:`PRELOAD_DELAY` seconds later (or at
once when a spare is needed sooner) the agent sends it the plan: the
script's leading import statements (``import torch`` and the like, up to the
first other statement; a module of the script's own directory ends them),
then the ``--warm-preload`` modules. The spare imports them and blocks. When
the next attempt starts a worker, the agent hands its local rank's spare the
attempt's environment and working directory ("go"); the spare puts them in
place and returns, and Python carries on exactly as it would for a cold
start, having saved the interpreter's start and the imports. A spare that
is not used is SIGKILLed with its process group, by pid.

Messages are JSON objects, one per line, over two pipes (never pickle):
agent -> spare the plan (the real ``PYTHONPATH``, the script's
``sys.path[0]`` and ``__file__``, the statements, the extra modules), spare
-> agent "ready" (the variables read during the preload, whether the
environment was listed, the files and mtimes of the modules imported), agent
-> spare "go" (env, cwd), spare -> agent "went".

The environment. A spare starts with the environment its local rank's
worker has now, with ``TORCHELASTIC_RESTART_COUNT`` one higher (the next
attempt after a failure) and ``MASTER_PORT`` 0 (the next attempt's store does
not exist yet, and a spare must never reach the running attempt's). At "go"
the environment becomes the attempt's, with the changes the preload itself
made. A spare is used only when the two differ in no variable but the
per-attempt ones of :data:`ATTEMPT_KEYS` and Python code read none of those
that differ during the preload (nor listed the environment). Native
libraries read variables with ``getenv`` unseen: torch 2.13's read none of
:data:`ATTEMPT_KEYS` while ``import torch`` runs
(``benchmarks/warm_getenv.py`` traces them), and Python's start-up reads
only ``PYTHON*`` variables, which must be equal. Until the spare's
``sitecustomize`` runs, ``PYTHONPATH`` has ``warm_site`` in front and
``RDZV_WARM_FDS`` is set: code in ``.pth`` files sees them.

Anything else makes a cold start of that worker, silently (an INFO record of
this module's logger says why): no spare, a spare that exited or was not
ready in time, another command line or working directory, a changed script
(its text is compared) or a changed file of a preloaded module, an
interpreter that is not an executable binary (a wrapper script could pass
options that skip ``site``), interpreter options in the entry point,
``--no-python``.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import threading
import time
import tokenize
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rdzv.launch.workers import WorkerSpec, signal_group, start_process
from rdzv.threads import start_thread
from rdzv.worker import PROGRESS_DIR_VARIABLE

__all__ = [
    "ATTEMPT_KEYS",
    "PRELOAD_DELAY",
    "Plan",
    "Step",
    "WarmSpares",
    "check_module_names",
    "plan_for",
    "predicted_env",
]

_LOG = logging.getLogger(__name__)

#: The variables that may differ between a spare's environment and the
#: attempt's: the launcher's per-attempt ones, read by torch when the process
#: group starts and by :func:`rdzv.progress` at its first call, not on import.
ATTEMPT_KEYS = frozenset(
    {
        PROGRESS_DIR_VARIABLE,
        "RANK",
        "WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_ERROR_FILE",
    }
)

#: Seconds after an attempt's workers start before the spares import
#: anything, so that the imports do not slow the workers' own start.
PRELOAD_DELAY = 10.0

_SITE_DIR = str(Path(__file__).resolve().with_name("warm_site"))
_FDS_VARIABLE = "RDZV_WARM_FDS"
_READY_TIMEOUT = 60.0
_WENT_TIMEOUT = 10.0
_MESSAGE_LIMIT = 64 << 20
_SCRIPT_LIMIT = 16 << 20


@dataclass(frozen=True)
class Step:
    """One import statement a spare runs ahead of "go".

    Args:
        code: The statement's text, after blank lines that put it on its
            line of the file.
        filename: The file name its code has (as Python compiles the file).
        module: The module whose code it is (``__main__`` for the script).
        tops: The top-level modules it imports (a spare stops before a
            statement whose module comes from the script's directory).
    """

    code: str
    filename: str
    module: str
    tops: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """What a spare of an entry point preloads.

    Args:
        path0: The worker's ``sys.path[0]`` (None: nothing is preloaded).
        main_file: The script's ``__file__`` when the statements are the
            script's (they then run in ``__main__``), else None.
        steps: The statements, in order.
        digests: SHA-256 of every file read to make the plan, by path.
        extra: Modules imported after the statements (``--warm-preload``).
    """

    path0: str | None = None
    main_file: str | None = None
    steps: tuple[Step, ...] = ()
    digests: tuple[tuple[str, str], ...] = ()
    extra: tuple[str, ...] = ()


def _docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _tops(node: ast.stmt) -> tuple[str, ...] | None:
    """The top-level modules an absolute import statement imports; None for anything else."""
    if isinstance(node, ast.Import):
        return tuple(alias.name.partition(".")[0] for alias in node.names)
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module == "__future__":
            return ()
        return (node.module.partition(".")[0],)
    return None


def _leading_steps(data: bytes, filename: str, module: str) -> tuple[list[Step], bool]:
    """The leading import statements of a file, and whether they are its whole body.

    The docstring comes along (it sets ``__doc__`` as the file would);
    ``from __future__`` statements are left out (they only steer the compiler).
    """
    try:
        encoding, _ = tokenize.detect_encoding(iter(data.splitlines(keepends=True)).__next__)
        text = data.decode(encoding)
        tree = ast.parse(text, filename)
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, LookupError):
        return [], False
    steps: list[Step] = []
    for index, node in enumerate(tree.body):
        tops = () if index == 0 and _docstring(node) else _tops(node)
        if tops is None:
            return steps, False
        segment = ast.get_source_segment(text, node)
        if segment is None:
            return steps, False
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        steps.append(Step("\n" * (node.lineno - 1) + segment, filename, module, tops))
    return steps, True


def _read(path: Path) -> bytes | None:
    try:
        if not path.is_file() or path.stat().st_size > _SCRIPT_LIMIT or zipfile.is_zipfile(path):
            return None
        return path.read_bytes()
    except OSError:
        return None


def _module_chain(name: str, cwd: str) -> list[tuple[Path, str]] | None:
    """The files ``python -m name`` runs, in order, when ``name`` lives in ``cwd``.

    Each package's ``__init__.py`` under its name, then the module (or the
    package's ``__main__.py``) as ``__main__``. None when the module is not
    plainly there (not in ``cwd``, or an extension or compiled file beside it).
    """
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    chain: list[tuple[Path, str]] = []
    base = Path(cwd)
    for index, part in enumerate(parts):
        init = base / part / "__init__.py"
        if init.is_file():
            chain.append((init, ".".join(parts[: index + 1])))
            base = base / part
            continue
        others = [p for p in base.glob(f"{part}.*") if p.name != f"{part}.py"]
        if index == len(parts) - 1 and (base / f"{part}.py").is_file() and not others:
            return [*chain, (base / f"{part}.py", "__main__")]
        return None
    main = base / "__main__.py"
    return [*chain, (main, "__main__")] if main.is_file() else None


def plan_for(entrypoint: Sequence[str], cwd: str, extra: Sequence[str] = ()) -> Plan | None:
    """Decide what a spare of ``python -u *entrypoint`` preloads, run in ``cwd``.

    A script: its leading imports, with ``sys.path[0]`` its real directory.
    ``-m name``: the leading imports of the files it runs from ``cwd``, one
    file after the other while a file has nothing else. ``-c``, or a file
    that is not Python source: no statements (the spare still saves the
    interpreter's start). Then the modules ``extra``.

    Returns:
        The plan, or None when a spare cannot run the entry point exactly
        (interpreter options before the script, which could skip ``site``).
    """
    if not entrypoint:
        return None
    first = entrypoint[0]
    if first == "-c":
        return Plan("", extra=tuple(extra)) if extra else Plan()
    if first == "-m":
        chain = _module_chain(entrypoint[1], cwd) if len(entrypoint) > 1 else None
        path0, main_file = cwd, None
    elif first.startswith("-"):
        return None
    else:
        path = Path(cwd, first)
        chain = [(path, "__main__")]
        path0, main_file = os.path.dirname(os.path.realpath(path)), os.path.join(cwd, first)
    steps: list[Step] = []
    digests: list[tuple[str, str]] = []
    for file, module in chain or ():
        data = _read(file)
        if data is None:
            break
        digests.append((str(file), hashlib.sha256(data).hexdigest()))
        filename = main_file if main_file is not None else str(file)
        found, whole = _leading_steps(data, filename, module)
        steps.extend(found)
        if not whole:
            break
    if not steps and not extra:
        return Plan(digests=tuple(digests))
    return Plan(path0, main_file, tuple(steps), tuple(digests), tuple(extra))


def check_module_names(names: Sequence[str]) -> None:
    """Check that every name is a dotted module name (``torch._dynamo``).

    Raises:
        ValueError: One is not; the message names it.
    """
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"{name!r} is not a module name (e.g. torch._dynamo)")


def predicted_env(env: Mapping[str, str]) -> dict[str, str]:
    """Return the environment a spare starts with: the next attempt's, as far as it is known.

    ``TORCHELASTIC_RESTART_COUNT`` one higher while restarts are left;
    ``MASTER_PORT`` 0 (unknown until the next attempt's store starts).
    """
    predicted = dict(env)
    count = env.get("TORCHELASTIC_RESTART_COUNT", "")
    budget = env.get("TORCHELASTIC_MAX_RESTARTS", "")
    if count.isdigit() and budget.isdigit() and int(count) < int(budget):
        predicted["TORCHELASTIC_RESTART_COUNT"] = str(int(count) + 1)
    if "MASTER_PORT" in predicted:
        predicted["MASTER_PORT"] = "0"
    return predicted


def _is_binary(python: str) -> bool:
    """Tell whether ``python`` is an executable ELF file (not a wrapper script)."""
    path = shutil.which(python) or python
    try:
        with open(path, "rb") as file:
            return file.read(4) == b"\x7fELF" and os.access(path, os.X_OK)
    except OSError:
        return False


class _SpareError(Exception):
    """Why a spare cannot become the worker (the worker then starts cold)."""


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError as exc:
        raise _SpareError(f"no working directory ({exc.strerror or exc})") from exc


class _Spare:
    """One spare process and the agent's ends of its two pipes."""

    def __init__(
        self, spec: WorkerSpec, env: dict[str, str], cwd: str, plan: Plan, python_env: str | None
    ) -> None:
        self.local_rank = spec.local_rank
        self.argv = list(spec.argv)
        self.env = env
        self.cwd = cwd
        self.plan = plan
        self._buffer = b""
        self._planned = False
        self._lock = threading.Lock()
        self._pythonpath = python_env
        start_env = dict(env)
        start_env["PYTHONPATH"] = _SITE_DIR + (os.pathsep + python_env if python_env else "")
        with contextlib.ExitStack() as stack:
            to_child, self._to_spare = os.pipe()
            stack.callback(os.close, to_child)
            ours = stack.enter_context(contextlib.ExitStack())
            ours.callback(os.close, self._to_spare)
            self._from_spare, from_child = os.pipe()
            stack.callback(os.close, from_child)
            ours.callback(os.close, self._from_spare)
            start_env[_FDS_VARIABLE] = f"{to_child},{from_child}"
            self.process = start_process(self.argv, start_env, pass_fds=(to_child, from_child))
            ours.pop_all()  # the agent keeps its ends; the child's ends close here

    def send_plan(self) -> None:
        """Send the plan (once); the spare starts its imports when it has it."""
        with self._lock:
            if self._planned:
                return
            self._planned = True
            plan = self.plan
            self._send(
                {
                    "pythonpath": self._pythonpath,
                    "path0": plan.path0,
                    "main_file": plan.main_file,
                    "steps": [
                        {"code": s.code, "filename": s.filename, "module": s.module, "tops": s.tops}
                        for s in plan.steps
                    ],
                    "extra": plan.extra,
                }
            )

    def _send(self, message: Mapping[str, Any]) -> None:
        try:
            data = (json.dumps(message) + "\n").encode()
            while data:
                data = data[os.write(self._to_spare, data) :]
        except OSError as exc:
            raise _SpareError(f"it does not read ({exc.strerror or exc})") from exc

    def _receive(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _SpareError(f"it did not answer within {timeout:g} s")
            try:
                readable, _, _ = select.select([self._from_spare], [], [], remaining)
                chunk = os.read(self._from_spare, 1 << 16) if readable else None
            except OSError as exc:
                raise _SpareError(f"its pipe failed ({exc.strerror or exc})") from exc
            if chunk is None:
                continue
            if not chunk:
                raise _SpareError(f"it closed its pipe (exit status {self.process.poll()})")
            self._buffer += chunk
            if len(self._buffer) > _MESSAGE_LIMIT:
                raise _SpareError("its message is over the limit")
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise _SpareError(f"its message is not JSON: {exc}") from exc
        if not isinstance(message, dict):
            raise _SpareError("its message is not an object")
        return message

    def check(self, spec: WorkerSpec, cwd: str, plan: Plan | None) -> None:
        """Raise :class:`_SpareError` unless this spare can become ``spec``'s worker."""
        if self.process.poll() is not None:
            raise _SpareError(f"it exited ({self.process.returncode})")
        if list(spec.argv) != self.argv:
            raise _SpareError("the command line changed")
        if cwd != self.cwd:
            raise _SpareError("the working directory changed")
        if plan != self.plan:
            raise _SpareError("the script changed")
        differ = {
            k for k in spec.env.keys() | self.env.keys() if spec.env.get(k) != self.env.get(k)
        }
        if differ - ATTEMPT_KEYS:
            raise _SpareError(f"{sorted(differ - ATTEMPT_KEYS)[0]} changed")
        self.send_plan()
        ready = self._receive(_READY_TIMEOUT)
        read = ready.get("read")
        files = ready.get("files")
        if ready.get("ready") is not True or not isinstance(read, list):
            raise _SpareError("it is not ready")
        if differ and ready.get("listed") is not False:
            raise _SpareError("its imports listed the environment")
        if differ & set(read):
            raise _SpareError(f"its imports read {sorted(differ & set(read))[0]}")
        if not isinstance(files, list) or not all(_unchanged(entry) for entry in files):
            raise _SpareError("a file of a preloaded module changed")

    def go(self, env: Mapping[str, str], cwd: str) -> None:
        """Hand the spare its attempt: it becomes the worker."""
        self._send({"env": dict(env), "cwd": cwd})
        if self._receive(_WENT_TIMEOUT).get("went") is not True:
            raise _SpareError("it did not start")
        self._close_pipes()

    def kill(self) -> None:
        """SIGKILL the spare's process group, reap it, close its pipes."""
        signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
        self._close_pipes()

    def _close_pipes(self) -> None:
        with self._lock:
            for fd in (self._to_spare, self._from_spare):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._to_spare = self._from_spare = -1
            self._planned = True


def _unchanged(entry: object) -> bool:
    """Tell whether a file the spare imported still has the mtime and size it reported."""
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
        return False
    try:
        stat = os.stat(entry[0])
    except OSError:
        return False
    return [stat.st_mtime_ns, stat.st_size] == entry[1:]


class WarmSpares:
    """The spares of one agent: started for the next attempt, used by its workers.

    Args:
        python: The workers' interpreter, or None (``--no-python``: never warm).
        entrypoint: The worker's arguments after ``python -u``.
        enabled: False: every worker starts cold.
        extra: Modules the spares import after the script's leading imports.
        preload_delay: Seconds between starting the spares and their imports.
    """

    def __init__(
        self,
        python: str | None,
        entrypoint: Sequence[str],
        enabled: bool = True,
        extra: Sequence[str] = (),
        preload_delay: float = PRELOAD_DELAY,
    ) -> None:
        self._entrypoint = list(entrypoint)
        self._extra = tuple(extra)
        hook = Path(_SITE_DIR, "sitecustomize.py")
        self._enabled = enabled and python is not None and hook.is_file() and _is_binary(python)
        if enabled and python is not None and not self._enabled:
            why = f"{python} is not an executable binary" if hook.is_file() else f"no {hook}"
            _LOG.info("workers start cold: %s", why)
        self._delay = preload_delay
        self._spares: dict[int, _Spare] = {}
        self._wake = threading.Event()

    def start(self, spec: WorkerSpec) -> subprocess.Popen[bytes]:
        """Start ``spec``'s worker: its local rank's spare when it fits, else a new process."""
        spare = self._spares.pop(spec.local_rank, None)
        if spare is not None:
            # The others may be needed next: they preload meanwhile, not one after the other.
            self._preload_now([spare, *self._spares.values()])
            try:
                cwd = _cwd()
                spare.check(spec, cwd, plan_for(self._entrypoint, cwd, self._extra))
                spare.go(spec.env, cwd)
            except _SpareError as exc:
                _LOG.info("worker rank %d starts cold: its spare: %s", spec.rank, exc)
                spare.kill()
            except BaseException:
                spare.kill()
                raise
            else:
                _LOG.info("worker rank %d starts warm (pid %d)", spec.rank, spare.process.pid)
                return spare.process
        return start_process(spec.argv, spec.env)

    def prepare(self, specs: Sequence[WorkerSpec]) -> None:
        """Start a spare for each of these workers' local ranks, for the next attempt.

        Call it from the agent's main thread (the spares die with the thread
        that started them). Spares left from before are stopped first.
        """
        self.close()
        if not self._enabled:
            return
        try:
            cwd = _cwd()
        except _SpareError:
            return
        plan = plan_for(self._entrypoint, cwd, self._extra)
        if plan is None:
            return
        for spec in specs:
            env = predicted_env(spec.env)
            try:
                spare = _Spare(spec, env, cwd, plan, env.get("PYTHONPATH"))
            except OSError as exc:
                _LOG.info("no spare for local rank %d: %s", spec.local_rank, exc)
                continue
            self._spares[spec.local_rank] = spare
        self._wake = threading.Event()
        start_thread(
            self._preload_later,
            args=(list(self._spares.values()), self._wake),
            name="rdzv-warm-preload",
        )

    def _preload_later(self, spares: list[_Spare], wake: threading.Event) -> None:
        if not wake.wait(self._delay):
            self._preload_now(spares)

    @staticmethod
    def _preload_now(spares: Sequence[_Spare]) -> None:
        for spare in spares:
            with contextlib.suppress(_SpareError):
                spare.send_plan()

    def close(self) -> None:
        """Stop every spare not used (SIGKILL to its process group) and reap it."""
        self._wake.set()
        spares, self._spares = list(self._spares.values()), {}
        for spare in spares:
            spare.kill()
