"""The two barriers that end a successful job: every node done, then every node gone.

Both count agents in the round's store (keys under
:data:`~rdzv.keys.LAUNCH_ROOT`) and wait for the last one:

* :func:`exit_barrier`: once a node's workers all exited 0, its agent waits
  for the other agents of the round, so the workers' bootstrap store (group
  rank 0's) outlives every worker. The last agent to arrive knows that
  every node succeeded: it alone closes the run, before it releases the
  others, so nobody writes to a store whose host may already be gone.
* :func:`leave_barrier`: after leaving the rendezvous, every agent counts
  itself out and waits briefly for the rest, so the agent hosting the
  rendezvous store outlives the others' last writes.

A barrier that fails or times out costs a line in the agent's log, never
the job: its workers have finished.
"""

from __future__ import annotations

from collections.abc import Callable

from rdzv.errors import RendezvousConnectionError, RendezvousError
from rdzv.keys import LAUNCH_ROOT
from rdzv.store.base import Store

__all__ = ["LEAVE_BARRIER_TIMEOUT", "exit_barrier", "leave_barrier"]

#: Seconds an agent waits for the others to leave.
LEAVE_BARRIER_TIMEOUT = 30.0


def exit_barrier(
    store: Store,
    total: int,
    timeout: float,
    close_run: Callable[[], None],
    log: Callable[[str], None],
) -> None:
    """Count this agent done; the last of ``total`` calls ``close_run``; wait up to ``timeout``."""
    try:
        if store.add(f"{LAUNCH_ROOT}/exit/count", 1) >= total:
            close_run()
            store.set(f"{LAUNCH_ROOT}/exit/done", "1")
        store.wait([f"{LAUNCH_ROOT}/exit/done"], timeout=timeout)
    except RendezvousError as exc:
        log(f"not every node reached the exit barrier: {type(exc).__name__}: {exc}")


def leave_barrier(store: Store, total: int, log: Callable[[str], None]) -> None:
    """Count this agent gone and wait (at most :data:`LEAVE_BARRIER_TIMEOUT`) for all ``total``."""
    try:
        if store.add(f"{LAUNCH_ROOT}/left/count", 1) >= total:
            store.set(f"{LAUNCH_ROOT}/left/done", "1")
        store.wait([f"{LAUNCH_ROOT}/left/done"], timeout=LEAVE_BARRIER_TIMEOUT)
    except RendezvousConnectionError:
        # The store went away after this node counted itself out: its host
        # left as the barrier completed. Nothing is lost.
        pass
    except RendezvousError as exc:
        log(f"not every node confirmed leaving: {type(exc).__name__}: {exc}")
