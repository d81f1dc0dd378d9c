"""Waiting and giving up: jittered backoff, and calls bounded by their caller's deadline.

Theory of operation
-------------------
A blocking call deep inside a backend (an etcd request, a Redis command)
cannot see the deadline of the rendezvous call that made it. The caller
states it once, around the whole operation, with :func:`deadline_within`;
the deadline travels in a :mod:`contextvars` variable (per thread, copied
into the threads :func:`call_within` starts), and every backend call reads
it:

* :class:`Retry` is the one retry object of the package: attempts of one call
  until the nearer of the call's own budget and the caller's deadline, with
  jittered, capped backoff between them. Past that deadline a call makes one
  short attempt (:data:`LAST_ATTEMPT` seconds) rather than none, so a
  healthy backend still answers the read that comes right at the deadline.
* :func:`time_left` caps one blocking wait (a socket timeout, a watch) by
  the caller's deadline.
* :class:`Clock` is the one time source of the rendezvous driver: it reads
  monotonic time and sleeps and waits on the same time, so tests run the
  driver's polls and keep-alive ticks on a fake clock.
* :func:`poll_backoff` spaces out polls of a backend without watches: the
  delay doubles from 10 ms up to a cap, with jitter so that many nodes
  polling one server do not move in lock-step.
* :func:`call_within` bounds a blocking call that has no deadline of its own:
  it runs the call in a daemon thread, under a caller's deadline of the same
  length, and stops waiting for it at the deadline. The call may still
  finish later (a backend that honours the deadline ends it soon after);
  its result is then dropped. Use it where returning on time matters more
  than the call (leaving a run on shutdown, closing it), never for writes
  whose outcome the caller needs.

Deadlines are on :func:`time.monotonic`: they bound real waits on sockets,
whatever clock the rendezvous decisions run on.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from rdzv.errors import RendezvousTimeoutError
from rdzv.threads import start_thread

__all__ = [
    "LAST_ATTEMPT",
    "Clock",
    "Retry",
    "as_clock",
    "call_within",
    "caller_deadline",
    "deadline_within",
    "jitter",
    "poll_backoff",
    "time_left",
]

_T = TypeVar("_T")

LAST_ATTEMPT = 0.25
"""Seconds an attempt made at or past the caller's deadline may still take."""

_RANDOM = random.Random()
"""rdzv's own generator for jitter. The global one is the application's: a
training script that seeds :mod:`random` for a reproducible run would see
its sequence change at every backoff and keep-alive tick of rdzv's threads
(and Hypothesis, which checks that nothing else draws from it while it
generates a test case, failed tests run beside a waiting handler)."""


def jitter(low: float, high: float) -> float:
    """Return a random number in ``[low, high]`` from rdzv's own generator (not the global one).

    Args:
        low: The smallest value.
        high: The largest value.

    Returns:
        The number.
    """
    return _RANDOM.uniform(low, high)


_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "rdzv_caller_deadline", default=None
)


class Clock:
    """The time decisions and waits run on: a monotonic reading, and sleeping on the same time.

    Call the instance to read it, as you would call ``time.monotonic``. This
    one is real time; tests inject :class:`rdzv.testing.FakeClock`, whose
    sleeps and waits end when its time has moved far enough.

    Args:
        read: The monotonic reading (``time.monotonic``).
    """

    def __init__(self, read: Callable[[], float] = time.monotonic) -> None:
        self._read = read

    def __call__(self) -> float:
        """Return the current reading, in seconds."""
        return self._read()

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` of this clock's time.

        Args:
            seconds: How long; nothing happens when it is not positive.
        """
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Wait until ``event`` is set or ``seconds`` of this clock's time passed.

        Args:
            event: The event.
            seconds: The longest wait.

        Returns:
            Whether the event is set.
        """
        return event.wait(max(0.0, seconds))


def as_clock(clock: Clock | Callable[[], float] | None) -> Clock:
    """Return ``clock`` as a :class:`Clock`: a bare reading sleeps in real time.

    Args:
        clock: A clock, a monotonic reading (a skewed ``time.monotonic``), or
            None for real time.

    Returns:
        The clock.
    """
    if isinstance(clock, Clock):
        return clock
    return Clock() if clock is None else Clock(clock)


def caller_deadline() -> float | None:
    """Return the caller's deadline on :func:`time.monotonic`, or None when there is none."""
    return _DEADLINE.get()


@contextlib.contextmanager
def deadline_within(seconds: float) -> Iterator[float]:
    """Bound every backend call made inside the block by ``seconds`` from now.

    An outer deadline that comes sooner stays in force.

    Args:
        seconds: The time the block may take.

    Yields:
        The deadline in force, on :func:`time.monotonic`.
    """
    deadline = time.monotonic() + max(0.0, seconds)
    outer = _DEADLINE.get()
    if outer is not None:
        deadline = min(deadline, outer)
    token = _DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _DEADLINE.reset(token)


def time_left(limit: float) -> float:
    """Return how long one blocking wait may take: ``limit``, or less near the caller's deadline.

    Args:
        limit: The wait's own limit, in seconds.

    Returns:
        ``limit``, capped by the time left until the caller's deadline, and
        never below :data:`LAST_ATTEMPT` once that deadline is near or past.
    """
    deadline = _DEADLINE.get()
    if deadline is None:
        return limit
    return min(limit, max(LAST_ATTEMPT, deadline - time.monotonic()))


class Retry:
    """Attempts of one call until a deadline, with jittered, capped backoff between them.

    The deadline is the nearer of ``budget`` from now and the caller's
    deadline (:func:`deadline_within`).

    Args:
        budget: Seconds the call may take at most, or None for no limit of
            its own.
        first: The first pause, in seconds.
        cap: The longest pause, in seconds.
        sleep: Sleeps between attempts (an injected clock's, in tests).
    """

    def __init__(
        self,
        budget: float | None,
        first: float = 0.02,
        cap: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._sleep = sleep
        self._started = time.monotonic()
        deadline = None if budget is None else self._started + max(0.0, budget)
        outer = _DEADLINE.get()
        if outer is not None:
            deadline = outer if deadline is None else min(deadline, outer)
        self._deadline = deadline
        self._pause = first
        self._cap = cap

    @property
    def deadline(self) -> float | None:
        """The deadline on :func:`time.monotonic`, or None."""
        return self._deadline

    def elapsed(self) -> float:
        """Seconds since the call started."""
        return time.monotonic() - self._started

    def remaining(self) -> float:
        """Seconds left until the deadline (never below 0); infinite without one."""
        if self._deadline is None:
            return float("inf")
        return max(0.0, self._deadline - time.monotonic())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.remaining() <= 0

    def attempt_timeout(self, limit: float) -> float:
        """Return how long the next attempt may take: ``limit``, capped by the time left.

        Args:
            limit: The attempt's own limit, in seconds.

        Returns:
            At least :data:`LAST_ATTEMPT` (or ``limit`` when smaller).
        """
        return min(limit, max(LAST_ATTEMPT, self.remaining()))

    def pause(self) -> bool:
        """Sleep before the next attempt, never past the deadline.

        Returns:
            False when the deadline has passed (make no more attempts).
        """
        remaining = self.remaining()
        if remaining <= 0:
            return False
        delay = self._pause * jitter(0.5, 1.0)
        self._sleep(min(delay, remaining))
        self._pause = min(self._pause * 2, self._cap)
        return True


def poll_backoff(attempt: int, cap: float = 1.0) -> float:
    """Return a jittered, capped backoff delay for the ``attempt``-th poll.

    Args:
        attempt: 0 for the first poll.
        cap: The largest delay, in seconds.

    Returns:
        A delay in seconds, between half and all of ``min(cap, 0.01 * 2**attempt)``.
    """
    base = min(cap, 0.01 * float(2 ** min(attempt, 20)))
    return base * jitter(0.5, 1.0)


def call_within(seconds: float, what: str, fn: Callable[[], _T]) -> _T:
    """Run ``fn`` and return its result, waiting for it at most ``seconds``.

    ``fn`` runs under a caller's deadline ``seconds`` from now (or the
    current one, when sooner), so backend calls inside it end soon after
    this function gives up on them.

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
    context = contextvars.copy_context()

    def bounded() -> None:
        with deadline_within(seconds):
            outcome.append((True, fn()))

    def run() -> None:
        try:
            context.run(bounded)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            outcome.append((False, exc))

    thread = start_thread(run, name=f"rdzv-bounded {what}")
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
