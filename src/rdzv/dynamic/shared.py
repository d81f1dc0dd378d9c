"""The run's shared state as the handler sees it: decoded reads, fenced writes, waits.

:class:`SharedState` wraps a :class:`~rdzv.backends.base.RendezvousBackend`:

* :meth:`SharedState.read` returns the decoded state and its fencing token;
* :meth:`SharedState.write` is one compare-and-set. torch's backend contract
  lets ``set_state`` return None; a backend that does so after writing is
  answered by reading the state back (our write won when the stored bytes
  are the ones written), and one that says nothing is stored right after a
  create breaks the contract: a :class:`~rdzv.errors.RendezvousStateError`
  naming it, within one round trip rather than after the join timeout;
* :meth:`SharedState.update` is the one compare-and-set loop: read, let a
  pure ``change`` decide the new state (or that none is needed), write,
  retry with jittered backoff on a conflict, until a deadline (its own, or
  the caller's: :class:`rdzv.retry.Retry`).

:func:`shared_state` picks, once, the reads that suit the backend's
capabilities (:meth:`~SharedState.read_view`, :meth:`~SharedState.wait`,
:meth:`~SharedState.changed_since`, :meth:`~SharedState.seats`):
:class:`SharedState` reads the whole state and polls it;
:class:`WatchedState` waits with the backend's watch; :class:`SeatedState`
writes the members' seats (:mod:`rdzv.dynamic.seat`) and always the state's
summary with the state, waits for the token and this node's seat, decides
on the summary and tells "unchanged" from the token: a member of a large
round never reads the participant list.

Every method may raise the backend's errors: ``RendezvousConnectionError``
(the backend cannot be reached) and ``RendezvousStateError`` (a stored
record is corrupt).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import cast

from rdzv.backends.base import RendezvousBackend, SeatedBackend, Token, WatchableBackend
from rdzv.dynamic.machine import StateView
from rdzv.dynamic.pacing import seat_wait
from rdzv.dynamic.seat import SUMMARY_SEAT, Member, Seat, decode_seat, seats_of
from rdzv.dynamic.state import (
    RendezvousState,
    StateSummary,
    decode_state,
    decode_summary,
    encode_state,
    encode_summary,
)
from rdzv.errors import RendezvousStateError
from rdzv.retry import Clock, Retry, as_clock, poll_backoff

__all__ = ["SeatedState", "SharedState", "WatchedState", "shared_state"]

CAS_ATTEMPTS = 64
"""Compare-and-set attempts of one update before it gives up."""
_SUMMARY_ATTEMPTS = 3
"""Reads of the token and its summary before :meth:`SharedState.read_view` reads the state."""

Change = Callable[[RendezvousState | None], RendezvousState | None]
Marks = Callable[[RendezvousState], Mapping[str, bytes | None] | None]
Read = tuple[RendezvousState | None, Token | None]
Seats = Mapping[str, bytes] | None
Written = tuple[bytes, Token, bool] | None
Waited = tuple[StateView | None, Token | None, Member | None]


def shared_state(backend: RendezvousBackend, name: str, clock: Clock | None = None) -> SharedState:
    """Return the shared state of ``backend`` with the reads that suit its capabilities."""
    if isinstance(backend, SeatedBackend):
        return SeatedState(backend, name, clock)
    if isinstance(backend, WatchableBackend):
        return WatchedState(backend, name, clock)
    return SharedState(backend, name, clock)


class SharedState:
    """The run's state in a backend, decoded and written with compare-and-set; read whole, polled.

    Args:
        backend: The backend.
        name: The backend's name, for messages.
        clock: The clock that polls and backoffs sleep on.
    """

    def __init__(self, backend: RendezvousBackend, name: str, clock: Clock | None = None) -> None:
        self._backend = backend
        self._name = name
        self._clock = as_clock(clock)
        self._last: tuple[bytes, RendezvousState] | None = None

    def read(self) -> Read:
        """Read the state: ``(state, token)``; ``(None, None)`` when nothing is stored."""
        found = self._backend.get_state()
        if found is None:
            return None, None
        return self._decode(found[0]), found[1]

    def _decode(self, data: bytes) -> RendezvousState:
        """Decode a stored state; a state error names the backend and its key.

        The last decoding is kept: a member polling an unchanged state of
        thousands of participants compares bytes (in C) instead of decoding
        and validating the list again.
        """
        last = self._last
        if last is not None and last[0] == data:
            return last[1]
        try:
            state = decode_state(data)
        except RendezvousStateError as exc:
            key = getattr(self._backend, "key", None)
            where = f"the {self._name!r} backend" + ("" if key is None else f", key {key!r}")
            raise RendezvousStateError(f"{exc} (read from {where})") from exc
        self._last = (bytes(data), state)
        return state

    def write(
        self, state: RendezvousState, data: bytes, token: Token | None, seats: Seats = None
    ) -> Written:
        """Compare-and-set the encoded state.

        ``data`` is ``encode_state(state)``; ``seats`` (:meth:`seats`) go
        with it on a seated backend. Returns as ``set_state``.

        Raises:
            RendezvousStateError: The backend broke the contract (see the module).
        """
        result = self._set(state, data, token, seats)
        if result is not None:
            return result
        found = self._backend.get_state()
        if found is not None:
            return found[0], found[1], found[0] == data
        if token is None:
            raise RendezvousStateError(
                f"the {self._name!r} backend ({type(self._backend).__name__}) broke the "
                "backend contract: set_state returned None and get_state finds no state right "
                "after creating it"
            )
        return None

    def _set(
        self, state: RendezvousState, data: bytes, token: Token | None, seats: Seats
    ) -> Written:
        return self._backend.set_state(data, token)

    def update(
        self, change: Change, deadline: float | None = None
    ) -> tuple[RendezvousState | None, bool]:
        """Apply ``change`` to the stored state with compare-and-set, retrying on conflicts.

        ``change`` returns the state to write, or None when no write is
        needed; the update gives up at ``deadline`` on this state's clock.
        Returns ``(written, settled)``: the state this call wrote (None if
        none), and False when it gave up (attempts spent or deadline passed).
        """
        retry = Retry(None, first=0.01, cap=0.1, clock=self._clock)
        for _ in range(CAS_ATTEMPTS):
            state, token = self.read()
            desired = change(state)
            if desired is None:
                return None, True
            result = self.write(desired, encode_state(desired), token)
            if result is not None and result[2]:
                return desired, True
            if (deadline is not None and self._clock() >= deadline) or not retry.pause():
                break
        return None, False

    def seats(self, plan: RendezvousState, marks: Marks) -> Mapping[str, bytes] | None:
        """Return the members' seats to store with the seal of ``plan``; None: this backend keeps none.

        ``marks`` reads the members' heartbeat marks (called only for seats).
        """
        return None

    def read_view(self) -> tuple[StateView | None, Token | None]:
        """Read what a join decides on before its round is sealed: ``(view, token)``."""
        return self.read()

    def wait(
        self,
        node: str,
        view: StateView | None,
        token: Token | None,
        round_id: int,
        timeout: float,
        attempt: int,
        join_left: float,
    ) -> Waited:
        """Wait up to ``timeout`` for the state to differ from ``token``; read what a join needs.

        ``view`` and ``token`` are what the join last read, ``round_id`` the
        round it joins, ``attempt`` counts the waits before (the backoff of
        polling), ``join_left`` the seconds before the join deadline.

        Returns:
            ``(view, token, member)``: ``node``'s membership when a stored
            seat of ``round_id`` told it (``view`` is then the one before).
        """
        return (*self._wait(token, timeout, attempt), None)

    def _wait(self, token: Token | None, timeout: float, attempt: int) -> Read:
        self._clock.sleep(min(timeout, poll_backoff(attempt)))
        return self.read()

    def changed(self, token: Token) -> bool:
        """Tell whether the state was written after the write of ``token``."""
        return self.changed_since(token)[0]

    def changed_since(self, token: Token) -> tuple[bool, RendezvousState | None]:
        """Tell whether the state changed since the write of ``token``; read it if it did.

        Returns ``(changed, state)``: the stored state, or None when it is
        not stored or was not read (a seated backend whose token is unchanged).
        """
        state, current = self.read()
        return current is None or current != token, state


class WatchedState(SharedState):
    """The shared state of a backend that watches it: a wait ends at the next write."""

    def _wait(self, token: Token | None, timeout: float, attempt: int) -> Read:
        found = cast(WatchableBackend, self._backend).wait_for_state(token, timeout)
        return (None, None) if found is None else (self._decode(found[0]), found[1])


class SeatedState(SharedState):
    """The shared state of a backend that stores seats and the state's summary (see the module)."""

    @property
    def _seated(self) -> SeatedBackend:
        return cast(SeatedBackend, self._backend)

    def _set(
        self, state: RendezvousState, data: bytes, token: Token | None, seats: Seats
    ) -> Written:
        stored = {**(seats or {}), SUMMARY_SEAT: encode_summary(StateSummary.of(state))}
        return self._seated.set_state_seated(data, token, stored)

    def seats(self, plan: RendezvousState, marks: Marks) -> Mapping[str, bytes] | None:
        """Return every live member's seat in ``plan``, each with its successor's mark."""
        return seats_of(plan, marks(plan))

    def read_view(self) -> tuple[StateView | None, Token | None]:
        """Read the summary of the stored state, when stored with it; the state otherwise."""
        # A write between the two reads replaces the summary read for: read
        # the newer one (members re-joining together race with the leave).
        for _ in range(_SUMMARY_ATTEMPTS):
            token = self._seated.read_token()
            if token is None:
                return None, None
            summary = self._summary(token)
            if summary is not None:
                return summary, token
        return self.read()

    def _summary(self, token: Token) -> StateSummary | None:
        """Return the summary the write of ``token`` stored; None when it stored none or was replaced."""
        raw = self._seated.read_seat(token, SUMMARY_SEAT)
        return None if raw is None else decode_summary(raw)

    def _wait_seat(
        self, token: Token | None, timeout: float, node: str
    ) -> tuple[Token | None, Seat | None]:
        """Wait for a write that seats ``node``: ``(token, seat)``, the seat None if it did not.

        The backend may return earlier, at any write (see
        :meth:`~rdzv.backends.base.SeatedBackend.wait_for_seat`).
        """
        current = self._seated.wait_for_seat(token, node, timeout)
        if current is None or current == token:
            return current, None
        raw = self._seated.read_seat(current, node)
        return current, None if raw is None else decode_seat(raw)

    def wait(
        self,
        node: str,
        view: StateView | None,
        token: Token | None,
        round_id: int,
        timeout: float,
        attempt: int,
        join_left: float,
    ) -> Waited:
        """Wait for a write; read ``node``'s seat first, its summary next, the state last.

        A node seated in ``round_id`` by the new token is a member without
        reading the participant list. Otherwise the new write's summary is
        read, and the state whole only when that write sealed ``round_id`` or a
        later round (a summary cannot tell a member) or stored none. Once the
        summary says ``round_id`` is sealed, the node waits for its seat
        (:func:`~rdzv.dynamic.pacing.seat_wait`), ``timeout`` or not, but never
        past ``join_left``. The member's sealed mark is stamped with this
        state's clock.
        """
        current, seat = self._wait_seat(token, timeout, node)
        if seat is None or seat.round != round_id:
            if current == token:
                return view, token, None
            summary = None if current is None else self._summary(current)
            if summary is None and current is not None:
                # A later write replaced the summary read for: read the newest (as read_view).
                newest, current = self.read_view()
                if not isinstance(newest, StateSummary):
                    return newest, current, None
                summary = newest
            if summary is not None and summary.round < round_id:
                return summary, current, None
            if summary is None or summary.round != round_id or summary.closed:
                return (*self.read(), None)
            # Sealed, and members' seats follow the seal's compare-and-set: this
            # node's may be on its way; reading the whole state instead would
            # cost every member of a large round the participant list.
            current, seat = self._wait_seat(token, seat_wait(join_left), node)
            if seat is None or seat.round != round_id:
                return (*self.read(), None)
        sealed = seat.sealed_mark
        if sealed is not None:
            seat = replace(seat, sealed_mark=replace(sealed, read_at=self._clock()))
        return view, token, Member(seat, current, None)

    def changed(self, token: Token) -> bool:
        """Tell from the token alone whether the state was written after the write of ``token``."""
        return bool(self._seated.read_token() != token)

    def changed_since(self, token: Token) -> tuple[bool, RendezvousState | None]:
        """As :meth:`SharedState.changed_since`; "unchanged" is told from the token alone."""
        return super().changed_since(token) if self.changed(token) else (False, None)
