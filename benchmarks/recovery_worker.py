"""The training script of ``recovery_bench.py``: ``recovery_worker.py OUTDIR [STEP_SECONDS]``.

A gloo ``DistributedDataParallel`` job on a tiny model that says what it
does, one line on stdout per event, each stamped with ``time.time()`` (all
processes run on one machine, so their stamps compare)::

    @recovery 1733480000.123456 start rank=0 world=3 restart=0 pid=4242 step=0

``start`` is its first statement after its imports (torch's among them,
at the top as in most training scripts, so that ``rdzv run``'s warm spares
preload them), ``ready`` once
``init_process_group`` returned, ``step`` after each training step (one
every ``STEP_SECONDS``, 0.1 s by default) and ``done`` when it ends
cleanly. ``restart`` is ``TORCHELASTIC_RESTART_COUNT``. It stops once the
harness creates ``OUTDIR/stop`` (every rank decides at the same step,
through an all-reduce, so the job ends together) or after
``RECOVERY_WORKER_BOUND`` seconds (600 by default; exit status 98).

``RECOVERY_PG_TIMEOUT`` (seconds) is the process group's timeout; without it
torch's default stands, as in a job that does not set one. When the agent
hands it an expiration-timer file (``TORCHELASTIC_TIMER_FILE``: torchrun's
``TORCHELASTIC_ENABLE_FILE_TIMER=1``) and ``RECOVERY_STEP_EXPIRY`` is set,
each step runs under torch's ``expires(after=RECOVERY_STEP_EXPIRY)``, so the
agent's timer server kills a rank that hangs inside a step.
"""

import contextlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    from rdzv import progress
except ImportError:  # torchrun without rdzv installed: nothing watches progress

    def progress() -> None:
        """Nothing to tell."""


RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def say(event: str, step: int = 0) -> None:
    print(
        f"@recovery {time.time():.6f} {event} rank={RANK} world={WORLD} "
        f"restart={RESTART} pid={os.getpid()} step={step}",
        flush=True,
    )


say("start")

_timer_client: list[bool] = []


def step_guard() -> contextlib.AbstractContextManager[None]:
    """torch's expiration timer around a step when the agent serves one, else nothing."""
    timer_file = os.environ.get("TORCHELASTIC_TIMER_FILE")
    expiry = os.environ.get("RECOVERY_STEP_EXPIRY")
    if not timer_file or not expiry:
        return contextlib.nullcontext()
    from torch.distributed.elastic.timer.api import configure, expires
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerClient

    if not _timer_client:
        configure(FileTimerClient(timer_file))
        _timer_client.append(True)
    return expires(after=float(expiry))


def main() -> int:
    outdir = Path(sys.argv[1])
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    bound = float(os.environ.get("RECOVERY_WORKER_BOUND", "600"))
    pg_timeout = os.environ.get("RECOVERY_PG_TIMEOUT")
    timeout = timedelta(seconds=float(pg_timeout)) if pg_timeout else None
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    say("ready")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stop_file = outdir / "stop"
    deadline = time.monotonic() + bound
    step = 0
    next_at = time.monotonic()
    while time.monotonic() < deadline:
        with step_guard():
            optimizer.zero_grad()
            model(torch.randn(16, 8) + RANK).sum().backward()
            optimizer.step()
            stop = torch.tensor([1.0 if stop_file.exists() else 0.0])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        step += 1
        progress()  # rdzv run --hang-timeout watches it; elsewhere a no-op
        say("step", step)
        if stop.item() > 0:
            break
        next_at += interval
        time.sleep(max(next_at - time.monotonic(), 0.0))
    else:
        return 98
    say("done", step)
    # Drop DDP's reducer and the group here, not in the interpreter's
    # teardown, where gloo's threads can abort the process.
    del model, optimizer
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
