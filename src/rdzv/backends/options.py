"""Backend options: the parameter bag parsed once, at the edge, into typed settings.

``RendezvousParameters.config`` is a bag of strings (``--rdzv-conf k=v,...``).
Each built-in engine reads it exactly once, in ``from_params`` of its frozen
options class below, and from then on only typed fields travel: the
backend factories (``create_backend``) take these objects, never the bag.
Every default is written once, as a class attribute or a module constant
here, and every bad value is a ``ValueError`` naming its key, raised while
parsing, before any connection is made.

The hosting decision of the TCP store (does this node serve the store?) is
one method, :meth:`StoreBackendOptions.should_host`; the in-process backend
and the torchrun plugin both ask it and differ only in how they host (a
thread or a child process).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from rdzv.auth import resolve_auth_token
from rdzv.backends.base import validate_run_id
from rdzv.endpoint import parse_endpoint, split_endpoints
from rdzv.net import is_local_address, local_addresses, server_tls_context

if TYPE_CHECKING:
    from rdzv.api import RendezvousParameters

__all__ = [
    "DEFAULT_ETCD_PORT",
    "DEFAULT_LIVENESS_TTL",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_REDIS_PORT",
    "DEFAULT_STATE_TTL",
    "EtcdOptions",
    "KeySettings",
    "RedisOptions",
    "StoreBackendOptions",
    "StoreTLS",
    "check_key_settings",
    "endpoint_is_local",
    "parse_endpoints",
    "text_option",
]

#: Seconds a blocking read of a backend may take (the ``read_timeout`` key).
DEFAULT_READ_TIMEOUT = 60.0

#: Seconds an unwritten state survives on a server with expiry (two hours).
DEFAULT_STATE_TTL = 7200

#: Seconds a heartbeat record survives on a server without a beat.
DEFAULT_LIVENESS_TTL = 60

#: etcd's client port.
DEFAULT_ETCD_PORT = 2379

#: Redis's port.
DEFAULT_REDIS_PORT = 6379


def text_option(params: RendezvousParameters, key: str) -> str | None:
    """Return a backend setting as text, None when absent or empty."""
    value: Any = params.get(key)
    if value is None or value == "":
        return None
    return str(value)


def _path_option(params: RendezvousParameters, *keys: str) -> tuple[str, str] | None:
    """Return ``(key, path)`` of the first of ``keys`` set to a non-blank path."""
    for key in keys:
        path = (text_option(params, key) or "").strip()
        if path:
            return key, path
    return None


def _read_timeout(params: RendezvousParameters) -> float:
    seconds = params.get_as_seconds("read_timeout")
    if seconds is None:
        return DEFAULT_READ_TIMEOUT
    if not seconds > 0:
        raise ValueError(
            f"The read timeout must be a positive integer. Got {params.get('read_timeout')!r}; "
            "rdzv accepts any positive number of seconds."
        )
    return seconds


def _choice(params: RendezvousParameters, key: str, allowed: tuple[str, ...], head: str) -> str:
    """Return the lower-cased value of ``key`` (``allowed[0]`` when unset), checked.

    A bad value is a ``ValueError`` starting with ``head`` (torch's message,
    where torch checks the key).
    """
    value = (text_option(params, key) or allowed[0]).strip().lower()
    if value not in allowed:
        names = " or ".join(repr(a) for a in allowed)
        raise ValueError(f"{head} Got {key}={params.get(key)!r}; expected {names}.")
    return value


def check_key_settings(
    engine: str,
    run_id: str,
    key_prefix: str | None,
    default_prefix: str,
    ttl: int | None,
    liveness_ttl: int | None,
) -> tuple[str, int, int]:
    """Validate the key and expiry settings of a backend on a key-value server.

    Args:
        engine: The server's name, for messages (``etcd``, ``Redis``).
        run_id: The run id.
        key_prefix: The prefix of every key, or None for ``default_prefix``.
        default_prefix: The engine's default prefix.
        ttl: Seconds an unwritten state survives, or None for
            :data:`DEFAULT_STATE_TTL`.
        liveness_ttl: Seconds a heartbeat survives, or None for
            :data:`DEFAULT_LIVENESS_TTL`.

    Returns ``(prefix, ttl, liveness_ttl)`` with the defaults filled in.

    Raises:
        ValueError: A bad run id (see :func:`~rdzv.backends.base.validate_run_id`),
            an empty prefix, or a TTL that is not a whole
            number of seconds >= 1; the message names the bad value.
    """
    validate_run_id(run_id)
    prefix = default_prefix if key_prefix is None else key_prefix
    if not prefix:
        raise ValueError(f"the {engine} key prefix must not be empty")
    ttl = DEFAULT_STATE_TTL if ttl is None else ttl
    liveness_ttl = DEFAULT_LIVENESS_TTL if liveness_ttl is None else liveness_ttl
    for name, value in (("ttl", ttl), ("liveness_ttl", liveness_ttl)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number of seconds >= 1, got {value!r}")
    return prefix, ttl, liveness_ttl


@dataclass(frozen=True)
class KeySettings:
    """Where a run's keys live on a key-value server, and how long they survive.

    Args:
        key_prefix: The prefix of every key; None for the engine's default.
        ttl: Seconds an unwritten state survives; None for :data:`DEFAULT_STATE_TTL`.
    """

    key_prefix: str | None = None
    ttl: int | None = None

    @classmethod
    def from_params(
        cls, params: RendezvousParameters, engine: str, default_prefix: str
    ) -> KeySettings:
        """Read ``key_prefix`` and ``ttl``, checked as the backend will check them.

        Raises:
            ValueError: A bad prefix or ttl; the message names it.
        """
        settings = cls(text_option(params, "key_prefix"), params.get_as_int("ttl"))
        check_key_settings(
            engine, params.run_id, settings.key_prefix, default_prefix, settings.ttl, None
        )
        return settings


def _addresses_of(host: str) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return set()
    return {str(info[4][0]).split("%", 1)[0] for info in infos}


def endpoint_is_local(host: str) -> bool:
    """Tell whether ``host`` names this machine (IPv4 or IPv6; no reverse DNS).

    True when one of its ``getaddrinfo`` addresses is a loopback address, one
    of :func:`rdzv.net.local_addresses`, or assigned to one of this machine's
    interfaces (:func:`rdzv.net.is_local_address`).
    """
    found = _addresses_of(host)
    if any(ipaddress.ip_address(addr).is_loopback for addr in found):
        return True
    return bool(found & set(local_addresses())) or any(is_local_address(a) for a in found)


@dataclass(frozen=True)
class StoreTLS:
    """The TCP store's TLS settings: ``ca_cert`` (or ``cacert``), ``ssl_cert``, ``ssl_cert_key``.

    Args:
        ca: ``(key, path)`` of the CA bundle nodes verify the server with;
            None: TLS is off.
        server_files: ``(certificate, key)`` paths this node can serve TLS
            with, or None.
    """

    ca: tuple[str, str] | None = None
    server_files: tuple[str, str] | None = None

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> StoreTLS:
        """Read the TLS keys.

        Raises:
            ValueError: A file does not exist, only one of ``ssl_cert`` and
                ``ssl_cert_key`` is set, or they are set without ``ca_cert``;
                the message names the keys.
        """
        ca = _path_option(params, "ca_cert", "cacert")
        cert = _path_option(params, "ssl_cert")
        key = _path_option(params, "ssl_cert_key")
        for named in (ca, cert, key):
            if named is not None and not os.path.isfile(named[1]):
                raise ValueError(f"{named[0]} {named[1]!r} cannot be loaded: no such file")
        if (cert is None) != (key is None):
            given = "ssl_cert" if cert is not None else "ssl_cert_key"
            raise ValueError(
                f"{given} is set without {'ssl_cert_key' if cert else 'ssl_cert'}: the store "
                "server's certificate needs both"
            )
        if cert is not None and ca is None:
            raise ValueError(
                "ssl_cert/ssl_cert_key are set without ca_cert: the nodes need ca_cert to verify "
                "the store server's certificate"
            )
        return cls(ca, None if cert is None or key is None else (cert[1], key[1]))

    @property
    def can_host(self) -> bool:
        """Whether this node can serve the store: TLS is off, or it has the certificate."""
        return self.ca is None or self.server_files is not None

    def client_context(self) -> ssl.SSLContext | None:
        """The context clients verify the server with; None without ``ca_cert``.

        Raises:
            ValueError: The CA bundle cannot be loaded; the message names it.
        """
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


_TCP_ONLY_KEYS = ("auth_token_file", "ca_cert", "cacert", "ssl_cert", "ssl_cert_key")


@dataclass(frozen=True)
class StoreBackendOptions:
    """The options of the store backend (``c10d`` and its aliases).

    Args:
        host: The endpoint's host (``store_type=tcp``; empty for a file).
        port: The endpoint's port (``store_type=tcp``; 0 for a file).
        run_id: The run; it names the keys.
        read_timeout: The store's timeout for blocking reads, in seconds.
        auth_token_file: The file the shared secret was read from, or None.
        auth_token: The shared secret (from the file or ``$RDZV_AUTH_TOKEN``), or None.
        tls: The TLS settings.
        is_host: ``is_host`` as given (None: infer it, see :meth:`should_host`).
        store_type: ``tcp`` (a TCP store, hosted by one node) or ``file``
            (one file on a filesystem the nodes share, no server).
        path: The file of ``store_type=file``; None: a private temporary
            file, for processes of one job on one machine that share this
            handler only.
        listen_all: The hosted store listens on every address, not only on
            the endpoint's host and loopback (:func:`~rdzv.net.listen_addresses`).
    """

    STORE_TYPES: ClassVar[tuple[str, ...]] = ("tcp", "file")

    #: The configuration keys :meth:`from_params` reads.
    KEYS: ClassVar[frozenset[str]] = frozenset(
        {"store_type", "read_timeout", "is_host", "listen_all", *_TCP_ONLY_KEYS}
    )

    host: str
    port: int
    run_id: str
    read_timeout: float = DEFAULT_READ_TIMEOUT
    auth_token_file: str | None = None
    auth_token: bytes | None = field(default=None, repr=False)
    tls: StoreTLS = field(default_factory=StoreTLS)
    is_host: bool | None = None
    store_type: str = "tcp"
    path: str | None = None
    listen_all: bool = False

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> StoreBackendOptions:
        """Parse the store backend's keys.

        Keys: ``store_type`` (``tcp``, the default, or ``file``: then the
        endpoint is the file's path, and an empty endpoint a private
        temporary file), ``read_timeout`` (60 s), ``is_host``, and for
        ``tcp`` only: ``auth_token_file`` (else ``$RDZV_AUTH_TOKEN``),
        ``ca_cert`` (or ``cacert``), ``ssl_cert``, ``ssl_cert_key`` and
        ``listen_all`` (false). The
        ``endpoint`` is ``host[:port]`` (``tcp``) or a path (``file``).

        Raises:
            ValueError: A bad value, naming its key (including ``is_host=1``
                with TLS on and no server certificate, a secret file that is
                empty or cannot be read, and secret or TLS keys with
                ``store_type=file``); torch's message first where torch
                checks the same.
        """
        store_type = _choice(
            params,
            "store_type",
            cls.STORE_TYPES,
            "Invalid store type given. Currently only supports file and tcp.",
        )
        if store_type == "file":
            given = [key for key in _TCP_ONLY_KEYS if text_option(params, key)]
            if given:
                raise ValueError(
                    f"{', '.join(given)} apply to store_type=tcp only: a file store has no "
                    "server to authenticate or encrypt"
                )
            return cls(
                "",
                0,
                params.run_id,
                _read_timeout(params),
                is_host=params.get_as_bool("is_host"),
                store_type=store_type,
                path=params.endpoint or None,
            )
        host, port = parse_endpoint(params.endpoint)
        is_host = params.get_as_bool("is_host")
        read_timeout = _read_timeout(params)
        token_file = text_option(params, "auth_token_file")
        tls = StoreTLS.from_params(params)
        if is_host and not tls.can_host:
            raise ValueError(
                f"{tls.ca[0] if tls.ca else 'ca_cert'} is set (TLS on) but this node hosts the "
                "store (is_host=1) and has no ssl_cert/ssl_cert_key to serve it with"
            )
        try:
            token = resolve_auth_token(token_file)
        except OSError as exc:
            raise ValueError(
                f"auth_token_file {token_file!r} cannot be read: {exc.strerror or exc}"
            ) from exc
        listen_all = bool(params.get_as_bool("listen_all", False))
        return cls(
            host,
            port,
            params.run_id,
            read_timeout,
            token_file,
            token,
            tls,
            is_host,
            listen_all=listen_all,
        )

    @property
    def secured(self) -> bool:
        """Whether clients need rdzv's own protocol (a shared secret or TLS)."""
        return self.tls.ca is not None or self.auth_token is not None

    def should_host(self) -> bool:
        """Decide whether this node hosts the store.

        ``is_host`` when given; otherwise this node hosts when it can (no
        TLS, or it has the server certificate) and the endpoint host resolves
        (``getaddrinfo``, IPv4 and IPv6) to one of this machine's addresses.
        A file store has nothing to host.
        """
        if self.store_type == "file":
            return False
        if self.is_host is not None:
            return self.is_host
        return self.tls.can_host and endpoint_is_local(self.host)


def parse_endpoints(endpoint: str) -> list[tuple[str, int]]:
    """Parse etcd's ``h1:2379,h2:2379,...`` (the default port is 2379) into ``[(host, port)]``.

    A ``http://`` or ``https://`` scheme on a member is ignored (the protocol
    comes from the ``protocol`` option).

    Raises:
        ValueError: The list is empty or a member is malformed.
    """
    members = [parse_endpoint(text, DEFAULT_ETCD_PORT) for text in split_endpoints(endpoint)]
    if not members:
        raise ValueError(
            f"the etcd endpoint {endpoint!r} names no member; expected host[:port],..."
        )
    return members


# The keys etcd and Redis both read.
_KV_KEYS = ("read_timeout", "protocol", "ssl_cert", "ssl_cert_key", "ca_cert", "key_prefix", "ttl")


def _tls_files(
    params: RendezvousParameters, ca_keys: tuple[str, ...], use_tls: bool, tls_protocol: str
) -> tuple[str | None, str | None, str | None]:
    """Read ``ssl_cert``, ``ssl_cert_key`` and the CA, which need the TLS protocol."""
    cert = text_option(params, "ssl_cert")
    key = text_option(params, "ssl_cert_key")
    ca = next((v for v in (text_option(params, k) for k in ca_keys) if v), None)
    if not use_tls and (cert or key or ca):
        raise ValueError(f"ssl_cert, ssl_cert_key and ca_cert need protocol={tls_protocol}")
    return cert, key, ca


@dataclass(frozen=True)
class EtcdOptions:
    """The options of the etcd backend.

    Args:
        endpoints: The cluster's members, ``(host, port)``.
        run_id: The run.
        protocol: ``http`` or ``https``.
        read_timeout: Seconds a request may take.
        ssl_cert: The client certificate, or None.
        ssl_cert_key: Its key, or None.
        ca_cert: The CA bundle the members are verified with, or None.
        keys: Where the run's keys live and how long they survive.
        client: ``grpc`` (:mod:`rdzv.backends.etcd.grpc`) or ``gateway``
            (:mod:`rdzv.backends.etcd.gateway`).
    """

    DEFAULT_PREFIX: ClassVar[str] = "/rdzv/"

    #: The configuration keys :meth:`from_params` reads.
    KEYS: ClassVar[frozenset[str]] = frozenset({"cacert", "client", *_KV_KEYS})

    endpoints: tuple[tuple[str, int], ...]
    run_id: str
    protocol: str = "http"
    read_timeout: float = DEFAULT_READ_TIMEOUT
    ssl_cert: str | None = None
    ssl_cert_key: str | None = None
    ca_cert: str | None = None
    keys: KeySettings = field(default_factory=KeySettings)
    client: str = "gateway"

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> EtcdOptions:
        """Parse the etcd backend's keys.

        Keys: ``read_timeout`` (60 s), ``protocol`` (``http`` or ``https``),
        ``ssl_cert``, ``ssl_cert_key``, ``ca_cert`` (or ``cacert``, the name
        torch's etcd handler reads), ``key_prefix`` (``/rdzv/``), ``ttl`` (7200 s),
        ``client`` (``auto``, the default: ``grpc`` where grpcio is installed,
        else ``gateway``; ``gateway``, the standard-library client; ``grpc``
        with the ``etcd`` extra, grpcio). The ``endpoint`` lists the members.

        Raises:
            ValueError: A bad value, naming its key; ``client=grpc`` without grpcio.
        """
        protocol = _choice(
            params, "protocol", ("http", "https"), "The protocol must be HTTP or HTTPS."
        )
        cert, key, ca = _tls_files(params, ("ca_cert", "cacert"), protocol == "https", "https")
        client = _choice(
            params, "client", ("auto", "gateway", "grpc"), "The etcd client must be one of these."
        )
        has_grpc = importlib.util.find_spec("grpc") is not None
        if client == "grpc" and not has_grpc:
            raise ValueError(
                "client=grpc needs grpcio, which is not installed: pip install 'rdzv[etcd]' "
                "(or client=gateway, the standard-library client)"
            )
        if client == "auto":
            client = "grpc" if has_grpc else "gateway"
        return cls(
            tuple(parse_endpoints(params.endpoint)),
            params.run_id,
            protocol,
            _read_timeout(params),
            cert,
            key,
            ca,
            KeySettings.from_params(params, "etcd", cls.DEFAULT_PREFIX),
            client,
        )


@dataclass(frozen=True)
class RedisOptions:
    """The options of the Redis backend.

    Args:
        host: The server's host.
        port: Its port.
        run_id: The run.
        use_tls: Whether to speak TLS (``protocol=rediss``).
        read_timeout: Seconds a command may take.
        ssl_cert: The client certificate, or None.
        ssl_cert_key: Its key, or None.
        ca_cert: The CA bundle the server is verified with, or None.
        password: The password, or None.
        db: The database number.
        keys: Where the run's keys live and how long they survive.
    """

    DEFAULT_PREFIX: ClassVar[str] = "rdzv:"

    #: The configuration keys :meth:`from_params` reads.
    KEYS: ClassVar[frozenset[str]] = frozenset({"password", "db", *_KV_KEYS})

    host: str
    port: int
    run_id: str
    use_tls: bool = False
    read_timeout: float = DEFAULT_READ_TIMEOUT
    ssl_cert: str | None = None
    ssl_cert_key: str | None = None
    ca_cert: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0
    keys: KeySettings = field(default_factory=KeySettings)

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> RedisOptions:
        """Parse the Redis backend's keys.

        Keys: ``read_timeout`` (60 s), ``protocol`` (``redis`` or ``rediss``
        for TLS; ``http``/``https`` are accepted as synonyms), ``ssl_cert``,
        ``ssl_cert_key``, ``ca_cert``, ``password``, ``db`` (0),
        ``key_prefix`` (``rdzv:``), ``ttl`` (7200 s). The ``endpoint`` is
        ``host[:port]`` (port 6379).

        Raises:
            ValueError: A bad value, naming its key.
        """
        host, port = parse_endpoint(params.endpoint, DEFAULT_REDIS_PORT)
        protocol = _choice(
            params,
            "protocol",
            ("redis", "rediss", "http", "https"),
            "The Redis protocol must be redis or rediss (http and https are synonyms).",
        )
        use_tls = protocol in ("rediss", "https")
        cert, key, ca = _tls_files(params, ("ca_cert",), use_tls, "rediss")
        db = params.get_as_int("db", 0) or 0
        if db < 0:
            raise ValueError(f"db: the Redis database must be >= 0, got {params.get('db')!r}")
        return cls(
            host,
            port,
            params.run_id,
            use_tls,
            _read_timeout(params),
            cert,
            key,
            ca,
            text_option(params, "password"),
            db,
            KeySettings.from_params(params, "Redis", cls.DEFAULT_PREFIX),
        )
