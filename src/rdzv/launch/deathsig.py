"""A worker's parent-death signal, asked for with no Python between fork and exec.

Theory of operation. On Linux every worker asks the kernel for SIGKILL when
the agent's thread that started it ends (``PR_SET_PDEATHSIG``), so that a
SIGKILLed agent leaves no orphan workers. Only the child can ask, after the
fork. Running Python there (subprocess's ``preexec_fn``) is unsafe in an
agent with other threads: the child is a copy of one thread of a busy
process, and grpcio, with a channel busy in another thread, aborts such a
child before it execs (grpc/grpc#43055). So the child runs no Python: the
agent starts a small program, the *trampoline*, that asks for the signal and
execs the worker in the same process (same pid, session and descriptors; the
death signal survives the exec). The trampoline is ``setpriv --pdeathsig
KILL --`` (util-linux, 2.33 and later) when the agent finds one that knows
the option, else the agent's own interpreter in isolated mode without
``site`` (``python -I -S -c``) making the one ``prctl`` call. Elsewhere than
Linux there is no such signal and the worker starts directly.

The signal is asked for after the fork, so an agent that died before the
trampoline asked would leave an orphan: ``Popen`` returns once the
trampoline is exec'd, not once it asked. The agent therefore waits, after
``Popen``, until ``setpriv`` has exec'd the worker (:func:`wait_armed`:
``/proc/<pid>/exe`` is no longer ``setpriv``), as ``preexec_fn`` made
``Popen`` wait; the Python trampoline checks, after asking, that its parent
is still the agent and exits with status 1 otherwise. The worker's
environment passes through untouched, in the agent's order (a shell in
between would rewrite it in its own order).

The trampoline looks the worker's program up in the worker's ``PATH`` (as
subprocess does when it execs the program itself). The agent looks it up
first (:func:`check_program`), so that a missing program is still an
``OSError`` when the worker is started, not a worker that exits with 127.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

__all__ = ["ARM_TIMEOUT", "check_program", "trampoline", "trampoline_of", "wait_armed"]

_PR_SET_PDEATHSIG = 1

#: The Python trampoline: ask for SIGKILL at the parent's death; if the parent
#: (argv[1]) is still there, exec the worker.
_PYTHON_TRAMPOLINE = (
    "import ctypes,os,sys;"
    f"ctypes.CDLL(None,use_errno=True).prctl({_PR_SET_PDEATHSIG},9);"
    "os.getppid()==int(sys.argv[1]) or os._exit(1);"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)

#: How long the agent waits for setpriv to exec the worker (then it goes on).
ARM_TIMEOUT = 10.0

_PROBE_TIMEOUT = 10.0


def trampoline_of(setpriv: str | None, python: str | None, parent: int) -> tuple[str, ...]:
    """The trampoline's command line (before the worker's), from what is available.

    Args:
        setpriv: A ``setpriv`` that knows ``--pdeathsig``, or None.
        python: A Python interpreter, or None.
        parent: The pid of the process that starts it (the agent), which the
            Python trampoline checks.

    Returns:
        ``setpriv``'s, else the interpreter's, else nothing (the worker then
        starts directly, without the signal).
    """
    if setpriv is not None:
        return (setpriv, "--pdeathsig", "KILL", "--")
    if python is not None:
        return (python, "-I", "-S", "-c", _PYTHON_TRAMPOLINE, str(parent))
    return ()


def _setpriv() -> str | None:
    """Return the path of a ``setpriv`` that knows ``--pdeathsig``, or None."""
    path = shutil.which("setpriv") or shutil.which("setpriv", path=os.defpath)
    if path is None:
        return None
    try:
        probe = subprocess.run(
            [path, "--help"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_PROBE_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if b"--pdeathsig" in probe.stdout else None


@functools.cache
def _programs() -> tuple[str | None, str | None]:
    """The ``setpriv`` and the interpreter a trampoline can use (found once, on first use)."""
    python = sys.executable if sys.executable and os.path.isfile(sys.executable) else None
    return _setpriv(), python


def trampoline() -> tuple[str, ...]:
    """The trampoline this process starts workers through."""
    if not sys.platform.startswith("linux"):
        return ()
    return trampoline_of(*_programs(), os.getpid())


def check_program(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Check that ``argv[0]`` names a program the worker's environment can run.

    A name without a slash is looked up in the ``PATH`` of ``env`` (the
    default path when it has none), as ``execvp`` does.

    Raises:
        FileNotFoundError: No such program.
        PermissionError: It is not executable.
        ValueError: ``argv`` is empty.
    """
    if not argv:
        raise ValueError("a worker needs a command line")
    program = argv[0]
    if os.path.dirname(program):
        candidates = [program]
    else:
        candidates = [os.path.join(d, program) for d in os.get_exec_path(dict(env))]
    found = [c for c in candidates if os.path.isfile(c)]
    if not found:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if not any(os.access(c, os.X_OK) for c in found):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), found[0])


def wait_armed(pid: int, timeout: float = ARM_TIMEOUT) -> None:
    """Wait until the trampoline of ``pid`` asked for the signal and exec'd the worker.

    Only ``setpriv`` is waited for (the Python trampoline checks its parent
    itself); a process that exited, or a wait past ``timeout`` seconds,
    ends the wait.
    """
    setpriv = _programs()[0]
    if setpriv is None or not sys.platform.startswith("linux"):
        return
    exe = os.path.realpath(setpriv)
    end = time.monotonic() + timeout
    delay = 0.0002
    while time.monotonic() < end:
        try:
            if os.readlink(f"/proc/{pid}/exe") != exe:
                return
        except OSError:  # gone, or a zombie: nothing to arm
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
