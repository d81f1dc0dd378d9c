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

The signal is asked for after the fork, so an agent that dies before the
trampoline asked would leave an orphan (``Popen`` returns once the
trampoline is exec'd, not once it asked). The trampoline therefore checks,
after asking, that its parent is still the agent (its pid is passed along)
and exits with status 1 otherwise: ``setpriv`` execs ``/bin/sh``, whose
``$PPID`` is read after the signal was set, and which execs the worker.

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
from collections.abc import Mapping, Sequence

__all__ = ["check_program", "trampoline", "trampoline_of"]

_PR_SET_PDEATHSIG = 1

#: The Python trampoline: ask for SIGKILL at the parent's death; if the parent
#: (argv[1]) is still there, exec the worker.
_PYTHON_TRAMPOLINE = (
    "import ctypes,os,sys;"
    f"ctypes.CDLL(None,use_errno=True).prctl({_PR_SET_PDEATHSIG},9);"
    "os.getppid()==int(sys.argv[1]) or os._exit(1);"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)

#: After setpriv asked for the signal: if the parent ($0) is still there, exec the worker.
_SHELL_CHECK = '[ "$PPID" = "$0" ] || exit 1; exec "$@"'

_PROBE_TIMEOUT = 10.0


def trampoline_of(setpriv: str | None, python: str | None, parent: int) -> tuple[str, ...]:
    """The trampoline's command line (before the worker's), from what is available.

    Args:
        setpriv: A ``setpriv`` that knows ``--pdeathsig``, or None.
        python: A Python interpreter, or None.
        parent: The pid of the process that starts it (the agent).

    Returns:
        ``setpriv``'s, else the interpreter's, else nothing (the worker then
        starts directly, without the signal).
    """
    if setpriv is not None:
        return (setpriv, "--pdeathsig", "KILL", "--", "/bin/sh", "-c", _SHELL_CHECK, str(parent))
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
