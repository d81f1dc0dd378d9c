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
* :class:`Clock` is the one time source: every deadline is a reading of a
  clock, and every sleep and wait under it runs on the same clock. The
  caller's clock travels with its deadline (:func:`current_clock`), so a
  backend's polls sleep on it and tests run the whole driver on a fake one.
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

A real socket's timeout is the time left on the caller's clock
(:func:`time_left`): one clock, real time unless a test injects another.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from rdzv.errors import RendezvousTimeoutError
from rdzv.threads import start_thread

__all__ = [
    "LAST_ATTEMPT",
    "REAL_TIME",
    "Clock",
    "Deadline",
    "Retry",
    "as_clock",
    "call_within",
    "caller_deadline",
    "current_clock",
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
    """Return a random number in ``[low, high]`` from rdzv's own generator (not the global one)."""
    return _RANDOM.uniform(low, high)


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
        """Sleep ``seconds`` of this clock's time (none when not positive)."""
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Wait until ``event`` is set or ``seconds`` of this clock's time passed; True if set."""
        return event.wait(max(0.0, seconds))

    def running(self) -> contextlib.AbstractContextManager[None]:
        """Count the calling thread, for the block, as one whose waits are on this clock.

        A fake clock that moves by itself (:class:`rdzv.testing.AutojumpClock`)
        moves only while every such thread waits on it. Real time ignores it.
        """
        return contextlib.nullcontext()

    def blocking(self, seconds: float) -> contextlib.AbstractContextManager[None]:
        """Mark the block as a wait of at most ``seconds`` on something else (a store's wait).

        A fake clock that moves by itself may move up to the wait's end
        meanwhile. Real time ignores it.
        """
        return contextlib.nullcontext()


REAL_TIME = Clock()
"""The real clock: the caller's clock when no deadline names another."""


@dataclass(frozen=True)
class Deadline:
    """A caller's deadline: a reading of its clock.

    Attributes:
        clock: The clock.
        at: The reading at which the deadline passes.
    """

    clock: Clock
    at: float

    @classmethod
    def after(cls, seconds: float, clock: Clock) -> Deadline:
        """Return the deadline ``seconds`` (none when negative) from now on ``clock``."""
        return cls(clock, clock() + max(0.0, seconds))

    def left(self) -> float:
        """Return the seconds left on the clock (negative once past)."""
        return self.at - self.clock()

    def on(self, clock: Clock) -> float:
        """Return the deadline as a reading of ``clock``."""
        return self.at if clock is self.clock else clock() + self.left()


_DEADLINE: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "rdzv_caller_deadline", default=None
)


def as_clock(clock: Clock | Callable[[], float] | None) -> Clock:
    """Return ``clock`` as a :class:`Clock`: a bare reading sleeps in real time.

    ``clock`` is a clock, a monotonic reading (a skewed ``time.monotonic``),
    or None for real time.
    """
    if isinstance(clock, Clock):
        return clock
    return REAL_TIME if clock is None else Clock(clock)


def caller_deadline() -> Deadline | None:
    """Return the caller's deadline, or None when there is none."""
    return _DEADLINE.get()


def current_clock(default: Clock = REAL_TIME) -> Clock:
    """Return the caller's clock: its deadline's, or ``default`` (real time)."""
    deadline = _DEADLINE.get()
    return default if deadline is None else deadline.clock


@contextlib.contextmanager
def deadline_within(seconds: float, clock: Clock | None = None) -> Iterator[Deadline]:
    """Bound every backend call made inside the block by ``seconds`` from now.

    An outer deadline that comes sooner stays in force.

    Args:
        seconds: The time the block may take.
        clock: The clock of the deadline, and of every wait under it; the
            outer deadline's (or real time) when None.

    Yields:
        The deadline in force.
    """
    outer = _DEADLINE.get()
    clock = clock or (REAL_TIME if outer is None else outer.clock)
    at = clock() + max(0.0, seconds)
    if outer is not None:
        at = min(at, outer.on(clock))
    deadline = Deadline(clock, at)
    token = _DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _DEADLINE.reset(token)


def time_left(limit: float) -> float:
    """Return how long one blocking wait may take: ``limit``, or less near the caller's deadline.

    ``limit`` capped by the time left until the caller's deadline, and never
    below :data:`LAST_ATTEMPT` once that deadline is near or past.
    """
    deadline = _DEADLINE.get()
    if deadline is None:
        return limit
    return min(limit, max(LAST_ATTEMPT, deadline.left()))


class Retry:
    """Attempts of one call until a deadline, with jittered, capped backoff between them.

    The deadline is the nearer of ``budget`` from now and the caller's
    deadline (:func:`deadline_within`).

    Args:
        budget: Seconds the call may take at most, or None for no limit of
            its own.
        first: The first pause, in seconds.
        cap: The longest pause, in seconds.
        clock: The clock of the deadline and the pauses; the caller's
            (:func:`current_clock`) when None.
    """

    def __init__(
        self,
        budget: float | None,
        first: float = 0.02,
        cap: float = 0.5,
        clock: Clock | None = None,
    ) -> None:
        self._clock = clock = clock or current_clock()
        self._started = clock()
        deadline = None if budget is None else self._started + max(0.0, budget)
        outer = _DEADLINE.get()
        if outer is not None:
            at = outer.on(clock)
            deadline = at if deadline is None else min(deadline, at)
        self._deadline = deadline
        self._pause = first
        self._cap = cap

    @property
    def deadline(self) -> float | None:
        """The deadline, a reading of this retry's clock, or None."""
        return self._deadline

    def elapsed(self) -> float:
        """Seconds since the call started."""
        return self._clock() - self._started

    def remaining(self) -> float:
        """Seconds left until the deadline (never below 0); infinite without one."""
        if self._deadline is None:
            return float("inf")
        return max(0.0, self._deadline - self._clock())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.remaining() <= 0

    def attempt_timeout(self, limit: float) -> float:
        """Return how long the next attempt may take: ``limit``, capped by the time left.

        At least :data:`LAST_ATTEMPT` (or ``limit`` when smaller).
        """
        return min(limit, max(LAST_ATTEMPT, self.remaining()))

    def pause(self) -> bool:
        """Sleep before the next attempt, never past the deadline; False once it has passed."""
        remaining = self.remaining()
        if remaining <= 0:
            return False
        delay = self._pause * jitter(0.5, 1.0)
        self._clock.sleep(min(delay, remaining))
        self._pause = min(self._pause * 2, self._cap)
        return True


def poll_backoff(attempt: int, cap: float = 1.0) -> float:
    """Return a jittered, capped backoff delay for the ``attempt``-th poll (0 first).

    Between half and all of ``min(cap, 0.01 * 2**attempt)`` seconds.
    """
    base = min(cap, 0.01 * float(2 ** min(attempt, 20)))
    return base * jitter(0.5, 1.0)


def call_within(seconds: float, what: str, fn: Callable[[], _T], clock: Clock | None = None) -> _T:
    """Run ``fn`` and return its result, waiting for it at most ``seconds``.

    ``fn`` runs under a caller's deadline ``seconds`` from now (or the
    current one, when sooner), so backend calls inside it end soon after
    this function gives up on them.

    Args:
        seconds: How long to wait.
        what: What the call does, for the error message.
        fn: The call.
        clock: The clock of the wait; the caller's when None.

    Raises:
        RendezvousTimeoutError: ``fn`` did not finish in time (it goes on in
            the background; its result is dropped).
        BaseException: Whatever ``fn`` raised.
    """
    clock = clock or current_clock()
    outcome: list[tuple[bool, object]] = []
    done = threading.Event()
    context = contextvars.copy_context()

    def bounded() -> None:
        with deadline_within(seconds, clock):
            outcome.append((True, fn()))

    def run() -> None:
        try:
            context.run(bounded)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            outcome.append((False, exc))
        finally:
            done.set()

    start_thread(run, name=f"rdzv-bounded {what}")
    clock.wait(done, seconds)
    if not outcome:
        raise RendezvousTimeoutError(
            f"{what} did not finish within {seconds:g} s: the backend is not answering"
        )
    ok, value = outcome[0]
    if ok:
        return value  # type: ignore[return-value]
    assert isinstance(value, BaseException)
    raise value
