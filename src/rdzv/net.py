"""Sockets: this machine's addresses, and the listening side of a server.

Nothing here calls ``socket.getfqdn()`` or does reverse lookups: those hang
or return names that do not connect on machines without working DNS.

A server listens the way torch's store does: on every address, IPv6 and IPv4
on one dual-stack socket (falling back to IPv4 only), with the kernel's
``somaxconn`` as backlog; accepted sockets get kernel keepalive probes so a
peer that vanished without a FIN is found. A server that publishes one
address listens on that address and loopback only (:func:`listen_addresses`),
unless the address is not this machine's own.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
import ssl
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from rdzv.endpoint import parse_endpoint, split_endpoints

__all__ = [
    "KEEPALIVE_INTERVAL",
    "KEEPALIVE_PROBES",
    "advertised_address",
    "bind_listener",
    "bind_listeners",
    "enable_keepalive",
    "is_local_address",
    "listen_addresses",
    "listen_backlog",
    "local_addresses",
    "primary_address",
    "server_tls_context",
    "source_address",
]

KEEPALIVE_INTERVAL: Final = 10
"""Seconds between two keepalive probes, once the first went unanswered."""
KEEPALIVE_PROBES: Final = 6
"""Unanswered keepalive probes after which the kernel closes the connection."""
LOOPBACK: Final = "127.0.0.1"
"""The address a process reaches a server of its own machine at."""

_log = logging.getLogger(__name__)
_told_lock = threading.Lock()
_told: set[str] = set()
"""Published addresses already logged as not this machine's own."""


def local_addresses() -> list[str]:
    """Return this machine's numeric addresses, IPv4 and IPv6, routable ones first.

    The host name is resolved with ``getaddrinfo`` (no reverse lookup);
    loopback addresses come last.

    Returns:
        A list of distinct numeric addresses (possibly only loopback ones).
    """
    found: list[str] = []
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP)
    except OSError:
        infos = []
    for _family, _type, _proto, _name, sockaddr in infos:
        addr = str(sockaddr[0]).split("%", 1)[0]
        if addr not in found:
            found.append(addr)
    for loopback in ("127.0.0.1", "::1"):
        if loopback not in found:
            found.append(loopback)

    def rank(addr: str) -> tuple[int, int]:
        ip = ipaddress.ip_address(addr)
        return (1 if ip.is_loopback else 0, 0 if ip.version == 4 else 1)

    return sorted(found, key=rank)


def primary_address() -> str:
    """Return the address other machines most likely reach this one at.

    The first routable address of :func:`local_addresses`, or a loopback
    address when the machine has no other.
    """
    return local_addresses()[0]


def is_local_address(addr: str) -> bool:
    """Tell whether the numeric address ``addr`` is assigned to this machine.

    Binding a socket to it succeeds only then, whatever the host name
    resolves to: in a container or network namespace whose host name maps to
    loopback this still finds the interfaces' own addresses. (With
    ``net.ipv4.ip_nonlocal_bind`` set, every IPv4 address would pass.)

    Args:
        addr: An IPv4 or IPv6 address, without brackets.

    Returns:
        True when a socket can be bound to ``addr``.
    """
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            return False
    return True


def source_address(host: str, port: int = 9) -> str | None:
    """Return the address this machine sends from to reach ``host``.

    A UDP socket is connected to ``host`` (a route lookup; no packet is
    sent) and its local address read back: the address of the interface
    facing ``host``, which is the one ``host``'s side can reach this machine
    at.

    Args:
        host: A host name or numeric address.
        port: Any port (it does not matter for the route).

    Returns:
        A numeric address, or None when ``host`` does not resolve or no
        route leads to it.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _type, _proto, _name, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(sockaddr)
            except OSError:
                continue
            return str(sock.getsockname()[0]).split("%", 1)[0]
    return None


def advertised_address(endpoint: str) -> str:
    """Return the address other nodes reach this one at, in a rendezvous at ``endpoint``.

    The address of the interface this machine reaches the endpoint's first
    host through (:func:`source_address`): on many machines the host name
    resolves to a loopback address, so :func:`primary_address` would
    publish ``127.0.0.1`` to nodes on other hosts. An endpoint on loopback
    gives a loopback address, which is right: every node then runs here.

    Args:
        endpoint: ``host[:port]``, or several comma-separated (an etcd
            member list, ``http://`` or ``https://`` allowed); empty when
            unknown.

    Returns:
        A numeric address; :func:`primary_address` when the endpoint is
        empty, malformed, does not resolve or has no route.
    """
    members = split_endpoints(endpoint)
    if members:
        try:
            host, _port = parse_endpoint(members[0])
        except ValueError:
            host = ""
        found = source_address(host) if host else None
        if found is not None:
            return found
    return primary_address()


def listen_backlog() -> int:
    """Return the listen backlog: the kernel's ``somaxconn``, as torch uses (or ``SOMAXCONN``)."""
    try:
        return max(1, int(Path("/proc/sys/net/core/somaxconn").read_text().strip()))
    except (OSError, ValueError):
        return socket.SOMAXCONN


def bind_listener(host: str | None, port: int) -> socket.socket:
    """Create a bound (not yet listening) TCP socket for a server.

    Args:
        host: The address; None, ``""`` or ``"::"`` mean every address, on a
            dual-stack IPv6 socket where the machine has IPv6, else IPv4.
        port: The port; 0 picks a free one.

    Returns:
        The bound socket, with ``SO_REUSEADDR`` set.

    Raises:
        OSError: The address is in use or cannot be bound.
    """
    if host in (None, "", "::"):
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError:
            sock = None
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind(("::", port))
            except OSError as exc:
                sock.close()
                if exc.errno == errno.EADDRINUSE:
                    raise
            else:
                return sock
        host = "0.0.0.0"  # noqa: S104 - the IPv4 fallback of a wildcard bind
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    last_error: OSError | None = None
    for family, kind, proto, _name, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError as exc:
            sock.close()
            last_error = exc
            continue
        return sock
    raise last_error or OSError(f"no address to bind for host {host!r}")


def bind_listeners(hosts: Sequence[str] | None, port: int) -> list[socket.socket]:
    """Bind one socket per address of ``hosts``, all on one port (see :func:`bind_listener`).

    ``hosts`` None binds every address (one socket). With ``port`` 0 the
    first address picks a free port and the others take the same; when one
    of them has it taken already, all start over on a new port (a few times).

    Raises:
        OSError: An address is in use or cannot be bound.
    """
    if not hosts:
        return [bind_listener(None, port)]
    for attempt in range(8):
        bound: list[socket.socket] = []
        try:
            for host in hosts:
                bound.append(bind_listener(host, port if not bound else bound[0].getsockname()[1]))
        except OSError as exc:
            for sock in bound:
                sock.close()
            if port or exc.errno != errno.EADDRINUSE or not bound or attempt == 7:
                raise
            continue
        return bound
    raise AssertionError("unreachable")  # pragma: no cover


def listen_addresses(published: str, *, listen_all: bool = False) -> list[str] | None:
    """Return where a server that publishes ``published`` listens: None for every address.

    A server reached at one published address has no reason to listen on
    the others: it listens on the addresses ``published`` resolves to that
    are this machine's own (:func:`is_local_address`), and on
    :data:`LOOPBACK`, where this machine's own clients connect. So a
    published loopback address listens on loopback only. Where ``published``
    is none of this machine's addresses (a name that resolves elsewhere, an
    address behind NAT), or a host name that resolves to loopback here only
    (as ``/etc/hosts`` maps the machine's own name on some systems, where
    the other machines resolve it to a real address), the clients reach
    the server some other way: every address, as when ``listen_all``, said
    once in the log (per address and process).

    Args:
        published: The host name or address the clients are given.
        listen_all: Listen on every address whatever is published.
    """
    host = published.strip("[]")
    if listen_all or host in ("", "0.0.0.0", "::"):  # noqa: S104 - the wildcards listen on all
        return None
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        infos = []
    own: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        addr = str(sockaddr[0])
        if addr not in own and is_local_address(addr.split("%", 1)[0]):
            own.append(addr)
    if own and all(_is_loopback(a) for a in own) and not _names_loopback(host):
        own = []  # a host name mapped to loopback here (/etc/hosts) that others resolve elsewhere
    if not own:
        with _told_lock:
            first = host not in _told
            _told.add(host)
        if first:
            _log.warning(
                "store server: the published address %s is not one of this machine's own "
                "(a name that resolves elsewhere, or to loopback only here; an address behind "
                "NAT): listening on every address, as listen_all=true does",
                published,
            )
        return None
    if LOOPBACK not in own:
        own.append(LOOPBACK)
    return own


def _is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback


def _names_loopback(host: str) -> bool:
    """Whether ``host`` means loopback everywhere: a loopback address, or ``localhost``."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def enable_keepalive(sock: socket.socket, idle: float) -> None:
    """Turn on TCP keepalive probes on ``sock`` after ``idle`` seconds of silence.

    Then a probe goes every :data:`KEEPALIVE_INTERVAL` seconds, and
    :data:`KEEPALIVE_PROBES` unanswered ones close the connection. Options
    the platform lacks, or refuses, are skipped.

    Args:
        sock: A connected TCP socket.
        idle: Seconds of silence before the first probe (rounded, at least 1).
    """
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", max(1, round(idle))),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """Build the TLS context a store server serves ``cert`` with.

    Args:
        cert: A PEM certificate chain.
        key: The PEM private key of ``cert``.

    Returns:
        A server-side context (TLS 1.2 or later, no client certificates asked).

    Raises:
        OSError: A file cannot be read.
        ssl.SSLError: The files do not hold a matching certificate and key.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context
