"""Waiting and giving up: jittered backoff, and calls bounded by their caller's deadline.

* :func:`poll_backoff` spaces out polls of a backend without watches: the
  delay doubles from 10 ms up to a cap, with jitter so that many nodes
  polling one server do not move in lock-step.
* :func:`call_within` bounds a blocking call that has no deadline of its own
  (a backend call on a dead host may block for its whole read timeout): it
  runs the call in a daemon thread and stops waiting for it at the
  deadline. The call may still finish later; its result is then dropped.
  Use it where returning on time matters more than the call (leaving a run
  on shutdown, closing it), never for writes whose outcome the caller needs.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import TypeVar

from rdzv.errors import RendezvousTimeoutError

__all__ = ["call_within", "poll_backoff"]

_T = TypeVar("_T")


def poll_backoff(attempt: int, cap: float = 1.0) -> float:
    """Return a jittered, capped backoff delay for the ``attempt``-th poll.

    Args:
        attempt: 0 for the first poll.
        cap: The largest delay, in seconds.

    Returns:
        A delay in seconds, between half and all of ``min(cap, 0.01 * 2**attempt)``.
    """
    base = min(cap, 0.01 * float(2 ** min(attempt, 20)))
    return base * (0.5 + random.random() / 2)


def call_within(seconds: float, what: str, fn: Callable[[], _T]) -> _T:
    """Run ``fn`` and return its result, waiting for it at most ``seconds``.

    Args:
        seconds: How long to wait.
        what: What the call does, for the error message.
        fn: The call.

    Returns:
        What ``fn`` returned.

    Raises:
        RendezvousTimeoutError: ``fn`` did not finish in time (it goes on in
            the background; its result is dropped).
        BaseException: Whatever ``fn`` raised.
    """
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=f"rdzv-bounded {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise RendezvousTimeoutError(
            f"{what} did not finish within {seconds:g} s: the backend is not answering"
        )
    ok, value = outcome[0]
    if ok:
        return value  # type: ignore[return-value]
    assert isinstance(value, BaseException)
    raise value
