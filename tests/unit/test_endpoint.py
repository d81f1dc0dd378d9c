import re

import pytest

from rdzv.endpoint import DEFAULT_PORT, format_endpoint, parse_config, parse_endpoint


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("localhost", ("localhost", DEFAULT_PORT)),
        ("node7:1234", ("node7", 1234)),
        ("  10.0.0.1:80  ", ("10.0.0.1", 80)),
        ("[::1]:29500", ("::1", 29500)),
        ("[fe80::1%eth0]:5", ("fe80::1%eth0", 5)),
        ("[::1]", ("::1", DEFAULT_PORT)),
        ("::1", ("::1", DEFAULT_PORT)),
        ("fe80::1", ("fe80::1", DEFAULT_PORT)),
        ("2001:db8::7", ("2001:db8::7", DEFAULT_PORT)),
        ("host:1", ("host", 1)),
        ("host:65535", ("host", 65535)),
    ],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


def test_default_port_is_configurable() -> None:
    assert parse_endpoint("h", default_port=2379) == ("h", 2379)


def test_bare_ipv6_is_never_host_colon_port() -> None:
    host, port = parse_endpoint("::1")
    assert host != ":"
    assert port != 1


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("host:0", "0"),
        ("host:65536", "65536"),
        ("host:-1", "-1"),
        ("host:http", "'http'"),
        ("host:", "''"),
        ("my host:80", "'my host'"),
        (":80", "no host"),
        ("[::1", "closing"),
        ("[::1]x", "'x'"),
        ("[nothex]:1", "'nothex'"),
        ("a:b:c", "IPv6"),
        ("[::1]:99999", "99999"),
    ],
)
def test_parse_endpoint_errors_name_the_bad_value(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_endpoint(text)


@pytest.mark.parametrize(
    ("host", "port"), [("h", 1), ("10.1.2.3", 29400), ("::1", 80), ("fe80::1%eth0", 9)]
)
def test_format_endpoint_round_trips(host: str, port: int) -> None:
    assert parse_endpoint(format_endpoint(host, port)) == (host, port)


def test_parse_config() -> None:
    assert parse_config("") == {}
    assert parse_config(" a=1, b = two ,c=x=y") == {"a": "1", "b": "two", "c": "x=y"}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a=1,=2", "empty key"),
        ("a=", "'a' has an empty value"),
        ("a=1,b", "'b'"),
        ("a=1,a=2", "'a' is given twice"),
        ("a=1,,b=2", "''"),
    ],
)
def test_parse_config_errors(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_config(text)


@pytest.mark.parametrize("port", [" 1", "+80", "8_0", "\u0668\u0660"])
def test_a_port_is_ascii_digits_only(port: str) -> None:
    with pytest.raises(ValueError, match="is not an integer in 1-65535"):
        parse_endpoint(f"h:{port}")
