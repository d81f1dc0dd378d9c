"""The public rendezvous API: timeouts, settings, parameters, results and the handler ABC.

Names and shapes follow ``torch.distributed.elastic.rendezvous`` and the
``tensorplay.distributed.elastic.rendezvous`` spec, so code written for either
ports by changing an import.

Size: longer than the project's ~600-line guide on purpose: it mirrors
torch's ``api`` module, where these public types live together, and most of
its length is their documented validation (each with torch's message first).
"""

from __future__ import annotations

import dataclasses
import math
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Union, cast

from rdzv.backends.base import validate_run_id
from rdzv.errors import RendezvousStateError, RendezvousTimeoutError
from rdzv.net import primary_address
from rdzv.store.base import MAX_DURATION, Store, StoreLike

__all__ = [
    "DEFAULT_KEEP_ALIVE_INTERVAL",
    "DEFAULT_KEEP_ALIVE_MAX_ATTEMPT",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousSettings",
    "RendezvousStoreInfo",
    "RendezvousTimeout",
]

Duration = Union[timedelta, float, int]  # noqa: UP007 - a runtime alias on 3.10

DEFAULT_KEEP_ALIVE_INTERVAL = 5
"""Seconds between a node's heartbeats (``keep_alive_interval``)."""

DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 3
"""Heartbeats a node may miss before it is judged dead (``keep_alive_max_attempt``)."""


def _duration(
    value: Duration | None, default: timedelta, name: str, torch_message: bool = True
) -> timedelta:
    """Return ``value`` as a positive ``timedelta`` of at most :data:`MAX_DURATION`.

    A non-positive value gets torch's message (``The join timeout (0:00:00)
    must be positive.``) when ``torch_message``, for the timeouts torch checks.
    """
    if value is None:
        return default
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name} must be a timedelta or seconds, not {type(value).__name__}")
    if not seconds > 0:
        if not torch_message:
            raise ValueError(f"{name} must be positive, got {value!r}")
        if isinstance(value, timedelta):
            raise ValueError(f"The {name} timeout ({value}) must be positive.")
        shown = repr(value) if math.isnan(seconds) else str(timedelta(seconds=seconds))
        raise ValueError(f"The {name} timeout ({shown}) must be positive. Got {value!r} s.")
    if not seconds <= MAX_DURATION:
        raise ValueError(
            f"the {name} timeout must be finite and at most {MAX_DURATION:g} s (a year), "
            f"got {value!r}"
        )
    return timedelta(seconds=seconds)


class RendezvousTimeout:
    """The timeouts of a rendezvous.

    Args:
        join: How long to wait for the rendezvous to complete (600 s).
        last_call: How long to wait for more nodes once ``min_nodes`` have
            joined (30 s).
        close: How long to wait for ``set_closed`` to take effect (30 s).
        heartbeat: Accepted and kept for compatibility (5 s), and not read:
            torch documents it as the time within which a keep-alive
            heartbeat is expected to complete, and its handler does not read
            it either. A node is judged dead after ``keep_alive_interval *
            keep_alive_max_attempt`` seconds without a beat (see
            :class:`RendezvousSettings`).

    Each accepts a ``timedelta``, seconds, or None for the default.

    Raises:
        ValueError: A timeout is zero or negative (torch's message: ``The join
            timeout (0:00:00) must be positive.``), or longer than a year.
    """

    _DEFAULT_JOIN: ClassVar[timedelta] = timedelta(seconds=600)
    _DEFAULT_LAST_CALL: ClassVar[timedelta] = timedelta(seconds=30)
    _DEFAULT_CLOSE: ClassVar[timedelta] = timedelta(seconds=30)
    _DEFAULT_HEARTBEAT: ClassVar[timedelta] = timedelta(seconds=5)

    __slots__ = ("_close", "_heartbeat", "_join", "_last_call")

    def __init__(
        self,
        join: Duration | None = None,
        last_call: Duration | None = None,
        close: Duration | None = None,
        heartbeat: Duration | None = None,
    ) -> None:
        self._join = _duration(join, self._DEFAULT_JOIN, "join")
        self._last_call = _duration(last_call, self._DEFAULT_LAST_CALL, "last_call")
        self._close = _duration(close, self._DEFAULT_CLOSE, "close")
        self._heartbeat = _duration(heartbeat, self._DEFAULT_HEARTBEAT, "heartbeat")

    @property
    def join(self) -> timedelta:
        """The join timeout."""
        return self._join

    @property
    def last_call(self) -> timedelta:
        """The last-call timeout."""
        return self._last_call

    @property
    def close(self) -> timedelta:
        """The close timeout."""
        return self._close

    @property
    def heartbeat(self) -> timedelta:
        """The heartbeat timeout, kept for compatibility and not read (see the class)."""
        return self._heartbeat

    @staticmethod
    def from_params(params: RendezvousParameters) -> RendezvousTimeout:
        """Return the timeouts ``params`` configures (:attr:`RendezvousParameters.timeout`)."""
        return params.timeout

    def __repr__(self) -> str:
        return (
            f"RendezvousTimeout(join={self.join.total_seconds():g}, "
            f"last_call={self.last_call.total_seconds():g}, "
            f"close={self.close.total_seconds():g}, "
            f"heartbeat={self.heartbeat.total_seconds():g})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RendezvousTimeout):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def _values(self) -> tuple[timedelta, ...]:
        return (self.join, self.last_call, self.close, self.heartbeat)


def _check_node_counts(min_nodes: int, max_nodes: int, nodes: str) -> None:
    """Check the node counts, with torch's messages (``nodes``: how torch names them)."""
    if isinstance(min_nodes, bool) or not isinstance(min_nodes, int):
        raise TypeError(f"min_nodes must be an integer, got {min_nodes!r}")
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int):
        raise TypeError(f"max_nodes must be an integer, got {max_nodes!r}")
    if min_nodes < 1:
        raise ValueError(f"The minimum number of {nodes} ({min_nodes}) must be greater than zero.")
    if max_nodes < min_nodes:
        raise ValueError(
            f"The maximum number of {nodes} ({max_nodes}) must be greater than or equal to "
            f"the minimum number of {nodes} ({min_nodes})."
        )


@dataclass(frozen=True)
class RendezvousSettings:
    """The settings of a rendezvous, fixed for its life.

    Args:
        run_id: The run (job) identifier.
        min_nodes: The fewest nodes a round needs.
        max_nodes: The most nodes a round admits.
        timeout: The timeouts; built from ``join``/``last_call``/``close``/
            ``heartbeat`` when None.
        keep_alive_interval: How often a node sends a heartbeat (5 s).
        keep_alive_max_attempt: Heartbeats a node may miss before it is
            considered dead (3).
        join: The join timeout, when ``timeout`` is not given.
        last_call: The last-call timeout, when ``timeout`` is not given.
        close: The close timeout, when ``timeout`` is not given.
        heartbeat: The heartbeat timeout, when ``timeout`` is not given.

    Raises:
        ValueError: ``run_id`` is empty, ``min_nodes < 1``,
            ``max_nodes < min_nodes``, or an interval is not positive.
    """

    #: The configuration keys :meth:`from_params` reads (every dynamic backend's).
    KEYS: ClassVar[frozenset[str]] = frozenset(
        {"join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "heartbeat"}
        | {"keep_alive_interval", "keep_alive_max_attempt"}
    )

    run_id: str
    min_nodes: int
    max_nodes: int
    timeout: RendezvousTimeout = field(default=cast(RendezvousTimeout, None))
    keep_alive_interval: timedelta = timedelta(seconds=DEFAULT_KEEP_ALIVE_INTERVAL)
    keep_alive_max_attempt: int = DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
    join: InitVar[Duration | None] = None
    last_call: InitVar[Duration | None] = None
    close: InitVar[Duration | None] = None
    heartbeat: InitVar[Duration | None] = None

    def __post_init__(
        self,
        join: Duration | None,
        last_call: Duration | None,
        close: Duration | None,
        heartbeat: Duration | None,
    ) -> None:
        validate_run_id(self.run_id)
        # torch checks these in its handler's constructor, with these words.
        _check_node_counts(self.min_nodes, self.max_nodes, "nodes")
        if cast(object, self.timeout) is None:
            object.__setattr__(
                self, "timeout", RendezvousTimeout(join, last_call, close, heartbeat)
            )
        elif any(v is not None for v in (join, last_call, close, heartbeat)):
            raise ValueError("give either timeout or join/last_call/close/heartbeat, not both")
        interval = _duration(
            self.keep_alive_interval,
            timedelta(seconds=DEFAULT_KEEP_ALIVE_INTERVAL),
            "keep_alive_interval",
            torch_message=False,
        )
        object.__setattr__(self, "keep_alive_interval", interval)
        attempts = self.keep_alive_max_attempt
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"keep_alive_max_attempt must be a positive integer, got {attempts!r}")

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> RendezvousSettings:
        """Read the settings from rendezvous parameters.

        Keys: ``join_timeout`` (600 s), ``last_call_timeout`` (30 s),
        ``close_timeout`` (30 s), ``heartbeat_timeout`` or ``heartbeat``
        (5 s, not read: see :class:`RendezvousTimeout`),
        ``keep_alive_interval`` (5 s) and ``keep_alive_max_attempt`` (3).

        Raises:
            ValueError: A value is invalid; the message names its key.
        """
        optional: dict[str, Any] = {}
        interval = params.get_as_seconds("keep_alive_interval")
        if interval is not None:
            optional["keep_alive_interval"] = timedelta(seconds=interval)
        attempts = params.get_as_int("keep_alive_max_attempt")
        if attempts is not None:
            optional["keep_alive_max_attempt"] = attempts
        return cls(params.run_id, params.min_nodes, params.max_nodes, params.timeout, **optional)

    def replace(self, **changes: Any) -> RendezvousSettings:
        """Return a copy with the fields named in ``changes`` changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _not_an_integer(key: str, value: object) -> str:
    return (
        f"The rendezvous configuration option '{key}' does not represent a valid integer "
        f"value. Got {value!r}."
    )


_TRUE = frozenset({"1", "true", "t", "yes", "y"})
_FALSE = frozenset({"0", "false", "f", "no", "n"})


class _DefaultRank(int):
    """The type of ``node_rank``'s default: 0, and an object no caller passes."""

    __slots__ = ()


_DEFAULT_RANK = _DefaultRank(0)


def _positional(args: tuple[Any, ...], *keywords: Any) -> list[Any]:
    """Merge the arguments after ``run_id`` (torch's order) with their keywords."""
    names = ("min_nodes", "max_nodes", "local_addr")
    if len(args) > len(names):
        raise TypeError(
            f"RendezvousParameters takes at most 6 positional arguments (backend, endpoint, "
            f"run_id, {', '.join(names)}) but {3 + len(args)} were given"
        )
    merged = list(keywords)
    for index, value in enumerate(args):
        if merged[index] is not None:
            raise TypeError(
                f"RendezvousParameters got multiple values for argument {names[index]!r}"
            )
        merged[index] = value
    return merged


def given_node_rank(params: RendezvousParameters) -> int | None:
    """Return the ``node_rank`` the caller passed to ``params``, None when it was left at 0."""
    return params._given_rank


class RendezvousParameters:
    """The parameters used to build a rendezvous handler.

    The signature is the tensorplay spec's. ``min_nodes``, ``max_nodes`` and
    ``local_addr`` may also be given positionally, in torch's order
    (``RendezvousParameters("c10d", "h:1", "job", 2, 4)``), or the node counts
    as ``config={"min_nodes": ..., "max_nodes": ...}``. When only
    ``min_nodes`` is known, ``max_nodes`` equals it; when neither is, both
    are 1.

    Args:
        backend: The registered name of the backend (``c10d``, ``etcd``, ...).
        endpoint: The backend's endpoint, usually ``host[:port]``.
        run_id: The run identifier.
        *args: ``min_nodes``, ``max_nodes``, ``local_addr``, positionally.
        min_nodes: The fewest nodes a round needs.
        max_nodes: The most nodes a round admits.
        local_addr: The address of this node, if known.
        node_rank: This node's rank (0). Whether the caller gave it is kept
            (:func:`given_node_rank`): a static group of several nodes needs
            it, and the dynamic rendezvous honours only ranks nodes gave.
        local_world_size: Workers on this node (1).
        config: Backend-specific settings.
        **kwargs: More backend-specific settings (merged into ``config``).

    Raises:
        TypeError: More than three arguments after ``run_id`` are
            positional, or one is given both positionally and by keyword.
        ValueError: ``backend`` is empty, ``min_nodes < 1`` or
            ``max_nodes < min_nodes``; the message names the bad value.
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        *args: Any,
        min_nodes: int | None = None,
        max_nodes: int | None = None,
        local_addr: str | None = None,
        node_rank: int = _DEFAULT_RANK,
        local_world_size: int = 1,
        config: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        min_nodes, max_nodes, local_addr = _positional(args, min_nodes, max_nodes, local_addr)
        if not isinstance(backend, str) or not backend.strip():
            raise ValueError(
                f"The rendezvous backend name must be a non-empty string. Got {backend!r}."
            )
        merged: dict[str, Any] = dict(config or {})
        merged.update(kwargs)
        if min_nodes is None:
            min_nodes = self._int_from(merged.pop("min_nodes", None), "min_nodes")
        else:
            merged.pop("min_nodes", None)
        if max_nodes is None:
            max_nodes = self._int_from(merged.pop("max_nodes", None), "max_nodes")
        else:
            merged.pop("max_nodes", None)
        if min_nodes is None:
            min_nodes = 1
        if max_nodes is None:
            max_nodes = min_nodes
        _check_node_counts(min_nodes, max_nodes, "rendezvous nodes")
        if isinstance(node_rank, bool) or not isinstance(node_rank, int) or node_rank < 0:
            raise ValueError(f"node_rank must be a non-negative integer, got {node_rank!r}")
        if (
            isinstance(local_world_size, bool)
            or not isinstance(local_world_size, int)
            or local_world_size < 1
        ):
            raise ValueError(
                f"local_world_size must be a positive integer, got {local_world_size!r}"
            )
        self.backend = backend.strip()
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.local_addr = local_addr
        self.node_rank = int(node_rank)
        self._given_rank = None if node_rank is _DEFAULT_RANK else self.node_rank
        self.local_world_size = local_world_size
        self.config = merged

    @staticmethod
    def _int_from(value: Any, name: str) -> int | None:
        if value is None:
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer, got {value!r}") from None

    def get(self, key: str, default: Any = None) -> Any:
        """Return the value of a backend-specific setting, ``default`` when absent."""
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """Return a setting read as a boolean, ``default`` when absent.

        ``1/0``, ``true/false``, ``t/f``, ``yes/no`` and ``y/n`` are accepted in
        any case, as are real booleans and the integers 0 and 1.

        Raises:
            ValueError: The value is not one of the accepted forms; the
                message names the key.
        """
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            text = value.strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
        raise ValueError(
            f"The rendezvous configuration option '{key}' does not represent a valid boolean "
            f"value. Got {value!r}; accepted: 1/0, true/false, t/f, yes/no, y/n, in any case."
        )

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """Return a setting read as an integer, ``default`` when absent.

        Raises:
            ValueError: The value is not an integer; the message names the key.
        """
        value = self.get(key)
        if value is None:
            return default
        try:
            if isinstance(value, bool):
                raise ValueError(value)  # noqa: TRY301, TRY004 - handled just below
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(_not_an_integer(key, value)) from None

    def get_as_seconds(self, key: str) -> float | None:
        """Return a setting read as a number of seconds, None when absent.

        Whole and fractional numbers are accepted (torch reads whole seconds
        only). The value is not checked for sign: whoever uses it checks
        that it is positive, with torch's message where torch has one.

        Raises:
            ValueError: The value is not a number (torch's message for a
                value that is not an integer), or is not finite or longer
                than a year; the message names the key.
        """
        value = self.get(key)
        if value is None:
            return None
        try:
            if isinstance(value, bool):
                raise ValueError(value)  # noqa: TRY301, TRY004 - handled just below
            seconds = float(value.total_seconds() if isinstance(value, timedelta) else value)
        except (TypeError, ValueError):
            raise ValueError(
                _not_an_integer(key, value) + " rdzv reads it as seconds, whole or fractional."
            ) from None
        if not abs(seconds) <= MAX_DURATION:
            raise ValueError(
                f"the rendezvous configuration option {key!r} must be finite and at most "
                f"{MAX_DURATION:g} s (a year): {value!r}"
            )
        return seconds

    @property
    def timeout(self) -> RendezvousTimeout:
        """The timeouts read from the configuration, in seconds.

        The keys are ``join_timeout``, ``last_call_timeout``,
        ``close_timeout`` and ``heartbeat_timeout`` (or ``heartbeat``).
        """
        heartbeat = self.get_as_seconds("heartbeat_timeout")
        if heartbeat is None:
            heartbeat = self.get_as_seconds("heartbeat")
        return RendezvousTimeout(
            join=self.get_as_seconds("join_timeout"),
            last_call=self.get_as_seconds("last_call_timeout"),
            close=self.get_as_seconds("close_timeout"),
            heartbeat=heartbeat,
        )

    def __repr__(self) -> str:
        return (
            f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, min_nodes={self.min_nodes}, max_nodes={self.max_nodes}, "
            f"local_addr={self.local_addr!r}, node_rank={self.node_rank}, "
            f"local_world_size={self.local_world_size}, config={self.config!r})"
        )


@dataclass(frozen=True)
class RendezvousStoreInfo:
    """Where workers find their bootstrap store.

    Args:
        master_addr: The address of the bootstrap store.
        master_port: Its port.
    """

    MASTER_ADDR_KEY: ClassVar[str] = "MASTER_ADDR"
    """The key rank 0 publishes its address under, in the round's store."""
    MASTER_PORT_KEY: ClassVar[str] = "MASTER_PORT"
    """The key rank 0 publishes its port under, in the round's store."""

    master_addr: str
    master_port: int

    @property
    def addr(self) -> str:
        """Alias of :attr:`master_addr`."""
        return self.master_addr

    @staticmethod
    def build(
        rank: int, store: Store, local_addr: str | None = None, server_port: int | None = None
    ) -> RendezvousStoreInfo:
        """Publish (rank 0) or read (other ranks) the bootstrap store address.

        Rank 0 writes its address and port into ``store``; the other ranks
        read them, waiting up to the store's timeout. Rank 0's address is
        found with ``getaddrinfo`` when ``local_addr`` is None, and a free
        port is picked when ``server_port`` is None.

        Raises:
            RendezvousTimeoutError: A non-zero rank did not see rank 0's
                address within the store timeout.
            RendezvousStateError: The published port is not an integer.
        """
        if rank == 0:
            addr = local_addr or primary_address()
            port = server_port if server_port is not None else _free_port()
            store.multi_set(
                [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY],
                [addr, str(port)],
            )
            return RendezvousStoreInfo(addr, port)
        try:
            addr_b, port_b = store.multi_get(
                [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY]
            )
        except RendezvousTimeoutError as exc:
            raise RendezvousTimeoutError(
                f"rank {rank} did not see rank 0 publish MASTER_ADDR/MASTER_PORT "
                f"within {store.timeout.total_seconds():g} s"
            ) from exc
        try:
            port = int(port_b)
        except ValueError:
            raise RendezvousStateError(
                f"the published MASTER_PORT is not an integer: {port_b!r}"
            ) from None
        return RendezvousStoreInfo(addr_b.decode("utf-8", "replace"), port)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class RendezvousInfo:
    """What a completed rendezvous round gives this node.

    Args:
        store: The round's key-value store (prefixed per run and round): an
            rdzv store, or, when the handler was given a torch store, torch's
            ``PrefixStore`` over that store, as torch gives it.
        rank: This node's rank, in ``0..world_size-1``.
        world_size: The number of nodes in the round.
        bootstrap_store_info: Where workers find their bootstrap store.
        participants: The members' addresses (node descriptors), in rank
            order; or a function that returns them, called once, when
            :attr:`participants` is first read (a handler of thousands of
            members then builds the list only for a caller that asks).
        wait_list: Nodes waiting for the next round; or a function that
            returns them, called once, when :attr:`wait_list` is first read
            (the handler's lists the nodes waiting then).
    """

    __slots__ = ("_bootstrap", "_participants", "_rank", "_store", "_wait_list", "_world_size")

    def __init__(
        self,
        store: StoreLike,
        rank: int,
        world_size: int,
        bootstrap_store_info: RendezvousStoreInfo | None = None,
        participants: Sequence[str] | Callable[[], Sequence[str]] | None = None,
        wait_list: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._bootstrap = bootstrap_store_info
        self._participants: tuple[str, ...] | Callable[[], Sequence[str]] = (
            participants if callable(participants) else tuple(participants or ())
        )
        self._wait_list: tuple[str, ...] | Callable[[], Sequence[str]] = (
            wait_list if callable(wait_list) else tuple(wait_list or ())
        )

    @property
    def store(self) -> StoreLike:
        """The round's store."""
        return self._store

    @property
    def rank(self) -> int:
        """This node's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of nodes in the round."""
        return self._world_size

    @property
    def bootstrap_store_info(self) -> RendezvousStoreInfo | None:
        """Where workers find their bootstrap store."""
        return self._bootstrap

    @property
    def participants(self) -> tuple[str, ...]:
        """The members, in rank order."""
        if callable(self._participants):
            self._participants = tuple(self._participants())
        return self._participants

    @property
    def wait_list(self) -> tuple[str, ...]:
        """Nodes waiting for the next round."""
        if callable(self._wait_list):
            self._wait_list = tuple(self._wait_list())
        return self._wait_list

    def __repr__(self) -> str:
        return (
            f"RendezvousInfo(rank={self.rank}, world_size={self.world_size}, "
            f"bootstrap_store_info={self.bootstrap_store_info!r}, "
            f"participants={list(self.participants)!r}, wait_list={list(self.wait_list)!r})"
        )


class RendezvousHandler(ABC):
    """The rendezvous interface a launcher drives.

    A launcher calls :meth:`next_rendezvous` to join a round, polls
    :meth:`num_nodes_waiting` while its workers run, and calls it again to
    re-form the group when nodes wait or a member died.
    """

    @abstractmethod
    def get_backend(self) -> str:
        """Return the name of the rendezvous backend."""

    @property
    def use_agent_store(self) -> bool:
        """Whether workers reuse the agent's store for their bootstrap (False)."""
        return False

    @abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and block until it completes; return this node's view of it.

        Raises:
            RendezvousClosedError: The run is closed.
            RendezvousConnectionError: The backend cannot be reached.
            RendezvousStateError: The stored state is corrupt.
            RendezvousTimeoutError: The round did not complete in time.
            RendezvousGracefulExitError: This node is a spare and the run
                does not need it.
        """

    @abstractmethod
    def is_closed(self) -> bool:
        """Tell whether the run has been closed (:meth:`set_closed` called by any node)."""

    @abstractmethod
    def set_closed(self) -> None:
        """Close the run: later joins fail with ``RendezvousClosedError``."""

    @abstractmethod
    def num_nodes_waiting(self) -> int:
        """Return how many nodes wait to join.

        A positive number tells members to re-rendezvous to admit them.
        """

    @abstractmethod
    def get_run_id(self) -> str:
        """Return the run identifier."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Leave the rendezvous and release resources; True if the node left cleanly."""

    def pre_shutdown(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Prepare for :meth:`shutdown`; the default does nothing."""
