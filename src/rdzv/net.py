"""Finding this machine's addresses without DNS round trips.

Nothing here calls ``socket.getfqdn()`` or does reverse lookups: those hang
or return names that do not connect on machines without working DNS.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["local_addresses", "primary_address"]


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
