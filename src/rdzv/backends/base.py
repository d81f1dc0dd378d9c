"""The rendezvous backend contract.

A backend keeps one opaque state blob per run and offers compare-and-set on
a fencing token:

* ``get_state()`` returns ``(state, token)``, or None when nothing is stored.
* ``set_state(state, token)``:

  - token matches the stored one: write; return ``(state, new_token, True)``;
  - token stale or invalid: no write; return ``(current, current_token, False)``;
  - token None: write only if nothing is stored yet (else as "stale").

Tokens are opaque; callers only hand back what they received.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["RendezvousBackend", "Token"]

Token = Any


class RendezvousBackend(ABC):
    """Stores the rendezvous state of one run, with compare-and-set."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The name of the backend (``c10d``, ``etcd``, ...)."""

    @abstractmethod
    def get_state(self) -> tuple[bytes, Token] | None:
        """Read the state.

        Returns:
            ``(state, token)``, or None when no state is stored.

        Raises:
            RendezvousConnectionError: The backend cannot be reached.
            RendezvousStateError: The stored record is corrupt.
        """

    @abstractmethod
    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write the state if ``token`` is current.

        Args:
            state: The new state.
            token: The token from the last read, or None to create.

        Returns:
            ``(state, token, written)``: the state and token now stored and
            whether this call wrote them; None if nothing is stored.

        Raises:
            RendezvousConnectionError: The backend cannot be reached.
            RendezvousStateError: The stored record is corrupt.
        """
