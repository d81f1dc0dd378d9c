"""The rendezvous error tree.

Every error rdzv raises on purpose is a :class:`RendezvousError`. The split
that matters to callers is *retryable* versus *final*:

* :class:`RendezvousConnectionError` -- the backend could not be reached;
  retrying later may succeed.
* :class:`RendezvousClosedError`, :class:`RendezvousTimeoutError`,
  :class:`RendezvousStateError` -- final for this attempt.
* :class:`RendezvousGracefulExitError` -- not a failure: this node is not
  needed and should exit cleanly.
"""

from __future__ import annotations

__all__ = [
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousExhaustedError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StoreAuthenticationError",
    "StoreTimeoutError",
    "explained",
    "with_detail",
]


class RendezvousError(Exception):
    """Base type of every rendezvous error."""


class RendezvousClosedError(RendezvousError):
    """Raised when the rendezvous (the run) has been closed."""


class RendezvousTimeoutError(RendezvousError):
    """Raised when a rendezvous or store operation did not complete in time."""


class RendezvousConnectionError(RendezvousError):
    """Raised when the connection to a rendezvous backend or store failed."""


class RendezvousStateError(RendezvousError):
    """Raised when the stored rendezvous state is corrupt or does not validate."""


class RendezvousGracefulExitError(RendezvousError):
    """Raised when this node is not part of the run and should exit cleanly.

    This is a way to unwind the stack, not a failure: a launcher that catches
    it exits with status 0.
    """


class RendezvousExhaustedError(RendezvousTimeoutError):
    """Raised when the join window elapsed without reaching ``min_nodes``.

    It is a :class:`RendezvousTimeoutError`, so ``except`` clauses written for
    torch's error tree still catch it.

    Args:
        config: A description of the rendezvous that was attempted (for
            example ``"run_id=job min_nodes=4 max_nodes=8"``) or any object
            whose ``str()`` names it.
        timeout: The join timeout, in seconds, that elapsed.
    """

    def __init__(self, config: object, timeout: float) -> None:
        self.config = config
        self.timeout = float(timeout)
        super().__init__(
            f"the join window of {self.timeout:g} s elapsed without reaching min nodes ({config})"
        )


class StoreTimeoutError(RendezvousTimeoutError):
    """Raised when a store operation (``get``, ``wait``, ...) timed out."""


class StoreAuthenticationError(RendezvousError):
    """Raised when a store client and server could not authenticate each other.

    It is final, not retryable: the shared secret (``auth_token``) is missing,
    wrong, or the server cannot authenticate at all (torch's server).
    """


def with_detail(exc: BaseException, detail: str) -> BaseException:
    """Attach rdzv's ``detail`` to ``exc`` as a note and return ``exc``.

    The message stays torch's text, which callers and torch's tests match
    exactly; the detail shows in tracebacks and in :func:`explained`.
    """
    notes = getattr(exc, "__notes__", None)
    if notes is None:
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined]  # add_note() is 3.11+
    notes.append(detail)
    return exc


def explained(exc: BaseException) -> str:
    """Return ``exc``'s message followed by its notes, on one line (for a CLI)."""
    return " ".join([str(exc), *getattr(exc, "__notes__", ())])
