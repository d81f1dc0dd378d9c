"""The rendezvous backend over a key-value :class:`~rdzv.store.base.Store`.

One class, importable as ``C10dRendezvousBackend``, ``P10dRendezvousBackend``
and ``TpRendezvousBackend``. It offers every capability:

* state: a *head* key holding ``b"RDZ2" + generation (8 bytes) + nonce (4
  bytes)``, which is the fencing token, and a *body* key named after the
  head holding the state. A write stores the new body under its new head's
  name, then moves the head with one ``compare_set`` (the commit point; a
  loser deletes its body). The generation only grows, so a stale token never
  matches again; the random nonce makes "did my write win?" exact even when
  two writers store identical bytes. A read of an unchanged state costs one
  16-byte head and no body: the backend keeps the body of the last head it
  saw, so a member polling a state of thousands of participants reads O(1)
  bytes a poll, not the whole list. A record of the older one-key layout
  (``b"RDZ1" + generation + nonce + state``, the whole value the token) is
  still read, and the next write replaces it with a head;
* a replaced body outlives its replacement by :data:`RETAIN_REPLACED`
  seconds on the clock of the winner that replaced it, which deletes it at
  its first read or write after that, or when it closes. A reader (a
  loser's read of the head that beat it, or any read) fetches the body a
  head names, then the head, with one ``try_multi_get``: the body can be
  gone only if that one round trip took longer than the retention, however
  fast others write, and the same reply names the head to read next. So a
  read costs one round trip, two when the head moved meanwhile, whatever
  the write rate. A winner that dies leaves the bodies it had not yet
  deleted behind;
* a store with torch's ``Store`` API (``torch.distributed.HashStore``,
  ``TCPStore``, ``FileStore``) is taken as it is and wrapped once
  (:func:`~rdzv.store.foreign.as_store`). It has no atomic
  ``try_multi_get``, nor has rdzv's client of torch's server: there
  :meth:`Store.try_multi_get <rdzv.store.base.Store.try_multi_get>` reads
  the body, then the head, each with a ``compare_set`` that neither writes
  nor waits. That order keeps every conclusion of a read true. A body
  found belongs to the head that names it, which was committed. A body
  missing while the head read after it still names it is corruption, as
  with one atomic read: a head never comes back once replaced (its
  generation only grows, its nonce is random), so that head named the body
  from the first read to the last, and a body is deleted only after its
  head was replaced. A body missing under a head that moved is a lost race
  (rare: the body was read :data:`RETAIN_REPLACED` seconds or more after
  the head that named it), and the newer head is read next. A lost race is
  never an error; only a state that moved on faster than it could be read,
  ``_BODY_ATTEMPTS`` times in a row, is one, and a retryable one
  (:class:`~rdzv.errors.RendezvousConnectionError`), as on rdzv's stores.
  Without ``watch``, waits poll;
* watch: ``Store.watch`` on the head key when the store supports it,
  otherwise polling with jittered, capped backoff;
* seats: a seated write stores each member's seat under
  ``seat/<node key>`` in one ``multi_set`` once its ``compare_set`` moved
  the head, each value led by the new head, so a seat is read for the head
  that committed it and no other, and a seat found proves that head was
  committed (a waiter watching its seat key reads nothing more); the next
  seat of a node overwrites it, so the store holds one seat per node. A
  writer that dies between the two leaves a committed state without seats:
  its readers find no seat and read the state (:mod:`rdzv.dynamic.seat`).
  A pseudo-node's seat (the state's summary) goes in the same ``multi_set``
  as the body, before the head moves, so that whoever reads the new head
  finds it;
* join queue: ``append`` of a length-prefixed record, then ``add`` on the
  round's counter (two non-conflicting operations per joining node);
* liveness: ``add(key, 1)`` on a per-node counter.

Keys live under ``rdzv.backend/<run_id>/``. Store failures become
:class:`~rdzv.errors.RendezvousConnectionError`.

:func:`open_store` builds the store of ``store_type``: the TCP store (hosted
by one node, the others its clients) or a :class:`~rdzv.store.file.FileStore`
(one file on a filesystem the nodes share; no server). A store that cannot be
reached, hosted or opened fails with torch's message first.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import tempfile
import threading
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING

from rdzv.backends.base import (
    ListedBackend,
    RendezvousBackend,
    SeatedBackend,
    Token,
    WatchableBackend,
    is_pseudo_node,
    validate_node_key,
    validate_run_id,
    validate_seats,
)
from rdzv.backends.kv import StoreJoinQueue, StoreLiveness, store_call
from rdzv.backends.options import StoreBackendOptions
from rdzv.errors import RendezvousConnectionError, RendezvousError, RendezvousStateError
from rdzv.keys import backend_prefix, runs_of, seat_key, state_key
from rdzv.net import listen_addresses
from rdzv.retry import Clock, as_clock, current_clock, deadline_within, poll_backoff
from rdzv.store.foreign import StoreLike, as_store

if TYPE_CHECKING:
    from rdzv.api import RendezvousParameters
    from rdzv.store.base import Store
    from rdzv.store.file import FileStore
    from rdzv.store.tcp import TCPStore

__all__ = [
    "C10dRendezvousBackend",
    "P10dRendezvousBackend",
    "StoreJoinQueue",
    "StoreLiveness",
    "TpRendezvousBackend",
    "connection_limit",
    "create_backend",
    "open_store",
]

_C10D_FAILED = "The connection to the C10d store has failed. See inner exception for details."
_FILE_FAILED = "The file creation for C10d store has failed. See inner exception for details."

_MAGIC = b"RDZ1"
_HEAD_MAGIC = b"RDZ2"
_MAGICS = (_MAGIC, _HEAD_MAGIC)
_HEADER = len(_MAGIC) + 8 + 4
_GENERATION = slice(len(_MAGIC), len(_MAGIC) + 8)
_PROBE = b"\x00rdzv-probe"
# Atomic reads of a head and its body, each missing a body replaced over
# RETAIN_REPLACED seconds before, before giving up.
_BODY_ATTEMPTS = 8
RETAIN_REPLACED = 2.0
"""Seconds a replaced state body is kept for readers of the head that named it."""
# Seconds a closing backend spends deleting the bodies it replaced (a store
# that does not answer leaves them behind rather than delay the close).
_CLOSE_BOUND = 2.0


class C10dRendezvousBackend(
    RendezvousBackend, WatchableBackend, SeatedBackend, ListedBackend, StoreJoinQueue, StoreLiveness
):
    """Keeps a run's rendezvous in a key-value store (the TCP store, usually).

    Args:
        store: The store; its operations must be atomic across clients. An
            rdzv store, or one with torch's ``Store`` API (wrapped once by
            :func:`~rdzv.store.foreign.as_store`).
        run_id: The run identifier; it names the keys.
        liveness_store: A second client of the same store for heartbeats, so
            a heartbeat never queues behind a long watch on a client that
            serialises requests (the TCP store does); ``store`` when None.
        clock: Times how long replaced bodies are kept; real time when None.

    Raises:
        ValueError: ``run_id`` is empty or holds whitespace.
        TypeError: A store is neither kind.
    """

    def __init__(
        self,
        store: StoreLike,
        run_id: str,
        liveness_store: StoreLike | None = None,
        clock: Clock | None = None,
    ) -> None:
        validate_run_id(run_id)
        prefix = backend_prefix(run_id)
        store = as_store(store)
        StoreJoinQueue.__init__(self, store, prefix)
        StoreLiveness.__init__(
            self, store if liveness_store is None else as_store(liveness_store), prefix
        )
        self._store = store
        self._run_id = run_id
        self._prefix = prefix
        self._key = state_key(prefix)
        # The body of the last head read or written: an unchanged state is
        # read as its head alone.
        self._last: tuple[bytes, bytes] | None = None
        self._clock = as_clock(clock)
        # (head, when) of the bodies this backend's wins replaced, not yet
        # deleted; shared with its side-channel view, whose evictions write too.
        self._replaced: list[tuple[bytes, float]] = []
        self._replaced_lock = threading.Lock()
        # Each node's seat as last read (head and seat), by node key.
        self._seats_seen: dict[str, bytes] = {}

    @property
    def name(self) -> str:
        """Always ``c10d``."""
        return "c10d"

    @property
    def store(self) -> Store:
        """The store the backend writes to."""
        return self._store

    def _corrupt(self, raw: bytes) -> RendezvousStateError:
        return RendezvousStateError(
            f"the stored rendezvous record ({self._key!r}) is corrupt ({len(raw)} bytes, "
            f"starting {raw[:8]!r}); expected a {_HEAD_MAGIC!r} or {_MAGIC!r} header"
        )

    def _body_key(self, head: bytes) -> str:
        return f"{self._key}/{head[len(_HEAD_MAGIC) :].hex()}"

    def _is_head(self, raw: bytes) -> bool:
        return len(raw) == _HEADER and raw.startswith(_HEAD_MAGIC)

    def _resolve(self, raw: bytes) -> tuple[bytes, Token]:
        """Return ``(state, token)`` for a stored head (reading its body) or old-layout record.

        Each attempt reads the body ``raw`` names, then the head, in one
        request (see the module); a body missing under a head that moved is
        a lost race, and the head read with it is tried next.

        Raises:
            RendezvousStateError: The record is corrupt, or a head's body is
                missing although the head did not move.
            RendezvousConnectionError: The head moved on two generations
                faster than its bodies could be read, ``_BODY_ATTEMPTS`` times.
        """
        for _ in range(_BODY_ATTEMPTS):
            if not self._is_head(self._checked(raw)):
                return raw[_HEADER:], raw
            cached = self._last
            if cached is not None and cached[1] == raw:
                return cached
            key = self._body_key(raw)
            # The body first: on a store that reads the keys one after the
            # other (a torch store), the head is then read after the body.
            body, current = store_call(
                "get_state", partial(self._store.try_multi_get, [key, self._key])
            )
            if body is not None:
                self._last = (body, raw)
                self._collect()
                return body, raw
            if current is None:
                raise RendezvousStateError(f"the rendezvous record {self._key!r} vanished")
            if current == raw:
                raise RendezvousStateError(
                    f"the stored rendezvous head {self._key!r} names the body {key!r}, "
                    "which is missing"
                )
            raw = current
        raise RendezvousConnectionError(
            f"the rendezvous state {self._key!r} changed {_BODY_ATTEMPTS} times while it was read"
        )

    def _read_raw(self) -> bytes | None:
        raw = store_call("get_state", lambda: self._store.compare_set(self._key, _PROBE, _PROBE))
        return None if raw == _PROBE else raw

    def get_state(self) -> tuple[bytes, Token] | None:  # noqa: D102 - see RendezvousBackend
        raw = self._read_raw()
        return None if raw is None else self._resolve(raw)

    def _discard(self, head: bytes) -> None:
        """Delete the body of ``head``; a failure leaves only garbage, so it is ignored."""
        key = self._body_key(head)
        with contextlib.suppress(RendezvousError):
            store_call("set_state", lambda: self._store.delete_key(key))

    def _collect(self, everything: bool = False) -> None:
        """Delete the bodies this backend replaced :data:`RETAIN_REPLACED` seconds ago or more."""
        if not self._replaced:
            return
        cutoff = math.inf if everything else self._clock() - RETAIN_REPLACED
        with self._replaced_lock:
            due = [head for head, when in self._replaced if when <= cutoff]
            self._replaced[:] = [(h, when) for h, when in self._replaced if when > cutoff]
        for head in due:
            self._discard(head)

    def set_state(  # noqa: D102 - see RendezvousBackend
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        return self._write(state, token, {})

    def set_state_seated(  # noqa: D102 - see SeatedBackend
        self, state: bytes, token: Token | None, seats: Mapping[str, bytes]
    ) -> tuple[bytes, Token, bool] | None:
        validate_seats(seats)
        return self._write(state, token, seats)

    def _write(
        self, state: bytes, token: Token | None, seats: Mapping[str, bytes]
    ) -> tuple[bytes, Token, bool] | None:
        """Store the body (and seats) under a new head, then move the head to it."""
        if token is None:
            expected = b""
            generation = 1
        elif isinstance(token, bytes) and len(token) >= _HEADER and token[:4] in _MAGICS:
            expected = token
            generation = int.from_bytes(token[_GENERATION], "big") + 1
            if generation >= 1 << 64:
                raise RendezvousStateError(
                    f"the stored rendezvous record ({self._key!r}) has generation 2**64-1, "
                    "which no writer reaches: it is forged or corrupt; delete the key to start over"
                )
        else:
            current = self.get_state()
            return None if current is None else (*current, False)
        state = bytes(state)
        head = _HEAD_MAGIC + generation.to_bytes(8, "big") + secrets.token_bytes(4)
        body_key = self._body_key(head)
        # Each seat is led by the head that commits it (read_seat answers for
        # that head only). A pseudo-node's seat describes the write (the
        # state's summary): it goes with the body, so that whoever sees the
        # new head finds it. A member's seat only once the head moved: a seat
        # found is then a committed write's (its member reads nothing more).
        early = [node for node in seats if is_pseudo_node(node)]
        members = [node for node in seats if not is_pseudo_node(node)]
        keys = [body_key, *(seat_key(self._prefix, node) for node in early)]
        values = [state, *(head + seats[node] for node in early)]
        store_call("set_state", lambda: self._store.multi_set(keys, values))
        result = store_call("set_state", lambda: self._store.compare_set(self._key, expected, head))
        if result == head:
            self._last = (state, head)
            if self._is_head(expected):
                with self._replaced_lock:
                    self._replaced.append((expected, self._clock()))
            # Bodies due for deletion go before the seats: once the seats
            # land, every member sends its confirmation at once, and a request
            # of this node's with a reply would queue behind theirs.
            self._collect()
            if members:
                seated = [seat_key(self._prefix, node) for node in members]
                places = [head + seats[node] for node in members]
                store_call("set_state", lambda: self._store.multi_set(seated, places))
            return state, head, True
        self._discard(head)
        if expected and result == expected:
            return None
        current_state, current_token = self._resolve(result)
        return current_state, current_token, False

    def read_seat(self, token: Token, node: str) -> bytes | None:  # noqa: D102 - see SeatedBackend
        key = seat_key(self._prefix, validate_node_key(node))
        if not (isinstance(token, bytes) and self._is_head(token)):
            return None
        raw = self._seats_seen.get(node)
        if raw is None or not raw.startswith(token):
            # A seat is never rewritten under its head: one seen is current.
            raw = store_call("read_seat", lambda: self._store.try_multi_get([key]))[0]
            self._seen(node, raw)
        if raw is None or not raw.startswith(token) or len(raw) == len(token):
            return None
        return raw[len(token) :]

    def wait_for_seat(  # noqa: D102 - see SeatedBackend
        self, token: Token | None, node: str, timeout: float
    ) -> Token | None:
        key = seat_key(self._prefix, validate_node_key(node))
        store = self._store
        headed = isinstance(token, bytes) and self._is_head(token)
        if not store.supports_watch or not (token is None or headed):
            return self.wait_for_token(token, timeout)
        # A seat of any head is newer than nothing stored.
        known = b"" if token is None else token[_GENERATION]
        clock = current_clock()
        deadline = clock() + timeout
        while True:
            previous = self._seats_seen.get(node)
            remaining = max(0.0, deadline - clock())
            raw = store_call("wait_for_seat", partial(store.watch, key, previous, remaining))
            if raw == previous:
                return self.read_token()  # the timeout: the caller looks at the token
            self._seen(node, raw)
            head = b"" if raw is None else raw[:_HEADER]
            if self._is_head(head) and head[_GENERATION] > known:
                # A newer write seated this node, and seats follow the commit.
                return head

    def _seen(self, node: str, raw: bytes | None) -> None:
        """Remember ``node``'s stored seat (what :meth:`wait_for_seat` watches)."""
        if raw is None:
            self._seats_seen.pop(node, None)
        else:
            self._seats_seen[node] = raw

    def forget(self, node: str) -> None:
        """Delete ``node``'s heartbeat counter and its seat (a node that leaves for good)."""
        super().forget(node)
        self._seen(node, None)
        key = seat_key(self._prefix, node)
        store_call("forget", lambda: self._liveness_store.delete_key(key))

    def runs(self) -> list[str]:  # noqa: D102 - see ListedBackend
        return runs_of(store_call("list_keys", self._store.list_keys))

    def of_run(self, run_id: str) -> C10dRendezvousBackend:  # noqa: D102
        return C10dRendezvousBackend(self._store, run_id)

    def read_token(self) -> Token | None:  # noqa: D102 - see SeatedBackend
        raw = self._read_raw()
        if raw is None:
            return None
        self._collect()
        return self._checked(raw)

    def _checked(self, raw: bytes) -> bytes:
        """Return a stored head or old-layout record; raise for anything else."""
        if self._is_head(raw) or (len(raw) >= _HEADER and raw.startswith(_MAGIC)):
            return raw
        raise self._corrupt(raw)

    def wait_for_state(  # noqa: D102 - see WatchableBackend
        self, token: Token | None, timeout: float
    ) -> tuple[bytes, Token] | None:
        raw = self.wait_for_token(token, timeout)
        return None if raw is None else self._resolve(raw)

    def wait_for_token(  # noqa: D102 - see SeatedBackend
        self, token: Token | None, timeout: float
    ) -> Token | None:
        previous = token if isinstance(token, bytes) else None
        store = self._store
        if store.supports_watch:
            raw = store_call("wait_for_state", lambda: store.watch(self._key, previous, timeout))
            return None if raw is None else self._checked(raw)
        clock = current_clock()
        deadline = clock() + timeout
        attempt = 0
        while True:
            raw = self._read_raw()
            remaining = deadline - clock()
            if raw != previous or remaining <= 0:
                return None if raw is None else self._checked(raw)
            clock.sleep(min(remaining, poll_backoff(attempt)))
            attempt += 1

    def side_channel(self) -> C10dRendezvousBackend:
        """Return a view (owning no client) on the heartbeat client, which never blocks."""
        if self._liveness_store is self._store:
            return self
        view = C10dRendezvousBackend(self._liveness_store, self._run_id, clock=self._clock)
        view._replaced, view._replaced_lock = self._replaced, self._replaced_lock
        return view

    def close(self) -> None:
        """Delete the bodies this backend replaced; close the heartbeat client when separate."""
        with deadline_within(_CLOSE_BOUND):
            self._collect(everything=True)
        if self._liveness_store is not self._store:
            self._liveness_store.close()


P10dRendezvousBackend = C10dRendezvousBackend
TpRendezvousBackend = C10dRendezvousBackend


CONNECTIONS_PER_NODE = 6
"""Connections a hosted store allows per node of the job (see :func:`connection_limit`)."""


def connection_limit(max_nodes: int | None) -> int | None:
    """Return the connection limit of a store hosted for a job of ``max_nodes``.

    Each node holds three clients (one for its blocking watch, one for
    heartbeats and evictions, which must never queue behind that watch on a
    client that serialises requests, and an idle one that holds its will,
    :mod:`rdzv.store.will`); the limit allows twice that, for clones and
    reconnections, and never less than the server's default.
    None (the server's default) when ``max_nodes`` is not known.
    """
    if max_nodes is None:
        return None
    from rdzv.store.server import DEFAULT_MAX_CONNECTIONS  # noqa: PLC0415 - hosts only

    return max(DEFAULT_MAX_CONNECTIONS, CONNECTIONS_PER_NODE * max_nodes + 64)


def _tcp_store(
    options: StoreBackendOptions, is_master: bool, max_nodes: int | None = None
) -> TCPStore:
    from rdzv.store.tcp import TCPStore  # noqa: PLC0415 - imported only when used

    listen = listen_addresses(options.host, listen_all=options.listen_all) if is_master else None
    return TCPStore(
        options.host,
        options.port,
        is_master=is_master,
        listen=listen,
        timeout=options.read_timeout,
        auth_token=options.auth_token,
        ssl_context=options.tls.client_context(),
        server_ssl_context=options.tls.server_context() if is_master else None,
        max_connections=connection_limit(max_nodes) if is_master else None,
    )


def _host_or_connect(options: StoreBackendOptions, max_nodes: int | None) -> TCPStore:
    if options.should_host():
        try:
            return _tcp_store(options, True, max_nodes)
        except (OSError, RendezvousConnectionError) as exc:
            if options.is_host:
                raise RendezvousConnectionError(
                    f"could not host the rendezvous store on port {options.port}: {exc}"
                ) from exc
    return _tcp_store(options, False)


def _file_store(options: StoreBackendOptions) -> FileStore:
    from rdzv.store.file import FileStore  # noqa: PLC0415 - imported only when used

    path = options.path
    world_size = -1
    if path is None:
        try:
            fd, path = tempfile.mkstemp(prefix="rdzv-filestore-")
        except OSError as exc:
            raise RendezvousError(f"{_FILE_FAILED} {exc}") from exc
        os.close(fd)
        # Private to this handler: removed when its last user (store, clone) closes.
        world_size = 1
    return FileStore(path, world_size, timeout=options.read_timeout)


def open_store(
    options: StoreBackendOptions, max_nodes: int | None = None
) -> tuple[C10dRendezvousBackend, Store]:
    """Build the store backend and its store from parsed options, hosting it when told.

    ``store_type=file``: a :class:`~rdzv.store.file.FileStore` on
    ``options.path`` (torch's ``FileStore`` format), or on a private
    temporary file that is removed when the handler closes.

    ``store_type=tcp``: when
    :meth:`~rdzv.backends.options.StoreBackendOptions.should_host` says so,
    this process serves the TCP store; if binding fails and ``is_host`` was
    inferred (another local process hosts it), the node connects as a client
    instead. A hosted server allows :func:`connection_limit` connections
    for a job of ``max_nodes`` (None: the server's default).

    Raises:
        ValueError: A TLS file cannot be loaded; the message names it.
        RendezvousConnectionError: The store could not be reached, hosted
            with ``is_host=1``, or opened; torch's message first.
        RendezvousError: The private temporary file could not be created
            (torch's message first).
        StoreAuthenticationError: The store refused the secret, or needs one.
    """
    store: FileStore | TCPStore
    try:
        store = (
            _file_store(options)
            if options.store_type == "file"
            else _host_or_connect(options, max_nodes)
        )
        try:
            liveness = store.clone()
        except BaseException:
            store.close()
            raise
    except RendezvousConnectionError as exc:
        if str(exc).startswith(_C10D_FAILED):
            raise
        raise RendezvousConnectionError(f"{_C10D_FAILED} {exc}") from exc
    return C10dRendezvousBackend(store, options.run_id, liveness_store=liveness), store


def create_backend(params: RendezvousParameters) -> tuple[C10dRendezvousBackend, Store]:
    """Build the store backend and its store from rendezvous parameters.

    Options: see :meth:`rdzv.backends.options.StoreBackendOptions.from_params`
    (``store_type`` ``tcp`` or ``file``, ``read_timeout``, ``auth_token_file``, ``ca_cert``,
    ``ssl_cert``, ``ssl_cert_key``, ``is_host``) and :func:`open_store` for
    the hosting decision. The ``endpoint`` is ``host[:port]`` (29400 by
    default), or the file's path with ``store_type=file``.

    Raises:
        ValueError: An option is invalid (including TLS files that cannot
            be loaded); the message names it, torch's message first.
        RendezvousConnectionError: The store could not be reached, hosted or
            opened; torch's message first.
        StoreAuthenticationError: The store refused the secret, or needs one.
    """
    return open_store(StoreBackendOptions.from_params(params), params.max_nodes)
