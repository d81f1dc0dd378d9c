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
  the caller's: :class:`rdzv.retry.Retry`);
* :meth:`SharedState.wait` blocks until the state changes (the backend's
  watch) or polls with backoff;
* with a :class:`~rdzv.backends.base.SeatedBackend`, a write may carry the
  members' seats (:mod:`rdzv.dynamic.seat`) and always carries the state's
  summary, :meth:`SharedState.wait_seat` waits for the token alone and
  reads this node's seat, :meth:`SharedState.read_summary` and
  :meth:`SharedState.read_view` read the summary instead of the state, and
  :meth:`SharedState.changed_since` tells from the
  token alone that nothing changed: a member of a large round then never
  reads the participant list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rdzv.backends.base import RendezvousBackend, SeatedBackend, Token, WatchableBackend
from rdzv.dynamic.seat import SUMMARY_SEAT, Seat, decode_seat
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

__all__ = ["SharedState"]

CAS_ATTEMPTS = 64
"""Compare-and-set attempts of one update before it gives up."""
_SUMMARY_ATTEMPTS = 3
"""Reads of the token and its summary before :meth:`SharedState.read_view` reads the state."""

Change = Callable[[RendezvousState | None], RendezvousState | None]


class SharedState:
    """The run's state in a backend, decoded and written with compare-and-set.

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

    def read(self) -> tuple[RendezvousState | None, Token | None]:
        """Read the state.

        Returns:
            ``(state, token)``; ``(None, None)`` when nothing is stored.

        Raises:
            RendezvousConnectionError: The backend cannot be reached.
            RendezvousStateError: The stored state is corrupt.
        """
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

    @property
    def seated(self) -> bool:
        """Whether the backend stores seats (:class:`~rdzv.backends.base.SeatedBackend`)."""
        return isinstance(self._backend, SeatedBackend)

    def write(
        self,
        state: RendezvousState,
        data: bytes,
        token: Token | None,
        seats: Mapping[str, bytes] | None = None,
    ) -> tuple[bytes, Token, bool] | None:
        """Compare-and-set the encoded state.

        On a seated backend the state's summary is stored with it, as the
        seat of :data:`~rdzv.dynamic.seat.SUMMARY_SEAT`.

        Args:
            state: The state.
            data: ``encode_state(state)``.
            token: The token of the last read, or None to create.
            seats: The members' encoded seats, stored with the state when the
                backend is seated (ignored otherwise).

        Returns:
            ``(stored, token, written)``, or None when nothing is stored.

        Raises:
            RendezvousStateError: The backend broke the contract (see the module).
            RendezvousConnectionError: The backend cannot be reached.
        """
        backend = self._backend
        if isinstance(backend, SeatedBackend):
            stored = {**(seats or {}), SUMMARY_SEAT: encode_summary(StateSummary.of(state))}
            result = backend.set_state_seated(data, token, stored)
        else:
            result = backend.set_state(data, token)
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

    def update(
        self, change: Change, deadline: float | None = None
    ) -> tuple[RendezvousState | None, bool]:
        """Apply ``change`` to the stored state with compare-and-set, retrying on conflicts.

        Args:
            change: Given the stored state, returns the state to write, or
                None when no write is needed.
            deadline: Give up after this reading of this state's clock, or None.

        Returns:
            ``(written, settled)``: the state this call wrote (None if none),
            and False when it gave up (attempts spent or deadline passed).

        Raises:
            RendezvousConnectionError: The backend cannot be reached.
            RendezvousStateError: The stored state is corrupt.
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

    def wait(
        self, token: Token | None, timeout: float, attempt: int
    ) -> tuple[RendezvousState | None, Token | None]:
        """Wait up to ``timeout`` for the state to differ from ``token``, then read it.

        Args:
            token: The token of the last read.
            timeout: Seconds to wait at most.
            attempt: How many polls came before (sets the backoff of
                backends without watches).

        Returns:
            ``(state, token)`` as :meth:`read`.
        """
        if isinstance(self._backend, WatchableBackend):
            found = self._backend.wait_for_state(token, timeout)
            return (None, None) if found is None else (self._decode(found[0]), found[1])
        self._clock.sleep(min(timeout, poll_backoff(attempt)))
        return self.read()

    def wait_seat(
        self, token: Token | None, timeout: float, node: str
    ) -> tuple[Token | None, Seat | None]:
        """Wait up to ``timeout`` for a write that seats ``node``; read its seat if the token changed.

        The backend may return earlier, at any write (see
        :meth:`~rdzv.backends.base.SeatedBackend.wait_for_seat`).

        Only for a seated backend (:attr:`seated`).

        Args:
            token: The token of the last read.
            timeout: Seconds to wait at most.
            node: This node's key.

        Returns:
            ``(token, seat)``: the stored token, and this node's seat stored
            with it (None when the token did not change or the write that
            produced it stored no seat for ``node``).

        Raises:
            RendezvousConnectionError: The backend cannot be reached.
            RendezvousStateError: The stored record or the seat is corrupt.
        """
        backend = self._backend
        assert isinstance(backend, SeatedBackend)
        current = backend.wait_for_seat(token, node, timeout)
        if current is None or current == token:
            return current, None
        raw = backend.read_seat(current, node)
        return current, None if raw is None else decode_seat(raw)

    def read_view(self) -> tuple[RendezvousState | StateSummary | None, Token | None]:
        """Read what a join decides on before its round is sealed.

        Returns:
            ``(view, token)``: on a seated backend the summary of the stored
            state, when stored with it; the state otherwise (as :meth:`read`).

        Raises:
            RendezvousConnectionError: The backend cannot be reached.
            RendezvousStateError: The stored record or summary is corrupt.
        """
        backend = self._backend
        if not isinstance(backend, SeatedBackend):
            return self.read()
        # A write between the two reads replaces the summary read for: read
        # the newer one (members re-joining together race with the leave).
        for _ in range(_SUMMARY_ATTEMPTS):
            token = backend.read_token()
            if token is None:
                return None, None
            summary = self.read_summary(token)
            if summary is not None:
                return summary, token
        return self.read()

    def read_summary(self, token: Token) -> StateSummary | None:
        """Return the summary the write of ``token`` stored (a seated backend only).

        Args:
            token: A token of this backend.

        Returns:
            The summary; None when that write stored none (an older rdzv
            wrote it) or a later write replaced it.

        Raises:
            RendezvousConnectionError: The backend cannot be reached.
            RendezvousStateError: The stored summary is corrupt.
        """
        backend = self._backend
        assert isinstance(backend, SeatedBackend)
        raw = backend.read_seat(token, SUMMARY_SEAT)
        return None if raw is None else decode_summary(raw)

    def changed_since(self, token: Token) -> tuple[bool, RendezvousState | None]:
        """Tell whether the state changed since the write of ``token``; read it if it did.

        A seated backend answers "unchanged" from the token alone, without
        reading the state.

        Args:
            token: A token of this backend.

        Returns:
            ``(changed, state)``: the stored state, or None when it is not
            stored or was not read (a seated backend whose token is
            unchanged).

        Raises:
            RendezvousConnectionError: The backend cannot be reached.
            RendezvousStateError: The stored record is corrupt.
        """
        backend = self._backend
        if isinstance(backend, SeatedBackend) and backend.read_token() == token:
            return False, None
        state, current = self.read()
        return current is None or current != token, state
