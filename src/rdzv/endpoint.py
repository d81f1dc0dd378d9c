"""Parsing of rendezvous endpoints and ``k=v,...`` configuration strings.

Two endpoint parsers live here:

* :func:`parse_endpoint`, rdzv's own, which every backend uses. Accepted forms::

    host              -> (host, default_port)
    host:port         -> (host, port)
    [v6addr]          -> (v6addr, default_port)
    [v6addr]:port     -> (v6addr, port)
    ::1, fe80::1      -> the whole text is an IPv6 host; never host ':' port 1

  An empty endpoint, port 0 and a malformed IPv6 address are errors. When
  torch's parser rejects the same text, the error message starts with
  torch's message, verbatim.
* :func:`parse_rendezvous_endpoint`, torch's public helper with torch's exact
  semantics (an empty endpoint is ``localhost``; ``::1`` is host ``:`` and
  port 1), for code ported from ``torch.distributed.elastic.rendezvous.utils``.
"""

from __future__ import annotations

import ipaddress
import re

__all__ = [
    "DEFAULT_PORT",
    "format_endpoint",
    "parse_config",
    "parse_endpoint",
    "parse_rendezvous_endpoint",
    "split_endpoints",
]

DEFAULT_PORT = 29400

# torch's rules: a port is one to five ASCII digits below 2**16; a host is made
# of word characters, dots, colons and dashes (``$`` also matches before a
# final newline, as in torch).
_TORCH_PORT = re.compile(r"[0-9]{1,5}$")
_TORCH_HOST = re.compile(r"[\w.:-]+$")


def _torch_port_error(endpoint: str) -> str:
    return (
        f"The port number of the rendezvous endpoint '{endpoint}' must be an integer "
        "between 0 and 65536."
    )


def _torch_host_error(endpoint: str) -> str:
    return (
        f"The hostname of the rendezvous endpoint '{endpoint}' must be a dot-separated list "
        "of labels, an IPv4 address, or an IPv6 address."
    )


def parse_rendezvous_endpoint(endpoint: str | None, default_port: int) -> tuple[str, int]:
    """Split an endpoint into host and port exactly as torch's helper of this name does.

    ``torch.distributed.elastic.rendezvous.utils.parse_rendezvous_endpoint``
    (torch 2.13): the text is stripped; empty or None is ``("localhost",
    default_port)``; text in brackets is an IPv6 host; otherwise the part
    after the last ``:`` is the port, so a bare ``::1`` is host ``:`` and
    port 1 (rdzv's :func:`parse_endpoint` reads it as an IPv6 host). Ports
    0 to 65535 are accepted.

    Args:
        endpoint: ``host[:port]``, ``[v6addr]`` or ``[v6addr]:port``.
        default_port: The port when the endpoint names none.

    Returns:
        ``(host, port)``; brackets around an IPv6 host are removed.

    Raises:
        ValueError: The port is not one to five digits below 65536, or the
            host holds characters other than word characters, ``.``, ``:``
            and ``-``; torch's message.
    """
    text = (endpoint or "").strip()
    if not text:
        return "localhost", default_port
    port_text: str | None = None
    host = text
    if not (text.startswith("[") and text.endswith("]")):
        head, colon, tail = text.rpartition(":")
        if colon:
            host, port_text = head, tail
    if len(host) > 1 and host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = default_port
    if port_text is not None:
        if not _TORCH_PORT.match(port_text) or int(port_text) >= 1 << 16:
            raise ValueError(_torch_port_error(text))
        port = int(port_text)
    if not _TORCH_HOST.match(host):
        raise ValueError(_torch_host_error(text))
    return host, port


def _parse_port(text: str, endpoint: str) -> int:
    # ASCII digits only: int() would also take " 1", "+1", "1_0" and other
    # scripts' digits, which torch (and every socket API) rejects.
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"port {text!r} in endpoint {endpoint!r} is not an integer in 1-65535")
    port = int(text)
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
        ValueError: The endpoint is empty, the host holds characters other
            than word characters, ``.``, ``:`` and ``-`` (an IPv6 zone such
            as ``%eth0`` is allowed), brackets do not match, or the port is
            not an integer in 1-65535. When torch's
            :func:`parse_rendezvous_endpoint` rejects the text too, the
            message starts with torch's message.
    """
    try:
        return _parse_strict(endpoint, default_port)
    except ValueError as exc:
        try:
            parse_rendezvous_endpoint(endpoint, default_port)
        except ValueError as torch_exc:
            raise ValueError(f"{torch_exc} {exc}") from None
        raise


def _parse_strict(endpoint: str, default_port: int) -> tuple[str, int]:
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
    if not _TORCH_HOST.fullmatch(host):
        raise ValueError(
            f"host {host!r} in endpoint {endpoint!r} holds characters other than letters, "
            "digits, '_', '.', ':' and '-'"
        )
    if not sep:
        return host, default_port
    return host, _parse_port(port_text, endpoint)


def split_endpoints(endpoint: str) -> list[str]:
    """Split a comma-separated endpoint list into its members, unparsed.

    Surrounding whitespace, an ``http://`` or ``https://`` scheme (etcd
    member URLs) and a trailing ``/`` are dropped from each member; empty
    members are left out.

    Args:
        endpoint: ``host[:port]`` or several, comma-separated.

    Returns:
        The members' ``host[:port]`` texts, in order (possibly none).
    """
    members: list[str] = []
    for item in endpoint.split(","):
        text = item.strip()
        for scheme in ("http://", "https://"):
            if text.lower().startswith(scheme):
                text = text[len(scheme) :]
        text = text.rstrip("/")
        if text:
            members.append(text)
    return members


def format_endpoint(host: str, port: int) -> str:
    """Join a host and port into an endpoint that :func:`parse_endpoint` reads back.

    ``host:port``, or ``[v6addr]:port`` for an IPv6 address.
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
