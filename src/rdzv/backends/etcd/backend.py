"""The etcd v3 rendezvous backend.

Theory of operation
-------------------
One run keeps its state in one key, ``<key_prefix><run_id>``. The value is
``_MAGIC`` followed by the state bytes, so a key written by something else
is reported as corrupt instead of handed to the state decoder. The fencing
token is the key's ``mod_revision``: a compare-and-set is one transaction
that compares it, puts the new value on success and reads the current value
on failure, in one round trip. The same transaction puts an empty *head*
key, ``<key_prefix><run_id>/head``, which is what waiters watch: a watch
event carries the value of the key it reports, so a watch of the state sent
every waiter the whole participant list at every write, where the head's
event carries none. A write that moves the
state but not the head (an operator deleting the key, or an rdzv from before
the head) wakes the waiters at the end of their wait instead. A read asks for the key's revisions alone
first and reads the value only when the revision differs from the last one
seen, so polling an unchanged state costs O(1) bytes whatever the number of
participants. Every write attaches a lease of ``ttl``
seconds (granted once and reused for half its life), so an abandoned run's
state expires on the server.

Beside the state, a run keeps (all under ``<key_prefix><run_id>/``):

* ``queue/<round>/<unique>`` -- join records; one transaction puts a record
  and the round's counter ``queue/<round>`` and reads the counter, whose
  ``version`` (etcd's count of its puts) is the record's position (etcd
  serialises transactions, so positions are gap-free, and the count costs
  O(1) whatever the queue's length);
* ``confirm/<round>/<unique>`` -- the members' confirmations of a sealed
  round, kept the same way (:meth:`EtcdRendezvousBackend.confirmation_queue`);
* ``head/verdict/<round>`` -- the verdict of a sealed round, once every
  member confirmed it: under the head, so that one watch of the keys that
  start with the head's name, from the revision after the member's token,
  ends at the verdict or at a write of the state, whichever comes first
  (:class:`~rdzv.backends.base.VerdictBackend`), with no read before it;
* ``alive/<node>`` -- a node's heartbeat: a put under the node's own lease,
  whose ``mod_revision`` is the heartbeat mark; if the node dies the lease
  expires and the server deletes the key;
* ``store/`` -- the key-value store handed to a completed round
  (:class:`rdzv.backends.etcd.store.EtcdStore`).

Changes are waited for with watches starting at the revision after the one
last read, so no write in between can be missed; a compacted revision just
means "re-read".
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from rdzv.backends.base import (
    LivenessBackend,
    NamedQueues,
    RendezvousBackend,
    SeatedBackend,
    Token,
    VerdictBackend,
    WatchableBackend,
    revision_token,
    validate_node_key,
    validate_record,
    validate_seats,
)
from rdzv.backends.etcd.client import EtcdClientBase
from rdzv.backends.etcd.gateway import EtcdClient
from rdzv.backends.etcd.gateway_codec import (
    LEASE_NOT_FOUND,
    EtcdCompactedError,
    EtcdRequestError,
    KeyValue,
    WatchEvent,
    put_request,
    range_request,
)
from rdzv.backends.etcd.seats import group_name, pack_groups, unpack_seat
from rdzv.backends.etcd.store import EtcdStore
from rdzv.backends.options import EtcdOptions, check_key_settings
from rdzv.errors import RendezvousConnectionError, RendezvousStateError
from rdzv.retry import Clock, Deadline, as_clock, current_clock

if TYPE_CHECKING:
    from rdzv.api import RendezvousParameters


_T = TypeVar("_T")

_ETCD_FAILED = "The connection to etcd has failed. See inner exception for details."

DEFAULT_KEY_PREFIX = EtcdOptions.DEFAULT_PREFIX
_MAGIC = b"rdzv-state/1\n"
MARKS_IN_ONE_READ = 16
"""From this many nodes on, :meth:`EtcdRendezvousBackend.heartbeat_marks` reads them all at once."""


@dataclass
class _Lease:
    """The lease a backend's writes carry, and when it is granted anew (half its life)."""

    id: int = 0
    renew_at: float = 0.0


def _version(kv: KeyValue | None) -> int:
    """Return a counter's version (how many times it was put), 0 for no counter."""
    return 0 if kv is None else kv.version


class EtcdRendezvousBackend(
    RendezvousBackend, WatchableBackend, SeatedBackend, NamedQueues, LivenessBackend, VerdictBackend
):
    """Keeps a run's rendezvous state in etcd v3, with compare-and-set on ``mod_revision``.

    Args:
        client: The etcd client (either: :class:`~rdzv.backends.etcd.client.EtcdClientBase`).
        run_id: The run identifier.
        key_prefix: Prefix of every key of this backend (``/rdzv/``).
        ttl: Seconds an unwritten state survives on the server (two hours).
        liveness_ttl: Seconds a node's heartbeat key survives without a beat
            (60); observers judge death on their own clocks well before.
        owns_client: Close ``client`` in :meth:`close`.
        clock: The clock of its waits when the caller names none, and of its
            leases' refreshes; real time when None.

    Raises:
        ValueError: An empty run id or prefix, or a TTL below 1 second.
    """

    def __init__(
        self,
        client: EtcdClientBase,
        run_id: str,
        key_prefix: str | None = None,
        ttl: int | None = None,
        liveness_ttl: int | None = None,
        *,
        owns_client: bool = False,
        clock: Clock | Callable[[], float] | None = None,
    ) -> None:
        prefix, ttl, liveness_ttl = check_key_settings(
            "etcd", run_id, key_prefix, DEFAULT_KEY_PREFIX, ttl, liveness_ttl
        )
        self._client = client
        self._owns_client = owns_client
        self._clock = as_clock(clock)
        self._run_id = run_id
        self._key = f"{prefix}{run_id}".encode()
        # The last state read or written, with its modification revision.
        self._last: tuple[bytes, int] | None = None
        self._run_prefix = self._key + b"/"
        self._head = self._run_prefix + b"head"
        self._seats = self._run_prefix + b"seats/"
        self._ttl = ttl
        self._liveness_ttl = liveness_ttl
        self._lock = threading.Lock()
        # Shared with the confirmation queue's view (a shallow copy): one lease a run.
        self._state_lease = _Lease()
        # node -> (its heartbeat lease, when a beat refreshes it next).
        self._node_leases: dict[str, tuple[int, float]] = {}

    def _within(self, timeout: float) -> Deadline:
        """Return ``timeout`` from now on the caller's clock (this backend's when it names none)."""
        return Deadline.after(timeout, current_clock(self._clock))

    @property
    def name(self) -> str:
        """``etcd-v3``."""
        return "etcd-v3"

    @property
    def client(self) -> EtcdClientBase:
        """The etcd client."""
        return self._client

    def close(self) -> None:
        """Close the client if this backend owns it (built by ``create_backend``)."""
        if self._owns_client:
            self._client.close()

    @property
    def key(self) -> bytes:
        """The key that holds the state."""
        return self._key

    @property
    def run_prefix(self) -> bytes:
        """The prefix of the run's other keys (queues, heartbeats, store)."""
        return self._run_prefix

    # -- state ------------------------------------------------------------------

    def _decode(self, kv: KeyValue) -> tuple[bytes, Token]:
        if not kv.value.startswith(_MAGIC):
            raise RendezvousStateError(
                f"the value of etcd key {kv.key!r} is not an rdzv rendezvous state "
                f"(it starts with {kv.value[:16]!r}); delete the key or use another run id"
            )
        return kv.value[len(_MAGIC) :], kv.mod_revision

    def _state_lease_id(self) -> int:
        lease = self._state_lease
        with self._lock:
            if lease.id and self._clock() < lease.renew_at:
                return lease.id
        lease_id, granted = self._client.lease_grant(self._ttl)
        with self._lock:
            lease.id = lease_id
            lease.renew_at = self._clock() + max(granted, 1) / 2
        return lease_id

    def _with_state_lease(self, write: Callable[[int], _T]) -> _T:
        """Run ``write(lease)``; if the server lost the cached lease, grant a new one and retry."""
        try:
            return write(self._state_lease_id())
        except EtcdRequestError as exc:
            if exc.code != LEASE_NOT_FOUND:
                raise
        with self._lock:
            self._state_lease.id = 0
        return write(self._state_lease_id())

    def get_state(self) -> tuple[bytes, Token] | None:
        """Read the state (see :class:`RendezvousBackend`)."""
        return self._read()[0]

    def _read(self) -> tuple[tuple[bytes, Token] | None, int]:
        """Read the state and the store revision; an unchanged state costs no value (see the module)."""
        kvs, revision = self._client.range(self._key, keys_only=True)
        if not kvs:
            return None, revision
        last = self._last
        if last is not None and last[1] == kvs[0].mod_revision:
            return last, revision
        return self._read_value()

    def _read_value(self) -> tuple[tuple[bytes, Token] | None, int]:
        """Read the state with its value, and the store revision (no keys-only read first)."""
        kv, revision = self._client.get(self._key)
        if kv is None:
            return None, revision
        found = self._decode(kv)
        self._last = found
        return found, revision

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write the state if ``token`` is current (see :class:`RendezvousBackend`)."""
        return self.set_state_seated(state, token, {})

    def set_state_seated(
        self, state: bytes, token: Token | None, seats: Mapping[str, bytes]
    ) -> tuple[bytes, Token, bool] | None:
        """Write the state, its head and ``seats`` (:mod:`~rdzv.backends.etcd.seats`) in one txn.

        A write whose first reply was lost and that is found stored on the
        retry (same bytes) is reported as written.
        """
        validate_seats(seats)
        also = {self._seats + name: group for name, group in pack_groups(seats).items()}
        also[self._head] = b""
        state = bytes(state)
        expected = revision_token(token)
        if expected is None:
            current = self.get_state()
            return None if current is None else (current[0], current[1], False)
        value = _MAGIC + state
        written, revision, kv, attempts = self._with_state_lease(
            lambda lease: self._client.compare_and_put(
                self._key, value, expected, lease=lease, also=also
            )
        )
        if written:
            self._last = (state, revision)
            return state, revision, True
        if kv is None:
            return None
        if attempts > 1 and kv.value == value:
            return state, kv.mod_revision, True
        current_state, current_token = self._decode(kv)
        return current_state, current_token, False

    def _token_at(self) -> tuple[int | None, int]:
        """Return the state's token (None when nothing is stored) and the store revision."""
        kvs, revision = self._client.range(self._key, keys_only=True)
        return (kvs[0].mod_revision if kvs else None), revision

    def read_token(self) -> Token | None:
        """Return the state's token, reading its revisions alone."""
        return self._token_at()[0]

    def wait_for_token(self, token: Token | None, timeout: float) -> Token | None:
        """Wait as :meth:`wait_for_state`; a write's head event names its token: no read after it."""
        expected = revision_token(token)
        if expected:
            start = expected + 1
        else:
            current, revision = self._token_at()
            if current != token:
                return current
            start = revision + 1
        events = self._watch_head(start, timeout)
        return events[-1].kv.mod_revision if events else self.read_token()

    def _watch_head(self, start: int, timeout: float) -> list[WatchEvent]:
        """Watch the head from revision ``start``; no events also when that history is compacted."""
        with contextlib.suppress(EtcdCompactedError):
            watched = self._client.watch_within(self._head, start, self._within(timeout))
            return [] if watched is None else watched[0]
        return []

    def read_seat(self, token: Token, node: str) -> bytes | None:
        """Return ``node``'s seat from its group, if the write of ``token`` put the group."""
        kv, _ = self._client.get(self._seats + group_name(validate_node_key(node)))
        if kv is None or revision_token(token) != kv.mod_revision:
            return None
        return unpack_seat(kv.value, node)

    def wait_for_state(self, token: Token | None, timeout: float) -> tuple[bytes, Token] | None:
        """Wait until the state's token differs from ``token``, watching the head.

        The token is a revision of the head too, so a wait for the token of
        the state last seen watches from the revision after it with no read
        first; otherwise the watch starts after a read of the state.
        """
        last = self._last
        if token is not None and last is not None and last[1] == token:
            start = token + 1
        else:
            current, revision = self._read()
            if (None if current is None else current[1]) != token:
                return current
            start = revision + 1
        # The head moves with the state: after an event, read its value at once.
        return self._read_value()[0] if self._watch_head(start, timeout) else self.get_state()

    # -- join queue -----------------------------------------------------------

    def _queue_prefix(self, round_id: int) -> bytes:
        return self._queue_counter(round_id) + b"/"

    def _queue_counter(self, round_id: int) -> bytes:
        """The key every append to the queue of ``round_id`` puts: its version is the length."""
        return self._run_prefix + f"{self._queue_name}/{round_id}".encode()

    def enqueue(self, round_id: int, record: bytes) -> int:
        """Append a join record in one transaction that also puts the queue's counter and reads it."""
        validate_record(round_id, record)
        counter = self._queue_counter(round_id)
        key = self._queue_prefix(round_id) + uuid.uuid4().hex.encode()
        result = self._with_state_lease(
            lambda lease: self._client.txn(
                [],
                [
                    {"request_put": put_request(key, record, lease)},
                    {"request_put": put_request(counter, b"", lease)},
                    {"request_range": range_request(counter)},
                ],
                [],
            )
        )
        kvs = self._client.txn_kvs(result, 2)
        if not kvs:
            raise RendezvousStateError(
                f"etcd answered an enqueue with no counter: {result.responses!r}"
            )
        return kvs[0].version

    def queue_records(self, round_id: int) -> list[bytes]:
        """Return the join records of ``round_id``, oldest first."""
        kvs, _ = self._client.range(self._queue_prefix(round_id), prefix=True, sort_by_create=True)
        return [kv.value for kv in kvs]

    def queue_length(self, round_id: int) -> int:
        """Return how many join records ``round_id`` has (its counter's version)."""
        kv, _ = self._client.get(self._queue_counter(round_id))
        return 0 if kv is None else kv.version

    def wait_queue_length(self, round_id: int, known: int, timeout: float) -> int:
        """Wait until the queue length of ``round_id`` differs from ``known``, watching its counter."""
        return self._client.watch_value(
            self._queue_counter(round_id), known, _version, self._within(timeout)
        )

    def drop_queue(self, round_id: int) -> None:
        """Delete the queue of ``round_id`` and its counter."""
        self._client.delete(self._queue_prefix(round_id), prefix=True)
        self._client.delete(self._queue_counter(round_id))

    # -- verdicts -------------------------------------------------------------

    def _verdict_key(self, round_id: int) -> bytes:
        return self._head + f"/verdict/{round_id}".encode()

    def set_verdict(self, round_id: int) -> None:
        """Put the verdict of ``round_id`` (under the run's lease)."""
        key = self._verdict_key(round_id)
        self._with_state_lease(lambda lease: self._client.put(key, b"confirmed", lease=lease))

    def wait_for_verdict(self, round_id: int, token: Token, timeout: float) -> bool | None:
        """Watch the head and the verdicts from the revision after ``token``; see :class:`VerdictBackend`."""
        verdict = self._verdict_key(round_id)
        start = (revision_token(token) or 0) + 1
        deadline = self._within(timeout)
        while True:
            try:
                watched = self._client.watch_within(self._head, start, deadline, prefix=True)
            except EtcdCompactedError:
                # The history since the token is gone: read the verdict, and
                # let the caller read the state.
                kv, _ = self._client.get(verdict)
                return kv is not None or False
            if watched is None:
                return None
            events, start = watched
            keys = {(e.kv.key, e.kind) for e in events}
            if (verdict, "PUT") in keys:
                return True
            if any(key == self._head for key, _ in keys):
                return False

    def drop_verdict(self, round_id: int) -> None:
        """Delete the verdict of ``round_id``."""
        self._client.delete(self._verdict_key(round_id))

    # -- liveness -----------------------------------------------------------

    def _alive_key(self, node: str) -> bytes:
        validate_node_key(node)
        return self._run_prefix + f"alive/{node}".encode()

    def beat(self, node: str) -> None:
        """Record a heartbeat: put the node's key under its lease, refreshed a third into its life.

        The put moves the mark; the lease only lets the server delete a dead
        node's key, so most beats are one request (the put), not two.
        """
        key = self._alive_key(node)
        for _ in range(2):
            with self._lock:
                lease, refresh_at = self._node_leases.get(node, (0, 0.0))
            now = self._clock()
            ttl = None
            if not lease:
                lease, ttl = self._client.lease_grant(self._liveness_ttl)
            elif now >= refresh_at:
                ttl = self._client.lease_keepalive(lease)
            if ttl is None or ttl > 0:
                if ttl is not None:
                    with self._lock:
                        self._node_leases[node] = (lease, now + ttl / 3)
                try:
                    self._client.put(key, b"alive", lease=lease)
                except EtcdRequestError as exc:
                    if exc.code != LEASE_NOT_FOUND:
                        raise
                else:
                    return
            with self._lock:
                self._node_leases.pop(node, None)
        raise RendezvousStateError(f"etcd keeps expiring the heartbeat lease of node {node!r}")

    def heartbeat_mark(self, node: str) -> bytes | None:
        """Return the ``mod_revision`` of the node's heartbeat key, or None if it expired."""
        kv, _ = self._client.get(self._alive_key(node))
        return None if kv is None else str(kv.mod_revision).encode()

    def heartbeat_marks(self, nodes: Sequence[str]) -> dict[str, bytes | None]:
        """Return the marks of several nodes; of many, from one read of every heartbeat's revision.

        From :data:`MARKS_IN_ONE_READ` nodes on (a seal reads every member's),
        one keys-only read of the run's heartbeat keys answers for all.
        """
        if len(nodes) < MARKS_IN_ONE_READ:
            return super().heartbeat_marks(nodes)
        for node in nodes:
            validate_node_key(node)
        prefix = self._run_prefix + b"alive/"
        kvs, _ = self._client.range(prefix, prefix=True, keys_only=True)
        marks = {kv.key[len(prefix) :].decode("utf-8", "replace"): kv.mod_revision for kv in kvs}
        return {node: None if node not in marks else str(marks[node]).encode() for node in nodes}

    def forget(self, node: str) -> None:
        """Delete the node's heartbeat key and revoke its lease if this process holds it."""
        key = self._alive_key(node)
        with self._lock:
            lease, _ = self._node_leases.pop(node, (0, 0.0))
        if lease:
            self._client.lease_revoke(lease)
        self._client.delete(key)

    def live_nodes(self) -> list[str]:
        """Return the nodes whose heartbeat key the server still holds."""
        prefix = self._run_prefix + b"alive/"
        kvs, _ = self._client.range(prefix, prefix=True, keys_only=True)
        return sorted(kv.key[len(prefix) :].decode("utf-8", "replace") for kv in kvs)


def create_client(options: EtcdOptions) -> EtcdClientBase:
    """Build the etcd client the options name (``options.client``): gRPC or the gateway's.

    The gRPC client's module, and grpcio, are imported only here, when chosen.

    Raises:
        ValueError: An option is invalid; the message names it.
    """
    kind: type[EtcdClientBase] = EtcdClient
    if options.client == "grpc":
        from rdzv.backends.etcd.grpc import EtcdGrpcClient  # noqa: PLC0415 - grpcio is optional

        kind = EtcdGrpcClient
    return kind(
        list(options.endpoints),
        protocol=options.protocol,
        read_timeout=options.read_timeout,
        ssl_cert=options.ssl_cert,
        ssl_cert_key=options.ssl_cert_key,
        ca_cert=options.ca_cert,
    )


def open_etcd(options: EtcdOptions) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Build the etcd backend and the etcd store of a run from parsed options.

    Raises:
        RendezvousConnectionError: No member answered one bounded request
            (:meth:`~rdzv.backends.etcd.gateway.EtcdClient.check_reachable`);
            torch's message first.
    """
    client = create_client(options)
    try:
        client.check_reachable()
    except RendezvousConnectionError as exc:
        client.close()
        raise RendezvousConnectionError(f"{_ETCD_FAILED} {exc}") from exc
    except BaseException:
        client.close()
        raise
    backend = EtcdRendezvousBackend(
        client,
        options.run_id,
        key_prefix=options.keys.key_prefix,
        ttl=options.keys.ttl,
        owns_client=True,
    )
    store = EtcdStore(client, backend.run_prefix + b"store/")
    return backend, store


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Build the etcd backend and the etcd store of a run.

    Options: see :meth:`rdzv.backends.options.EtcdOptions.from_params`.

    Raises:
        ValueError: An option or the endpoint is invalid; the message names
            it, torch's message first where torch checks the same.
        RendezvousConnectionError: etcd is unreachable (checked with one
            bounded request per member); torch's message first.
    """
    return open_etcd(EtcdOptions.from_params(params))
