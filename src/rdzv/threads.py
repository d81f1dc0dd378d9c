"""Background threads that leave the process's signals to the main thread.

Theory of operation. The kernel hands a signal sent to the process (``kill
PID``) to any one of its threads that does not block it. Python runs the
signal's handler only in the main thread, so when another thread takes the
signal, the main thread learns of it only when it next runs Python code: a
main thread blocked in a socket read (a store call to a paused server) keeps
waiting for its whole read timeout, and ``rdzv run`` ignored SIGTERM for up to
60 s that way. When the main thread blocks signals for a moment (CPython does
while it forks a worker), the kernel picks another thread every time.

Every thread rdzv starts therefore blocks the asynchronous signals a program
handles: a signal then goes to the main thread, interrupts whatever system call
it is in, and its handler runs at once; a signal that arrives while the main
thread blocks it waits, pending, until the main thread takes it. Threads the
blocked ones start inherit the mask. Nothing here starts processes from these
threads (a child would inherit the mask too).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

#: The signals background threads never take: the ones that end or notify a
#: program. Faults (SIGSEGV, ...) stay with the thread that caused them.
MAIN_THREAD_SIGNALS = frozenset(
    {
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGALRM,
    }
)


def start_thread(
    target: Callable[..., Any], *, name: str, args: tuple[Any, ...] = ()
) -> threading.Thread:
    """Start a daemon thread that blocks :data:`MAIN_THREAD_SIGNALS`.

    The caller's signal mask is widened while the thread is created (a new
    thread inherits its creator's mask) and restored before this returns.
    """
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return thread
