"""rdzv's background threads leave the process's signals to the main thread."""

from __future__ import annotations

import signal
import subprocess
import sys

from rdzv.threads import MAIN_THREAD_SIGNALS, start_thread
from tests.procs import subprocess_env


def test_a_started_thread_blocks_the_signals_and_its_creator_keeps_its_mask() -> None:
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    seen: list[set[int]] = []
    thread = start_thread(
        lambda: seen.append(set(signal.pthread_sigmask(signal.SIG_BLOCK, []))), name="probe"
    )
    thread.join(30)
    assert thread.daemon
    assert thread.name == "probe"
    assert seen
    assert seen[0] >= MAIN_THREAD_SIGNALS
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


# The main thread blocks SIGUSR2 for a moment (as CPython does around a fork)
# while a signal arrives; with a background thread that does not block it, the
# kernel hands the signal to that thread and the main thread may go on into a
# long system call before it notices. Started by start_thread, the background
# thread leaves it pending until the main thread unblocks it.
_PROBE = """
import os, signal, threading, time
from rdzv.threads import start_thread
ran_in = []
signal.signal(signal.SIGUSR2, lambda signum, frame: ran_in.append(threading.current_thread().name))
stop = threading.Event()
if {plain}:
    threading.Thread(target=stop.wait, daemon=True).start()
else:
    start_thread(stop.wait, name="background")
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR2}})
os.kill(os.getpid(), signal.SIGUSR2)
deadline = time.monotonic() + {wait}
while signal.SIGUSR2 in signal.sigpending() and time.monotonic() < deadline:
    time.sleep(0.01)
print("pending" if signal.SIGUSR2 in signal.sigpending() else "taken")
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGUSR2}})
for _ in range(100):
    if ran_in:
        break
    time.sleep(0.01)
print(ran_in)
"""


def _probe(*, plain: bool, wait: float) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(plain=plain, wait=wait)],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
        check=True,
    )
    return out.stdout.split("\n", 1)


def test_a_signal_the_main_thread_blocks_waits_for_it_instead_of_going_to_a_background_thread() -> (
    None
):
    pending, ran_in = _probe(plain=False, wait=0.5)
    assert pending == "pending"
    assert ran_in.strip() == "['MainThread']"


def test_the_probe_sees_a_plain_thread_take_the_signal() -> None:
    # The control: without start_thread the kernel gives the signal away.
    pending, _ = _probe(plain=True, wait=20.0)
    assert pending == "taken"
