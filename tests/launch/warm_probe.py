"""A worker that records how it was started: ``warm_probe.py OUTDIR END [SLEEP]``.

It writes ``OUTDIR/probe-<TORCHELASTIC_RESTART_COUNT>.json``: ``__name__``,
``__doc__``, ``__file__``, the names in ``__main__``, ``sys.argv``,
``sys.orig_argv``, ``sys.path``, ``sys.flags``, the modules imported, the
working directory, the environment (in order), every signal's Python
handler and the kernel's blocked/ignored/caught masks, the open file
descriptors, the session and process group, the death signal
(``PR_SET_PDEATHSIG``), the parent, stdout's buffering, and when the
process started (seconds since the epoch) and the record was made. At exit
(``atexit``) it writes ``OUTDIR/atexit-<count>.json``: ``__file__``,
``__cached__`` and ``__loader__`` of ``__main__`` (Python removes the first
two after running a script).

Attempt 0 then sleeps SLEEP seconds (0.5) and exits 3, so the agent restarts
it. A later attempt ends as END says: ``exit:N`` (``sys.exit(N)``),
``kill:NAME`` (kills itself with the signal), ``interrupt`` (an uncaught
KeyboardInterrupt), ``raise`` (an uncaught ValueError).
"""

import atexit
import ctypes
import os
import signal
import sys
import time

PR_GET_PDEATHSIG = 2


def started_at() -> float:
    """When this process started, from /proc (seconds since the epoch, 10 ms steps)."""
    with open("/proc/self/stat") as file:
        ticks = int(file.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as file:
        boot = next(int(line.split()[1]) for line in file if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def death_signal() -> int:
    value = ctypes.c_int()
    ctypes.CDLL(None).prctl(PR_GET_PDEATHSIG, ctypes.byref(value))
    return value.value


def observe() -> dict[str, object]:
    status = {}
    with open("/proc/self/status") as file:
        for line in file:
            key, _, value = line.partition(":")
            if key in ("SigBlk", "SigIgn", "SigCgt"):
                status[key] = value.strip()
    handlers = {
        s.name: repr(signal.getsignal(s))
        for s in signal.Signals
        if s not in (signal.SIGKILL, signal.SIGSTOP)
    }
    return {
        "name": __name__,
        "doc": __doc__,
        "file": __file__,
        "main": sorted(globals()),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path": sys.path,
        "flags": repr(sys.flags),
        "modules": sorted(sys.modules),
        "cwd": os.getcwd(),
        "env": list(os.environ.items()),
        "handlers": handlers,
        "masks": status,
        "fds": sorted(os.listdir("/proc/self/fd")),
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgrp() == os.getpid(),
        "death_signal": death_signal(),
        "ppid": os.getppid(),
        "stdout": [sys.stdout.line_buffering, getattr(sys.stdout, "write_through", None)],
        "pid": os.getpid(),
        "started": started_at(),
        "observed": time.time(),
    }


def write(path: str, record: object) -> None:
    import json  # after observe(): the record shows that json was not imported

    with open(f"{path}.partial", "w") as file:
        json.dump(record, file)
    os.replace(f"{path}.partial", path)


def at_exit(path: str) -> None:
    main = vars(sys.modules["__main__"])
    loader = main.get("__loader__")
    write(
        path,
        {
            "__file__": main.get("__file__"),
            "__cached__": main.get("__cached__", "unset"),
            "__loader__": [type(loader).__name__, getattr(loader, "path", None)],
        },
    )


def main() -> None:
    outdir, end = sys.argv[1], sys.argv[2]
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    write(os.path.join(outdir, f"probe-{attempt}.json"), observe())
    atexit.register(at_exit, os.path.join(outdir, f"atexit-{attempt}.json"))
    print(f"probe attempt {attempt}")
    if attempt == "0":
        time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.5)
        sys.exit(3)
    kind, _, arg = end.partition(":")
    if kind == "exit":
        sys.exit(int(arg))
    if kind == "kill":
        os.kill(os.getpid(), signal.Signals[arg])
        time.sleep(5)
    if kind == "interrupt":
        raise KeyboardInterrupt
    raise ValueError(f"probe failure in attempt {attempt}")


if __name__ == "__main__":
    main()
