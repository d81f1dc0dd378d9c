"""A worker that hangs on its first attempt: ``hang_worker.py OUTDIR MODE [ARGS...]``.

On every attempt after the first (``TORCHELASTIC_RESTART_COUNT`` > 0) each
mode calls ``rdzv.progress()`` a few times and exits 0. On the first:

* ``progress STEPS``: every rank calls ``rdzv.progress()`` STEPS times
  (0.05 s apart), writes the wall-clock time right after its last call to
  ``OUTDIR/last-<RANK>``, then gets stuck where its rank says (rank % 3): 0
  in ``time.sleep`` (``stuck_in_sleep``), 1 on a lock it already holds
  (``stuck_on_lock``), 2 in a C loop that holds the GIL (``stuck_in_c``).
  ``STEPS`` 0: no progress call at all, stuck at once.
* ``quiet SECONDS``: no progress call; sleep SECONDS, exit 0.
* ``timer RANK``: torch's ``FileTimerClient`` on ``TORCHELASTIC_TIMER_FILE``;
  every rank acquires and releases a few timers of scope ``quick``
  (after 5 s), then worker RANK sleeps inside ``expires(after=1,
  scope="step")`` and writes the time it entered to ``OUTDIR/entered``;
  the others exit 0.

Every stuck worker gives up after 60 s (exit 99), so a broken watchdog
fails its test instead of hanging it.
"""

import os
import sys
import threading
import time
from pathlib import Path

import rdzv

GIVE_UP = 60.0


def stuck_in_sleep() -> None:
    time.sleep(GIVE_UP)


def stuck_on_lock() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire(timeout=GIVE_UP)


def stuck_in_c() -> None:
    # One C call (sum over a range iterator) that holds the GIL for minutes.
    sum(range(10**11))


def progress_mode(outdir: Path, rank: int, steps: int) -> None:
    last = time.time()
    for _ in range(steps):
        time.sleep(0.05)
        rdzv.progress()
        last = time.time()
    (outdir / f"last-{rank}").write_text(repr(last))
    (stuck_in_sleep, stuck_on_lock, stuck_in_c)[rank % 3]()


def timer_mode(outdir: Path, rank: int, target: int) -> None:
    # torch.distributed.elastic.timer's names, from the modules that define them
    # (the package does not re-export them for mypy); imported only in this mode.
    from torch.distributed.elastic.timer.api import configure, expires
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerClient

    configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    for _ in range(5):
        with expires(after=5, scope="quick"):
            time.sleep(0.01)
    if rank == target:
        with expires(after=1, scope="step"):
            (outdir / "entered").write_text(repr(time.time()))
            time.sleep(GIVE_UP)


def main() -> None:
    out, mode, *rest = sys.argv[1:]
    outdir = Path(out)
    rank = int(os.environ["RANK"])
    print(f"rank {rank} pid {os.getpid()} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}")
    sys.stdout.flush()
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        for _ in range(3):
            rdzv.progress()
        (outdir / f"done-{rank}").write_text("x")
        return
    if mode == "progress":
        progress_mode(outdir, rank, int(rest[0]))
    elif mode == "quiet":
        time.sleep(float(rest[0]))
        return
    elif mode == "timer":
        timer_mode(outdir, rank, int(rest[0]))
        return
    else:
        raise SystemExit(f"unknown mode {mode}")
    sys.exit(99)


if __name__ == "__main__":
    main()
