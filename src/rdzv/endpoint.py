"""Parsing of rendezvous endpoints and ``k=v,...`` configuration strings.

Accepted endpoint forms::

    host              -> (host, default_port)
    host:port         -> (host, port)
    [v6addr]          -> (v6addr, default_port)
    [v6addr]:port     -> (v6addr, port)
    ::1, fe80::1      -> the whole text is an IPv6 host; never host ':' port 1
"""

from __future__ import annotations

import ipaddress

__all__ = ["DEFAULT_PORT", "format_endpoint", "parse_config", "parse_endpoint"]

DEFAULT_PORT = 29400


def _parse_port(text: str, endpoint: str) -> int:
    try:
        port = int(text, 10)
    except ValueError:
        raise ValueError(
            f"port {text!r} in endpoint {endpoint!r} is not an integer in 1-65535"
        ) from None
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} in endpoint {endpoint!r} is not in 1-65535")
    return port


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True


def parse_endpoint(endpoint: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """Split a rendezvous endpoint into host and port.

    Args:
        endpoint: ``host``, ``host:port``, ``[v6addr]:port``, ``[v6addr]`` or a
            bare IPv6 address such as ``::1``. Surrounding whitespace is
            ignored.
        default_port: The port used when the endpoint names none.

    Returns:
        ``(host, port)``; an IPv6 host is returned without brackets.

    Raises:
        ValueError: The endpoint is empty, the host contains whitespace or
            brackets do not match, or the port is not an integer in 1-65535.
    """
    text = endpoint.strip()
    if not text:
        raise ValueError("the endpoint is empty; expected host[:port]")
    if text.startswith("["):
        close = text.find("]")
        if close == -1:
            raise ValueError(f"endpoint {endpoint!r} has '[' without a closing ']'")
        host = text[1:close]
        rest = text[close + 1 :]
        if not _is_ipv6(host):
            raise ValueError(f"{host!r} in endpoint {endpoint!r} is not an IPv6 address")
        if not rest:
            return host, default_port
        if not rest.startswith(":"):
            raise ValueError(f"unexpected {rest!r} after ']' in endpoint {endpoint!r}")
        return host, _parse_port(rest[1:], endpoint)
    if text.count(":") > 1:
        if _is_ipv6(text):
            return text, default_port
        raise ValueError(
            f"endpoint {endpoint!r} is not a valid IPv6 address; "
            "write an IPv6 address with a port as [addr]:port"
        )
    host, sep, port_text = text.partition(":")
    if not host:
        raise ValueError(f"endpoint {endpoint!r} has no host")
    if any(ch.isspace() for ch in host):
        raise ValueError(f"host {host!r} in endpoint {endpoint!r} contains whitespace")
    if not sep:
        return host, default_port
    return host, _parse_port(port_text, endpoint)


def format_endpoint(host: str, port: int) -> str:
    """Join a host and port into an endpoint that :func:`parse_endpoint` reads back.

    Args:
        host: A host name or address; IPv6 addresses are bracketed.
        port: The port.

    Returns:
        ``host:port`` or ``[v6addr]:port``.
    """
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def parse_config(text: str) -> dict[str, str]:
    """Parse a ``k=v,k2=v2`` configuration string.

    Args:
        text: The string. Whitespace around keys and values is ignored; an
            empty string gives an empty mapping.

    Returns:
        The keys and values, in order.

    Raises:
        ValueError: An item has no ``=``, an empty key or an empty value, or a
            key appears twice. The message names the item.
    """
    result: dict[str, str] = {}
    if not text.strip():
        return result
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ValueError(f"configuration item {item.strip()!r} is not of the form key=value")
        if not key:
            raise ValueError(f"configuration item {item.strip()!r} has an empty key")
        if not value:
            raise ValueError(f"configuration key {key!r} has an empty value")
        if key in result:
            raise ValueError(f"configuration key {key!r} is given twice")
        result[key] = value
    return result
