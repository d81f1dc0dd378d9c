"""The rendezvous backend contract.

A backend keeps one opaque state blob per run and offers compare-and-set on
a fencing token:

* ``get_state()`` returns ``(state, token)``, or None when nothing is stored.
* ``set_state(state, token)``:

  - token matches the stored one: write; return ``(state, new_token, True)``;
  - token stale or invalid: no write; return ``(current, current_token, False)``;
  - token None: write only if nothing is stored yet (else as "stale").

Tokens are opaque; callers only hand back what they received. Every method
may raise ``RendezvousConnectionError`` (retryable: the backend could not be
reached) and, where it reads the state, ``RendezvousStateError`` (the stored
record is corrupt); a method names any other exception it raises.

Optional capabilities (below the contract) let a backend do better than
compare-and-set on one blob: :class:`WatchableBackend` (block until the state
changes), :class:`JoinQueueBackend` (one non-conflicting write per joining
node), :class:`LivenessBackend` (per-node heartbeats judged on the
observer's clock), :class:`SeatedBackend` (a seal that also stores each
member's own small record, so that a member of thousands reads O(1)
bytes) and :class:`VerdictBackend` (a sealed round's verdict waited for
together with the state). The handler uses each when present and degrades to polling and
compare-and-set when not. ``rdzv.testing.conformance`` checks a backend
against all of it.
"""

from __future__ import annotations

import copy
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar, Union

__all__ = [
    "GONE_MARK",
    "MAX_RECORD_SIZE",
    "BackendLike",
    "ForeignBackend",
    "JoinQueueBackend",
    "ListedBackend",
    "LivenessBackend",
    "NamedQueues",
    "RendezvousBackend",
    "SeatedBackend",
    "Token",
    "TorchBackendAPI",
    "VerdictBackend",
    "WatchableBackend",
    "MAX_RUN_ID",
    "as_backend",
    "is_pseudo_node",
    "revision_token",
    "validate_node_key",
    "validate_run_id",
    "validate_record",
    "validate_seats",
]

Token = Any

_Named = TypeVar("_Named", bound="NamedQueues")


class RendezvousBackend(ABC):
    """Stores the rendezvous state of one run, with compare-and-set."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The name of the backend (``c10d``, ``etcd``, ...)."""

    @abstractmethod
    def get_state(self) -> tuple[bytes, Token] | None:
        """Read the state: ``(state, token)``, or None when no state is stored."""

    @abstractmethod
    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write the state if ``token`` (from the last read, None to create) is current.

        Returns ``(state, token, written)``: the state and token now stored
        and whether this call wrote them; None if nothing is stored.
        """

    def side_channel(self) -> RendezvousBackend:
        """Return a view of this backend whose calls never wait behind its blocking ones.

        A backend whose client serialises requests (one TCP store
        connection) would make a write from a background thread (the
        keep-alive's eviction) wait behind a watch of the joining thread.
        Backends whose clients serve threads concurrently return themselves
        (the default). The view shares this backend's state and tokens; the
        owner closes only this backend.
        """
        return self

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release the backend's connections; the default holds none.

        Called once by the owner of the backend (the handler built by
        ``create_handler``, ``rdzv status``); the backend is not used after.
        """


class TorchBackendAPI(Protocol):
    """A backend written against torch's ``RendezvousBackend``: the contract, nothing more."""

    @property
    def name(self) -> str:  # noqa: D102
        ...

    def get_state(self) -> tuple[bytes, Token] | None:  # noqa: D102
        ...

    def set_state(  # noqa: D102
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None: ...


BackendLike = Union[RendezvousBackend, TorchBackendAPI]  # noqa: UP007 - a runtime alias on 3.10
"""What the dynamic handler takes as a backend: rdzv's, or one with torch's API."""


class ForeignBackend(RendezvousBackend):
    """A backend with torch's ``RendezvousBackend`` API behind rdzv's contract.

    torch documents its backend as ``name``, ``get_state`` and
    ``set_state``; a backend written against that (a subclass of torch's
    ABC, usually) has no :meth:`~RendezvousBackend.side_channel` nor
    :meth:`~RendezvousBackend.close`. This one is its own side channel and
    closes nothing (the caller owns the backend it built); it offers no
    capability, so the handler keeps joins and heartbeats in its store.
    Built by :func:`as_backend`.

    Args:
        inner: The backend.
    """

    def __init__(self, inner: TorchBackendAPI) -> None:
        self._inner = inner

    @property
    def name(self) -> str:
        """The backend's own name."""
        return self._inner.name

    def get_state(self) -> tuple[bytes, Token] | None:  # noqa: D102 - see RendezvousBackend
        return self._inner.get_state()

    def set_state(  # noqa: D102 - see RendezvousBackend
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        return self._inner.set_state(state, token)

    def __repr__(self) -> str:
        return f"ForeignBackend({self._inner!r})"


def as_backend(backend: BackendLike) -> RendezvousBackend:
    """Return ``backend`` as rdzv's: itself, or a :class:`ForeignBackend` around it.

    Raises:
        TypeError: ``backend`` is no rdzv backend and lacks part of torch's
            backend API; the message names what it lacks.
    """
    if isinstance(backend, RendezvousBackend):
        return backend
    missing = [name for name in ("name", "get_state", "set_state") if not hasattr(backend, name)]
    if missing:
        raise TypeError(
            f"{type(backend).__name__} is neither an rdzv RendezvousBackend nor a backend with "
            f"torch's API: it lacks {', '.join(missing)}"
        )
    return ForeignBackend(backend)


# ---------------------------------------------------------------------------
# Optional capabilities.
#
# A backend offers a capability by also subclassing its ABC; the handler
# checks with ``isinstance``. All timeouts are in seconds, measured on the
# caller's monotonic clock; a timeout of 0 means "look once, do not block".
#
# Round numbers are non-negative integers chosen by the handler; a backend
# only uses them to name its records. Node keys are non-empty strings of at
# most 256 printable characters without whitespace.
# ---------------------------------------------------------------------------

_ASCII_NODE_KEY = re.compile(r"[\x21-\x7e]{1,256}")

#: The largest join record a backend must accept, in bytes.
MAX_RECORD_SIZE = 4096


class WatchableBackend(ABC):
    """Capability: block until the state changes, instead of polling (each engine's module says how)."""

    @abstractmethod
    def wait_for_state(self, token: Token | None, timeout: float) -> tuple[bytes, Token] | None:
        """Wait until the stored state's token differs from ``token``.

        Returns as soon as the state was written after the write that
        produced ``token`` (``token`` None: as soon as any state exists), or
        when ``timeout`` elapsed. Spurious early returns are allowed: callers
        compare the token they get back. Returns ``(state, token)`` as
        stored when the call returns, or None when nothing is stored.
        """


class SeatedBackend(ABC):
    """Capability: a write that also stores one small *seat* per member, each read alone.

    A member learns its round, rank, world size and bootstrap address from
    its seat, whose size does not grow with the round, instead of reading
    the whole participant list: at N members that is N small reads in all
    instead of N reads of O(N) bytes. A seat belongs to the write that
    stored it: :meth:`read_seat` answers for one token and nothing else, so
    a seat stored by a write that lost its compare-and-set, or one that a
    later write replaced, is never taken for the current one.
    """

    @abstractmethod
    def set_state_seated(
        self, state: bytes, token: Token | None, seats: Mapping[str, bytes]
    ) -> tuple[bytes, Token, bool] | None:
        """Write the state as :meth:`RendezvousBackend.set_state`, with ``seats``.

        Once the write wins, :meth:`read_seat` with the returned token
        returns ``seats[node]`` for every node of ``seats``: at once on this
        backend's connection, and as soon as the store has taken the request
        on others (the store backend sends the members' seats last and
        does not wait for them; :meth:`wait_for_seat` waits for them).

        Raises:
            ValueError: A node key or a seat (at most :data:`MAX_RECORD_SIZE`
                bytes) is invalid.
        """

    @abstractmethod
    def read_token(self) -> Token | None:
        """Return the stored state's token (None when nothing is stored) without the state."""

    @abstractmethod
    def wait_for_token(self, token: Token | None, timeout: float) -> Token | None:
        """Wait as :meth:`WatchableBackend.wait_for_state`; return the token alone."""

    def wait_for_seat(self, token: Token | None, node: str, timeout: float) -> Token | None:
        """Wait as :meth:`wait_for_token`, sleeping through writes that seat not ``node``.

        A node waiting to be seated needs no wake-up for a write that
        stores no seat for it (a leave, an eviction): in a recovery of
        thousands each such write woke every waiting node at once. A
        backend that can tell returns only once a newer committed write
        seated ``node``, with that write's token (a later write may have
        replaced it since: the caller checks, as after any read), or when
        ``timeout`` passes, with the token stored then, changed or not; the
        caller looks at the token either way. By default it is
        :meth:`wait_for_token`, which is also correct.

        Raises:
            ValueError: ``node`` is not a valid node key.
        """
        validate_node_key(node)
        return self.wait_for_token(token, timeout)

    @abstractmethod
    def read_seat(self, token: Token, node: str) -> bytes | None:
        """Return the seat that the write of ``token`` stored for ``node``.

        None when that write stored none for ``node`` (or, on some backends,
        once a later seated write replaced it).

        Raises:
            ValueError: ``node`` is not a valid node key.
        """


class ListedBackend(ABC):
    """Capability: the runs kept beside this one are listed, and each opened.

    The store backend keeps every run under its own prefix of one store, so
    the store's keys name them (``rdzv status --list-runs``).
    """

    @abstractmethod
    def runs(self) -> list[str]:
        """Return the ids of the runs kept beside this one, sorted."""

    @abstractmethod
    def of_run(self, run_id: str) -> RendezvousBackend:
        """Return a backend of ``run_id`` beside this one, sharing its client (closing it closes nothing)."""


class JoinQueueBackend(ABC):
    """Capability: an append-only, per-round queue of join records.

    Each joining node makes ONE non-conflicting write (:meth:`enqueue`), so a
    formation costs a number of backend writes linear in the number of
    nodes, with no compare-and-set storm. The queue of round ``r + 1`` while
    round ``r`` runs is the wait list.

    Rules every implementation keeps:

    * :meth:`enqueue` appends atomically and returns a 1-based position;
      the positions handed out for one round are distinct and gap-free
      (1, 2, 3, ...). Positions decide roles (who seals), not admission.
    * :meth:`queue_records` returns the records in the order the backend
      serialised the appends; that order never changes (records are only
      added at the end), and it may differ from the order of positions.
    * Once ``enqueue`` returned ``k``, :meth:`queue_records` returns at least
      ``k`` records, this one among them.
    * :meth:`queue_length` is the number of appended records; it only grows
      until :meth:`drop_queue`.
    * ``enqueue`` is not idempotent: a retry after a lost reply may append
      the record twice. Readers deduplicate records themselves.
    """

    @abstractmethod
    def enqueue(self, round_id: int, record: bytes) -> int:
        """Append ``record`` to the queue of ``round_id``; return its 1-based position.

        Raises:
            ValueError: ``round_id`` is negative or the record is empty or
                larger than :data:`MAX_RECORD_SIZE`.
        """

    @abstractmethod
    def queue_records(self, round_id: int) -> list[bytes]:
        """Return the records of the queue of ``round_id`` (empty when none), in append order."""

    @abstractmethod
    def queue_length(self, round_id: int) -> int:
        """Return how many records the queue of ``round_id`` holds, without blocking."""

    @abstractmethod
    def wait_queue_length(self, round_id: int, known: int, timeout: float) -> int:
        """Wait until the queue length of ``round_id`` differs from ``known``; return it.

        On timeout the length returned is ``known``.
        """

    def confirmation_queue(self) -> JoinQueueBackend | None:
        """Return a queue of this kind under other keys, for the confirmations of sealed rounds.

        Once a round is sealed, each member appends one record to the
        confirmation queue of that round (:mod:`rdzv.dynamic.confirm`); an
        engine offers its own so that confirming costs what joining costs
        (one write, no compare-and-set, no wake-up of other waiters). The
        same rules hold as for join queues. None (this default) when the
        engine offers none: the handler then keeps confirmations in its store.
        """
        return None

    @abstractmethod
    def drop_queue(self, round_id: int) -> None:
        """Delete the queue of ``round_id`` (idempotent; a round nobody reads)."""


class VerdictBackend(ABC):
    """Capability: a sealed round's verdict kept beside the state, and one wait for both.

    Every member of a sealed round confirms it and then waits for the
    verdict, which the member that counts the last confirmation writes
    (:mod:`rdzv.dynamic.confirm`), and meanwhile for a write of the state,
    which could mean a member was lost. Without this capability the
    handler keeps the verdict in its store and reads the state between the
    slices of its wait; a backend that offers it waits for both at once
    (etcd: one watch of the state's head and the verdict; Redis: one
    ``XREAD`` of the state's change stream, which the verdict also writes).
    """

    @abstractmethod
    def set_verdict(self, round_id: int) -> None:
        """Record that every member of ``round_id`` confirmed it."""

    @abstractmethod
    def wait_for_verdict(self, round_id: int, token: Token, timeout: float) -> bool | None:
        """Wait until the verdict of ``round_id`` exists or the state is written after ``token``.

        Returns True for the verdict (stored before or during the call),
        False when the state was written after the write that produced
        ``token`` (the caller reads it), None when ``timeout`` passed with
        neither.
        """

    @abstractmethod
    def drop_verdict(self, round_id: int) -> None:
        """Delete the verdict of ``round_id`` (idempotent; a round nobody waits on)."""


class NamedQueues(JoinQueueBackend):
    """A join-queue engine whose queues live under a name: ``queue`` for joins, ``confirm`` for confirmations.

    The engine builds its queue keys from ``_queue_name``; :meth:`confirmation_queue`
    is a shallow copy of the engine under the other name, sharing its client
    but not owning it (closing the view closes nothing).
    """

    _queue_name = "queue"
    _owns_client = False

    def confirmation_queue(self: _Named) -> _Named:
        """Return a view of this engine (owning no client) whose queues are the confirmations."""
        view = copy.copy(self)
        view._queue_name = "confirm"
        view._owns_client = False
        return view


GONE_MARK = b"gone"
"""The heartbeat mark of a node whose process is known to have died
(:meth:`LivenessBackend.present`). Observers judge it dead after a short
grace (:data:`rdzv.dynamic.judging.GONE_GRACE`), not the dead-node timeout."""


class LivenessBackend(ABC):
    """Capability: per-node heartbeats that never touch the shared state.

    A node calls :meth:`beat` every keep-alive interval; it writes only that
    node's own record. An observer reads a node's :meth:`heartbeat_mark` and
    judges the node dead when the mark has not changed for the dead-node
    timeout measured on the OBSERVER's monotonic clock, so wall clocks never
    enter the decision. A backend with server-side expiry (etcd lease, Redis
    ``PX`` key) may return None as soon as the server expired the record:
    None means "no live record", and observers treat a None mark that stays
    None like an unchanged mark.
    """

    @abstractmethod
    def beat(self, node: str) -> None:
        """Record a heartbeat of ``node``: its mark changes.

        Raises:
            ValueError: The node key is invalid.
        """

    @abstractmethod
    def heartbeat_mark(self, node: str) -> bytes | None:
        """Return an opaque value that changes on every beat of ``node``.

        None when the node never beat (or its record expired on the server,
        or was forgotten).
        """

    def heartbeat_marks(self, nodes: Sequence[str]) -> dict[str, bytes | None]:
        """Return the marks of several nodes; backends that can, read them in one call.

        Returns ``{node: mark}``; this default calls :meth:`heartbeat_mark` once per node.
        """
        return {node: self.heartbeat_mark(node) for node in nodes}

    @abstractmethod
    def forget(self, node: str) -> None:
        """Delete the heartbeat record of ``node`` (idempotent)."""

    def present(self, node: str) -> None:
        """Have ``node``'s mark become :data:`GONE_MARK` as soon as this process dies.

        A backend that can tell (rdzv's TCP store: a will on a connection
        of its own, written by the server when the kernel closes the
        connection of a killed process) does so; by default nothing
        happens, and a death is found by the heartbeats alone. Idempotent.
        """
        return

    def absent(self, node: str) -> None:
        """Stop what :meth:`present` started, cleanly: the mark is left as it is."""
        return


MAX_RUN_ID = 200
"""The longest run id, in characters: it names keys on every engine, and with
the longest prefix and suffix a key must stay within every store's limits."""


def validate_run_id(run_id: str) -> str:
    """Check that ``run_id`` can name a run's keys on every backend, and return it.

    Raises:
        ValueError: It is empty (torch's message: ``The run id must be a
            non-empty string.``), longer than :data:`MAX_RUN_ID` characters, or
            holds whitespace or control characters (printed escaped).
    """
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"The run id must be a non-empty string. Got {run_id!r}.")
    if len(run_id) > MAX_RUN_ID:
        raise ValueError(
            f"run_id is {len(run_id)} characters long; the limit is {MAX_RUN_ID} "
            f"(it names the run's keys): {run_id[:40]!r}..."
        )
    if not run_id.isprintable() or any(ch.isspace() for ch in run_id):
        raise ValueError(f"run_id must hold no whitespace or control characters, got {run_id!r}")
    return run_id


def validate_node_key(node: str) -> str:
    """Check that ``node`` is a valid node key and return it.

    Raises:
        ValueError: It is empty, longer than 256 characters, or holds
            whitespace or non-printable characters.
    """
    if isinstance(node, str) and _ASCII_NODE_KEY.fullmatch(node):
        return node  # the common case, checked in one regex match
    if (
        not isinstance(node, str)
        or not node
        or len(node) > 256
        or not node.isprintable()
        or any(ch.isspace() for ch in node)
    ):
        raise ValueError(
            f"a node key must be 1-256 printable characters without whitespace, got {node!r}"
        )
    return node


def validate_record(round_id: int, record: bytes) -> None:
    """Check the arguments of :meth:`JoinQueueBackend.enqueue`.

    Raises:
        ValueError: The round is negative or the record is empty or too large.
    """
    if isinstance(round_id, bool) or not isinstance(round_id, int) or round_id < 0:
        raise ValueError(f"round_id must be a non-negative integer, got {round_id!r}")
    if not isinstance(record, bytes) or not 1 <= len(record) <= MAX_RECORD_SIZE:
        size = len(record) if isinstance(record, bytes) else type(record).__name__
        raise ValueError(f"a join record must be 1-{MAX_RECORD_SIZE} bytes, got {size}")


def is_pseudo_node(key: str) -> bool:
    """Tell whether a seat's key names a pseudo-node: a seat about the write, not a member.

    No node key starts with ``#`` (its address comes first), so such a seat
    (the state's summary) can never be taken for a member's.
    """
    return key.startswith("#")


def validate_seats(seats: Mapping[str, bytes]) -> None:
    """Check the seats (``{node key: seat}``) of :meth:`SeatedBackend.set_state_seated`.

    Raises:
        ValueError: A node key is invalid, or a seat is empty or larger
            than :data:`MAX_RECORD_SIZE`.
    """
    for node, seat in seats.items():
        validate_node_key(node)
        if not isinstance(seat, bytes) or not 1 <= len(seat) <= MAX_RECORD_SIZE:
            raise ValueError(f"the seat of {node} must be 1-{MAX_RECORD_SIZE} bytes")


def revision_token(token: Token | None) -> int | None:
    """Return the revision an integer token stands for, 0 for None, None if it is not one.

    For the backends whose tokens are revisions in ``1 .. 2**63 - 1``.
    """
    if token is None:
        return 0
    if isinstance(token, bool) or not isinstance(token, int) or not 1 <= token < 2**63:
        return None
    return token
