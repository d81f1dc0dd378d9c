"""Finding this machine's addresses without DNS round trips.

Nothing here calls ``socket.getfqdn()`` or does reverse lookups: those hang
or return names that do not connect on machines without working DNS.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["is_local_address", "local_addresses", "primary_address", "source_address"]


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

    Returns:
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
