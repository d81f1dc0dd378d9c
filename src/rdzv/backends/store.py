"""The rendezvous backend over a key-value :class:`~rdzv.store.base.Store`.

One class, importable as ``C10dRendezvousBackend``, ``P10dRendezvousBackend``
and ``TpRendezvousBackend``. It offers every capability:

* state: one key holding ``b"RDZ1" + generation (8 bytes) + nonce (4 bytes)
  + state``; the whole stored value is the fencing token, and a write is a
  single ``compare_set`` against it. The generation only grows, so a stale
  token never matches again; the random nonce makes "did my write win?"
  exact even when two writers store identical bytes.
* watch: ``Store.watch`` on the state key when the store supports it,
  otherwise polling with jittered, capped backoff;
* join queue: ``append`` of a length-prefixed record, then ``add`` on the
  round's counter (two non-conflicting operations per joining node);
* liveness: ``add(key, 1)`` on a per-node counter.

Keys live under ``rdzv.backend/<run_id>/``. Store failures become
:class:`~rdzv.errors.RendezvousConnectionError`.
"""

from __future__ import annotations

import ipaddress
import random
import secrets
import socket
import ssl
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from rdzv.api import RendezvousParameters
from rdzv.auth import resolve_auth_token
from rdzv.backends.base import (
    JoinQueueBackend,
    LivenessBackend,
    RendezvousBackend,
    Token,
    WatchableBackend,
    text_option,
    validate_node_key,
    validate_record,
)
from rdzv.endpoint import parse_endpoint
from rdzv.errors import RendezvousConnectionError, RendezvousError, RendezvousStateError
from rdzv.net import local_addresses, server_tls_context
from rdzv.store.base import Store

__all__ = [
    "C10dRendezvousBackend",
    "P10dRendezvousBackend",
    "StoreJoinQueue",
    "StoreLiveness",
    "StoreTLS",
    "TpRendezvousBackend",
    "create_backend",
    "endpoint_is_local",
    "poll_backoff",
]

_T = TypeVar("_T")
_MAGIC = b"RDZ1"
_HEADER = len(_MAGIC) + 8 + 4
_PROBE = b"\x00rdzv-probe"


def _call(what: str, fn: Callable[[], _T]) -> _T:
    """Run a store call, translating foreign failures to RendezvousConnectionError."""
    try:
        return fn()
    except RendezvousError:
        raise
    except (OSError, EOFError, RuntimeError, ValueError) as exc:
        raise RendezvousConnectionError(
            f"the rendezvous store failed during {what}: {exc}"
        ) from exc


def poll_backoff(attempt: int, cap: float = 1.0) -> float:
    """Return a jittered, capped backoff delay for the ``attempt``-th poll.

    Args:
        attempt: 0 for the first poll.
        cap: The largest delay, in seconds.

    Returns:
        A delay in seconds, between half and all of ``min(cap, 0.01 * 2**attempt)``.
    """
    base = min(cap, 0.01 * float(2 ** min(attempt, 20)))
    return base * (0.5 + random.random() / 2)


class StoreJoinQueue(JoinQueueBackend):
    """The join-queue capability over a store.

    Args:
        store: The store.
        prefix: The key prefix (ends with ``/``).
    """

    def __init__(self, store: Store, prefix: str) -> None:
        self._queue_store = store
        self._queue_prefix = prefix

    def _queue_keys(self, round_id: int) -> tuple[str, str]:
        base = f"{self._queue_prefix}q/{round_id}"
        return base, f"{base}/n"

    def enqueue(self, round_id: int, record: bytes) -> int:  # noqa: D102 - see JoinQueueBackend
        validate_record(round_id, record)
        data_key, count_key = self._queue_keys(round_id)
        framed = b"%d:" % len(record) + record
        store = self._queue_store
        _call("enqueue", lambda: store.append(data_key, framed))
        return _call("enqueue", lambda: store.add(count_key, 1))

    def queue_records(self, round_id: int) -> list[bytes]:  # noqa: D102
        data_key, _ = self._queue_keys(round_id)
        store = self._queue_store
        if not _call("queue_records", lambda: store.check([data_key])):
            return []
        raw = _call("queue_records", lambda: store.get(data_key))
        records: list[bytes] = []
        offset = 0
        while offset < len(raw):
            colon = raw.find(b":", offset, offset + 12)
            size_text = raw[offset:colon] if colon > offset else b""
            if not size_text.isdigit():
                raise RendezvousStateError(f"the join queue of round {round_id} is corrupt")
            start = colon + 1
            end = start + int(size_text)
            if end > len(raw):
                raise RendezvousStateError(f"the join queue of round {round_id} is truncated")
            records.append(raw[start:end])
            offset = end
        return records

    def queue_length(self, round_id: int) -> int:  # noqa: D102
        _, count_key = self._queue_keys(round_id)
        return _call("queue_length", lambda: self._queue_store.add(count_key, 0))

    def wait_queue_length(self, round_id: int, known: int, timeout: float) -> int:  # noqa: D102
        _, count_key = self._queue_keys(round_id)
        store = self._queue_store
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            # add(key, 0) reads the counter and creates it, so a watch that
            # follows has an exact "previous" value to compare against.
            length = self.queue_length(round_id)
            remaining = deadline - time.monotonic()
            if length != known or remaining <= 0:
                return length
            if store.supports_watch:
                previous = str(length).encode()
                _call("wait_queue_length", partial(store.watch, count_key, previous, remaining))
            else:
                time.sleep(min(remaining, poll_backoff(attempt)))
                attempt += 1

    def drop_queue(self, round_id: int) -> None:  # noqa: D102
        data_key, count_key = self._queue_keys(round_id)
        store = self._queue_store
        _call("drop_queue", lambda: store.delete_key(data_key))
        _call("drop_queue", lambda: store.delete_key(count_key))


class StoreLiveness(LivenessBackend):
    """The liveness capability over a store: one counter per node.

    Args:
        store: The store.
        prefix: The key prefix (ends with ``/``).
    """

    def __init__(self, store: Store, prefix: str) -> None:
        self._liveness_store = store
        self._liveness_prefix = prefix

    def _beat_key(self, node: str) -> str:
        return f"{self._liveness_prefix}hb/{validate_node_key(node)}"

    def beat(self, node: str) -> None:  # noqa: D102 - see LivenessBackend
        key = self._beat_key(node)
        _call("beat", lambda: self._liveness_store.add(key, 1))

    def heartbeat_mark(self, node: str) -> bytes | None:  # noqa: D102
        key = self._beat_key(node)
        # One round trip: add(key, 0) reads the counter (0, "never beat",
        # when the key is missing).
        value = _call("heartbeat_mark", lambda: self._liveness_store.add(key, 0))
        return str(value).encode() if value else None

    def forget(self, node: str) -> None:  # noqa: D102
        key = self._beat_key(node)
        _call("forget", lambda: self._liveness_store.delete_key(key))


class C10dRendezvousBackend(RendezvousBackend, WatchableBackend, StoreJoinQueue, StoreLiveness):
    """Keeps a run's rendezvous in a key-value store (the TCP store, usually).

    Args:
        store: The store; its operations must be atomic across clients.
        run_id: The run identifier; it names the keys.
        liveness_store: A second client of the same store for heartbeats, so
            a heartbeat never queues behind a long watch on a client that
            serialises requests (the TCP store does); ``store`` when None.

    Raises:
        ValueError: ``run_id`` is empty or holds whitespace.
    """

    def __init__(self, store: Store, run_id: str, liveness_store: Store | None = None) -> None:
        if not isinstance(run_id, str) or not run_id or any(c.isspace() for c in run_id):
            raise ValueError(f"run_id must be a non-empty string without whitespace: {run_id!r}")
        prefix = f"rdzv.backend/{run_id}/"
        StoreJoinQueue.__init__(self, store, prefix)
        StoreLiveness.__init__(self, liveness_store or store, prefix)
        self._store = store
        self._run_id = run_id
        self._key = f"{prefix}state"

    @property
    def name(self) -> str:
        """Always ``c10d``."""
        return "c10d"

    @property
    def store(self) -> Store:
        """The store the backend writes to."""
        return self._store

    @staticmethod
    def _decode(raw: bytes) -> tuple[bytes, Token]:
        if len(raw) < _HEADER or not raw.startswith(_MAGIC):
            raise RendezvousStateError(
                f"the stored rendezvous record is corrupt ({len(raw)} bytes, "
                f"starting {raw[:8]!r}); expected the {_MAGIC!r} header"
            )
        return raw[_HEADER:], raw

    def _read_raw(self) -> bytes | None:
        raw = _call("get_state", lambda: self._store.compare_set(self._key, _PROBE, _PROBE))
        return None if raw == _PROBE else raw

    def get_state(self) -> tuple[bytes, Token] | None:  # noqa: D102 - see RendezvousBackend
        raw = self._read_raw()
        return None if raw is None else self._decode(raw)

    def set_state(  # noqa: D102 - see RendezvousBackend
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is None:
            expected = b""
            generation = 1
        elif isinstance(token, bytes) and len(token) >= _HEADER and token.startswith(_MAGIC):
            expected = token
            generation = int.from_bytes(token[len(_MAGIC) : len(_MAGIC) + 8], "big") + 1
        else:
            current = self.get_state()
            return None if current is None else (*current, False)
        desired = _MAGIC + generation.to_bytes(8, "big") + secrets.token_bytes(4) + bytes(state)
        result = _call("set_state", lambda: self._store.compare_set(self._key, expected, desired))
        if result == desired:
            return bytes(state), desired, True
        if expected and result == expected:
            return None
        current_state, current_token = self._decode(result)
        return current_state, current_token, False

    def wait_for_state(  # noqa: D102 - see WatchableBackend
        self, token: Token | None, timeout: float
    ) -> tuple[bytes, Token] | None:
        previous = token if isinstance(token, bytes) else None
        store = self._store
        if store.supports_watch:
            raw = _call("wait_for_state", lambda: store.watch(self._key, previous, timeout))
            return None if raw is None else self._decode(raw)
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            raw = self._read_raw()
            remaining = deadline - time.monotonic()
            if raw != previous or remaining <= 0:
                return None if raw is None else self._decode(raw)
            time.sleep(min(remaining, poll_backoff(attempt)))
            attempt += 1

    def close(self) -> None:
        """Close the heartbeat client when it is a separate one."""
        if self._liveness_store is not self._store:
            self._liveness_store.close()


P10dRendezvousBackend = C10dRendezvousBackend
TpRendezvousBackend = C10dRendezvousBackend


DEFAULT_READ_TIMEOUT = 60.0


def _addresses_of(host: str) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return set()
    return {str(info[4][0]).split("%", 1)[0] for info in infos}


def endpoint_is_local(host: str) -> bool:
    """Tell whether ``host`` names this machine (IPv4 or IPv6; no reverse DNS).

    Args:
        host: A host name or numeric address.

    Returns:
        True when one of its ``getaddrinfo`` addresses is one of this
        machine's addresses or a loopback address.
    """
    found = _addresses_of(host)
    if any(ipaddress.ip_address(addr).is_loopback for addr in found):
        return True
    return bool(found & set(local_addresses()))


if TYPE_CHECKING:
    from rdzv.store.tcp import TCPStore


def _conf_path(params: RendezvousParameters, *keys: str) -> tuple[str, str] | None:
    """Return ``(key, path)`` of the first of ``keys`` set to a non-blank path."""
    for key in keys:
        path = (text_option(params, key) or "").strip()
        if path:
            return key, path
    return None


class StoreTLS:
    """The store's TLS settings: ``ca_cert`` (or ``cacert``), ``ssl_cert``, ``ssl_cert_key``.

    Args:
        params: The rendezvous parameters holding the keys.

    Raises:
        ValueError: Only one of ``ssl_cert`` and ``ssl_cert_key`` is set, or
            they are set without ``ca_cert``; the message names the keys.
    """

    def __init__(self, params: RendezvousParameters) -> None:
        self.ca = _conf_path(params, "ca_cert", "cacert")
        cert = _conf_path(params, "ssl_cert")
        key = _conf_path(params, "ssl_cert_key")
        if (cert is None) != (key is None):
            given = "ssl_cert" if cert is not None else "ssl_cert_key"
            raise ValueError(
                f"{given} is set without {'ssl_cert_key' if cert else 'ssl_cert'}: the store "
                "server's certificate needs both"
            )
        if cert is not None and self.ca is None:
            raise ValueError(
                "ssl_cert/ssl_cert_key are set without ca_cert: the nodes need ca_cert to verify "
                "the store server's certificate"
            )
        self.server_files = None if cert is None or key is None else (cert[1], key[1])

    @property
    def can_host(self) -> bool:
        """Whether this node can serve the store: TLS is off, or it has the certificate."""
        return self.ca is None or self.server_files is not None

    def client_context(self) -> ssl.SSLContext | None:
        """The context clients verify the server with; None without ``ca_cert``."""
        if self.ca is None:
            return None
        try:
            return ssl.create_default_context(cafile=self.ca[1])
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"{self.ca[0]} {self.ca[1]!r} cannot be loaded: {exc}") from exc

    def server_context(self) -> ssl.SSLContext | None:
        """The hosting node's server context; None when TLS is off.

        Raises:
            ValueError: TLS is on (``ca_cert``) but this node, which hosts the
                store, has no certificate, or the files cannot be loaded.
        """
        if self.ca is None:
            return None
        if self.server_files is None:
            raise ValueError(
                f"{self.ca[0]} is set (TLS on) but this node hosts the store and has no "
                "ssl_cert/ssl_cert_key to serve it with"
            )
        cert, key = self.server_files
        try:
            return server_tls_context(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"ssl_cert {cert!r} / ssl_cert_key {key!r} cannot be loaded: {exc}"
            ) from exc


def _tcp_store(
    host: str,
    port: int,
    is_master: bool,
    timeout: float,
    auth_token: bytes | None,
    tls: StoreTLS,
) -> TCPStore:
    from rdzv.store.tcp import TCPStore  # noqa: PLC0415 - imported only when used

    return TCPStore(
        host,
        port,
        is_master=is_master,
        timeout=timeout,
        auth_token=auth_token,
        ssl_context=tls.client_context(),
        server_ssl_context=tls.server_context() if is_master else None,
    )


def create_backend(params: RendezvousParameters) -> tuple[C10dRendezvousBackend, Store]:
    """Build the store backend and its store from rendezvous parameters.

    Recognised ``params.config`` keys: ``store_type`` (``tcp``, the only
    one), ``read_timeout`` (60 s: the store's timeout for blocking reads),
    ``auth_token_file`` (a file holding the store's shared secret; without
    it the ``RDZV_AUTH_TOKEN`` environment variable is read, and with
    neither the store is unauthenticated), ``ca_cert`` (or ``cacert``: the
    CA bundle every node verifies the store server's certificate with; it
    turns TLS on), ``ssl_cert`` and ``ssl_cert_key`` (the certificate and
    key the hosting node serves TLS with; the certificate must name the
    endpoint host), and ``is_host`` (host the TCP store server in this
    process). When
    ``is_host`` is absent it is inferred: this node hosts when it can (no
    TLS, or it has the server certificate) and the endpoint host resolves
    (``getaddrinfo``, IPv4 and IPv6) to one of this machine's addresses; if
    binding then fails (another local process hosts it), the node connects
    as a client instead.

    Args:
        params: The parameters; ``endpoint`` is ``host[:port]`` (29400 by
            default) and ``run_id`` names the keys.

    Returns:
        ``(backend, store)``.

    Raises:
        ValueError: ``store_type`` is not ``tcp`` or another option is invalid
            (including TLS files that cannot be loaded); the message names it.
        OSError: ``auth_token_file`` cannot be read.
        RendezvousConnectionError: The store could not be reached or hosted.
        StoreAuthenticationError: The store refused the secret, or needs one.
    """
    store_type = str(params.get("store_type", "tcp")).strip().lower()
    if store_type != "tcp":
        raise ValueError(
            f"the store backend supports store_type 'tcp' only, got {params.get('store_type')!r}"
        )
    host, port = parse_endpoint(params.endpoint)
    timeout = params.get_as_seconds("read_timeout") or DEFAULT_READ_TIMEOUT
    auth_token = resolve_auth_token(text_option(params, "auth_token_file"))
    tls = StoreTLS(params)
    explicit = params.get_as_bool("is_host")
    # A node without the server certificate cannot host a TLS store.
    inferred = explicit is None and tls.can_host and endpoint_is_local(host)
    is_host = inferred if explicit is None else explicit
    store: TCPStore
    if is_host:
        try:
            store = _tcp_store(host, port, True, timeout, auth_token, tls)
        except (OSError, RendezvousConnectionError) as exc:
            if explicit:
                raise RendezvousConnectionError(
                    f"could not host the rendezvous store on port {port}: {exc}"
                ) from exc
            store = _tcp_store(host, port, False, timeout, auth_token, tls)
    else:
        store = _tcp_store(host, port, False, timeout, auth_token, tls)
    liveness = store.clone()
    return C10dRendezvousBackend(store, params.run_id, liveness_store=liveness), store
