"""What every etcd client of rdzv offers, and the failover between members they share.

Theory of operation
-------------------
rdzv has two etcd v3 clients: the standard-library one over etcd's JSON
gateway (:mod:`rdzv.backends.etcd.gateway`, the default) and one over gRPC
(:mod:`rdzv.backends.etcd.grpc`, with the ``etcd`` extra). The backend and
the store use either through :class:`EtcdClientBase`: the KV calls, leases
and watches rdzv needs, a transaction's operations in etcd's JSON mapping
(built by :mod:`rdzv.backends.etcd.gateway_codec`), and what is built on them once
here (:meth:`~EtcdClientBase.get`, :meth:`~EtcdClientBase.compare_and_put`).

A client supplies one attempt on one member; the base turns it into a call
with failover; each client starts at a member drawn at random, so a run's
clients spread their load over the cluster. Each call has an overall deadline (a
:class:`rdzv.retry.Retry`): the read timeout, or the caller's deadline when
that comes sooner (:func:`rdzv.retry.deadline_within`: the handler bounds a
join by its join timeout, a heartbeat by the keep-alive interval). When a
member is unreachable, or answers with a transient error (no leader, leader
changed, ...: an :class:`~rdzv.backends.etcd.gateway_codec.EtcdRetryableError`),
the call moves on to the next member, with capped backoff between full
passes over the list, until the deadline; while no member accepts a
connection at all (an attempt raises :class:`ConnectFailedError`), it gives
up after the connect timeout rather than the read timeout. A call that was
sent more than once reports it (``attempts``), so a caller can recognise its
own write when the reply to the first attempt was lost. A watch fails over
the same way, each attempt bounded by the time left.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from rdzv.backends.etcd.gateway_codec import (
    LEASE_NOT_FOUND,
    EtcdCompactedError,
    EtcdRequestError,
    EtcdRetryableError,
    KeyValue,
    TxnResult,
    WatchEvent,
    mod_revision_compare,
    put_request,
    range_request,
)
from rdzv.endpoint import format_endpoint
from rdzv.errors import RendezvousConnectionError
from rdzv.retry import Deadline, Retry, jitter

__all__ = ["PROBE_KEY", "ConnectFailedError", "EtcdClientBase", "tls_failure"]

_T = TypeVar("_T")
_C = TypeVar("_C", bound="EtcdClientBase")
_V = TypeVar("_V")

PROBE_KEY = b"\0rdzv-probe"
"""The key :meth:`EtcdClientBase.check_reachable` counts (none is there)."""


class ConnectFailedError(EtcdRetryableError):
    """No connection to a member could be made (nothing listening, host down)."""


def tls_failure(
    endpoint: str, reason: str, text: str, verify_failed: bool, has_client_cert: bool
) -> RendezvousConnectionError:
    """Return the error for a TLS handshake with ``endpoint`` that failed, with a hint.

    Args:
        endpoint: The member.
        reason: The failure, as the message quotes it.
        text: The TLS library's whole text (an alert about a certificate is
            read from it).
        verify_failed: The server's certificate did not verify.
        has_client_cert: This client sent a certificate.
    """
    text = text.upper()
    if verify_failed:
        hint = "the server certificate did not verify against ca_cert"
    elif "ALERT" in text and ("CERTIFICATE" in text or "UNKNOWN_CA" in text):
        hint = (
            "the server rejected this client's certificate"
            if has_client_cert
            else "the server requires a client certificate; set ssl_cert and ssl_cert_key"
        )
    elif not has_client_cert:
        hint = (
            "the server ended the handshake; if it requires a client certificate, "
            "set ssl_cert and ssl_cert_key"
        )
    else:
        hint = "check ca_cert, ssl_cert and ssl_cert_key"
    return RendezvousConnectionError(f"TLS with etcd at {endpoint} failed ({reason}): {hint}")


class EtcdClientBase(abc.ABC):
    """A thread-safe etcd v3 client: its settings, its failover, and the calls rdzv makes.

    Args:
        endpoints: ``(host, port)`` of one or more cluster members.
        protocol: ``"http"`` or ``"https"``.
        read_timeout: Seconds one request (and a whole call with failover)
            may take.
        connect_timeout: Seconds to establish a connection to one member.
        ssl_cert: The client certificate file (PEM), for https.
        ssl_cert_key: The client certificate's key file (PEM).
        ca_cert: The CA bundle that verifies the servers (PEM); the system
            trust store when None.

    Raises:
        ValueError: No endpoint, an unknown protocol, TLS files without https,
            a certificate without its key, or a non-positive timeout.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        protocol: str = "http",
        read_timeout: float = 60.0,
        connect_timeout: float = 5.0,
        ssl_cert: str | None = None,
        ssl_cert_key: str | None = None,
        ca_cert: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("the etcd client needs at least one endpoint")
        protocol = protocol.strip().lower()
        if protocol not in ("http", "https"):
            raise ValueError(f"the etcd protocol must be 'http' or 'https', got {protocol!r}")
        if protocol == "http" and (ssl_cert or ssl_cert_key or ca_cert):
            raise ValueError(
                "ssl_cert, ssl_cert_key and ca_cert need protocol=https; got protocol=http"
            )
        if bool(ssl_cert) != bool(ssl_cert_key):
            raise ValueError("ssl_cert and ssl_cert_key must be given together")
        if not read_timeout > 0:
            raise ValueError(f"read_timeout must be positive, got {read_timeout!r}")
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout must be positive, got {connect_timeout!r}")
        self._endpoints = [(host, int(port)) for host, port in endpoints]
        self._protocol = protocol
        self._read_timeout = float(read_timeout)
        self._connect_timeout = float(connect_timeout)
        self._has_client_cert = bool(ssl_cert)
        self._lock = threading.Lock()
        # Each client starts at a member of its own, so a run's clients
        # spread over the cluster instead of all loading the first member.
        self._current = int(jitter(0.0, len(self._endpoints))) % len(self._endpoints)
        self._closed = False
        self._open(ca_cert, ssl_cert, ssl_cert_key)

    @abc.abstractmethod
    def _open(self, ca_cert: str | None, ssl_cert: str | None, ssl_cert_key: str | None) -> None:
        """Set up the transport, with these TLS files over ``https`` (the end of ``__init__``)."""

    @property
    def endpoints(self) -> list[str]:
        """The members' URLs, in failover order."""
        return [self._url(i) for i in range(len(self._endpoints))]

    @property
    def read_timeout(self) -> float:
        """Seconds one call may take."""
        return self._read_timeout

    def _url(self, index: int) -> str:
        host, port = self._endpoints[index]
        return f"{self._protocol}://{format_endpoint(host, port)}"

    def _tls_hint(self) -> str:
        if self._protocol == "https" and not self._has_client_cert:
            return (
                " (a server that requires client certificates drops connections "
                "without one: set ssl_cert and ssl_cert_key)"
            )
        return ""

    def _watch_went_quiet(self, answered: bool, retry: Retry) -> bool:
        """Whether a watch whose time ran out (``retry``'s) just saw no events.

        True when the member acknowledged the watch (``answered``), or the
        watch had less than the connect timeout: a member silent for longer
        is as unreachable as one that refuses connections (a retryable
        error; the caller fails over).
        """
        return answered or retry.elapsed() < self._connect_timeout

    @abc.abstractmethod
    def close(self) -> None:
        """Close every connection; later calls raise."""

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- failover -------------------------------------------------------------

    def _failover(self, what: str, attempt: Callable[[int, float], _T]) -> tuple[_T, int, int]:
        """Run ``attempt(member index, timeout)`` on member after member until one answers.

        Returns:
            ``(result, attempts, member index)``.

        Raises:
            RendezvousConnectionError: No member answered in time; the
                message names every member tried.
        """
        retry = Retry(self._read_timeout)
        errors: list[str] = []
        attempts = 0
        reached = False
        count = len(self._endpoints)
        # A member that accepts connections but hangs must not eat the whole
        # budget: with several members each attempt gets a share of it.
        per_attempt = self._read_timeout if count == 1 else max(1.0, self._read_timeout / count)

        def give_up() -> bool:
            unreachable = not reached and retry.elapsed() >= self._connect_timeout
            return unreachable or retry.expired()

        while True:
            with self._lock:
                start = self._current
            for step in range(count):
                if attempts and give_up():
                    break
                index = (start + step) % count
                attempts += 1
                try:
                    result = attempt(index, retry.attempt_timeout(per_attempt))
                except ConnectFailedError as exc:
                    errors.append(str(exc))
                    continue
                except EtcdRetryableError as exc:
                    reached = True
                    errors.append(str(exc))
                    continue
                if step:
                    with self._lock:
                        self._current = index
                return result, attempts, index
            if give_up() or not retry.pause():
                done = (
                    f"answered {what}"
                    if reached
                    else f"accepted a connection for {what} (connect timeout "
                    f"{self._connect_timeout:g} s)"
                )
                raise RendezvousConnectionError(
                    f"no etcd member {done} within {retry.elapsed():.3g} s "
                    f"({attempts} attempts); last errors: {'; '.join(errors[-count:])}"
                    + self._tls_hint()
                )

    @abc.abstractmethod
    def _probe(self, index: int, timeout: float) -> None:
        """Ask member ``index`` for a serializable count of no keys, once, within ``timeout``."""

    def check_reachable(self) -> str:
        """Ask each member once, in order, for a count of no keys, until one answers.

        One bounded round trip per member: each attempt may take the connect
        timeout (or the read timeout, when shorter); no member is retried.

        Returns:
            The URL of the member that answered.

        Raises:
            RendezvousConnectionError: No member answered; the message names
                every member and its failure.
            EtcdRejectedError: A member answered and refused to read.
        """
        timeout = min(self._connect_timeout, self._read_timeout)
        errors: list[str] = []
        for index in range(len(self._endpoints)):
            try:
                self._probe(index, timeout)
            except EtcdRetryableError as exc:
                errors.append(str(exc))
                continue
            with self._lock:
                self._current = index
            return self._url(index)
        raise RendezvousConnectionError(
            f"no etcd member answered within {timeout:g} s: {'; '.join(errors)}" + self._tls_hint()
        )

    # -- KV ---------------------------------------------------------------------

    @abc.abstractmethod
    def range(
        self,
        key: bytes,
        prefix: bool = False,
        limit: int = 0,
        sort_by_create: bool = False,
        keys_only: bool = False,
        serializable: bool = False,
    ) -> tuple[list[KeyValue], int]:
        """Read a key or every key under a prefix.

        Args:
            key: The key or prefix.
            prefix: Read every key starting with ``key``.
            limit: The most keys to return (0: no limit).
            sort_by_create: Oldest-created first.
            keys_only: Leave the values out.
            serializable: Answer from the member's own copy (may be stale).

        Returns:
            ``(kvs, revision)``: the keys found and the store revision read.
        """

    @abc.abstractmethod
    def count(self, prefix: bytes) -> int:
        """Count the keys under ``prefix``."""

    def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """Read one key."""
        kvs, revision = self.range(key)
        return (kvs[0] if kvs else None), revision

    @abc.abstractmethod
    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write a key under ``lease`` (0: none); return the store revision of the write."""

    @abc.abstractmethod
    def delete(self, key: bytes, prefix: bool = False) -> int:
        """Delete a key or every key under a prefix; return how many were deleted."""

    @abc.abstractmethod
    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
    ) -> TxnResult:
        """Run a transaction: the ``success`` ops when every ``compare`` holds, else ``failure``.

        The compares and operations are etcd's JSON mapping, as the builders
        of :mod:`rdzv.backends.etcd.gateway_codec` make them; a range's reply is
        ``{"response_range": {..., "count": n}}``, its keys read with
        :meth:`txn_kvs`.
        """

    @abc.abstractmethod
    def txn_kvs(self, result: TxnResult, index: int) -> list[KeyValue]:
        """Return the keys of the ``index``-th range response of a txn."""

    def compare_and_put(
        self,
        key: bytes,
        value: bytes,
        mod_revision: int,
        lease: int = 0,
        also: Mapping[bytes, bytes] | None = None,
    ) -> tuple[bool, int, KeyValue | None, int]:
        """Write ``key`` if its ``mod_revision`` is ``mod_revision``, in one round trip.

        Args:
            key: The key.
            value: The new value.
            mod_revision: The expected modification revision; 0 means
                "the key must not exist".
            lease: A lease ID to attach to the new value.
            also: More ``{key: value}`` to put in the same transaction, under
                the same lease, when the write wins.

        Returns:
            ``(written, revision, current, attempts)``: on success the
            revision of the write and ``current`` None; on failure the
            stored key (None when absent) as read in the same transaction.
        """
        puts = {key: value, **(also or {})}
        result = self.txn(
            [mod_revision_compare(key, mod_revision)],
            [{"request_put": put_request(k, v, lease)} for k, v in puts.items()],
            [{"request_range": range_request(key)}],
        )
        if result.succeeded:
            return True, result.revision, None, result.attempts
        kvs = self.txn_kvs(result, 0)
        return False, result.revision, (kvs[0] if kvs else None), result.attempts

    # -- leases ---------------------------------------------------------------

    @abc.abstractmethod
    def lease_grant(self, ttl: int) -> tuple[int, int]:
        """Grant a lease of ``ttl`` whole seconds; return ``(lease_id, granted_ttl)``.

        Raises:
            ValueError: ``ttl`` is below 1.
        """

    @abc.abstractmethod
    def lease_keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; return its TTL in seconds (0 or less: expired or absent)."""

    @abc.abstractmethod
    def _revoke(self, lease_id: int) -> None:
        """Revoke a lease (one request, with failover)."""

    def lease_revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting every key attached to it (a missing lease is ignored)."""
        try:
            self._revoke(lease_id)
        except EtcdRequestError as exc:
            if exc.code != LEASE_NOT_FOUND:
                raise

    # -- watch ------------------------------------------------------------------

    @abc.abstractmethod
    def _watch_once(
        self, index: int, key: bytes, start_revision: int, prefix: bool, retry: Retry
    ) -> tuple[list[WatchEvent], int]:
        """Watch on member ``index`` until one batch of events or ``retry``'s deadline.

        Raises:
            EtcdRetryableError: The member could not be watched.
        """

    def watch(
        self, key: bytes, start_revision: int, timeout: float, prefix: bool = False
    ) -> tuple[list[WatchEvent], int]:
        """Wait for changes of ``key`` (or a prefix) at or after ``start_revision``.

        Returns as soon as one batch of events arrives, or empty when
        ``timeout`` elapses.

        Args:
            key: The key or prefix.
            start_revision: The first revision of interest.
            timeout: The most seconds to wait.
            prefix: Watch every key starting with ``key``.

        Returns:
            ``(events, next_revision)``: the events and the revision to
            resume from.

        Raises:
            EtcdCompactedError: ``start_revision`` was compacted; re-read.
            RendezvousConnectionError: No member could be watched.
        """
        retry = Retry(timeout)
        errors: list[str] = []
        count = len(self._endpoints)
        while True:
            with self._lock:
                start = self._current
            for step in range(count):
                index = (start + step) % count
                try:
                    return self._watch_once(index, key, start_revision, prefix, retry)
                except EtcdRetryableError as exc:
                    errors.append(str(exc))
            if not retry.pause():
                raise RendezvousConnectionError(
                    f"could not watch etcd ({', '.join(self.endpoints)}): "
                    f"{'; '.join(errors[-count:])}" + self._tls_hint()
                )

    def watch_within(
        self, key: bytes, start_revision: int, deadline: Deadline, prefix: bool = False
    ) -> tuple[list[WatchEvent], int] | None:
        """:meth:`watch` for the time left on ``deadline``'s clock; None once none is left.

        The watch's socket timeout is that time left; whether to watch again
        is the clock's, which may move meanwhile (a test's autojump clock).
        """
        remaining = deadline.left()
        if remaining <= 0:
            return None
        with deadline.clock.blocking(remaining):
            return self.watch(key, start_revision, remaining, prefix)

    def watch_value(
        self, key: bytes, known: _V, value: Callable[[KeyValue | None], _V], deadline: Deadline
    ) -> _V:
        """Return ``value`` of ``key`` once it differs from ``known``, or ``known`` at ``deadline``.

        One read, then watches from the revision after it; each event
        carries the key, so no read follows a watch (a compacted history
        reads again).
        """
        kv, revision = self.get(key)
        current = value(kv)
        while current == known:
            try:
                watched = self.watch_within(key, revision + 1, deadline)
            except EtcdCompactedError:
                kv, revision = self.get(key)
                current = value(kv)
                continue
            if watched is None:
                break
            events, after = watched
            if events:
                last = events[-1]
                current = value(None if last.kind == "DELETE" else last.kv)
                revision = after - 1
        return current
