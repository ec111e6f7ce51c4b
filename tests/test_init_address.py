"""Parsing an engine's init address: host:port, tcp:// methods, IPv6 brackets, errors naming the setting."""

from __future__ import annotations

import pytest

from sglang.srt.distributed.init_address import (
    AddressError,
    format_host_port,
    parse_tcp_init_method,
    split_host_port,
    tcp_init_method,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("127.0.0.1:29500", ("127.0.0.1", 29500)),
        ("node-1.example:5", ("node-1.example", 5)),
        ("[::1]:29500", ("::1", 29500)),
        ("[fe80::1%eth0]:7", ("fe80::1%eth0", 7)),
        (" host:1 ", ("host", 1)),
    ],
)
def test_split_host_port(text, expected):
    assert split_host_port(text, what="x") == expected


@pytest.mark.parametrize(
    "text, needle",
    [
        ("127.0.0.1", "no port"),
        ("[::1]", "no port"),
        ("::1:29500", "without brackets"),
        ("[::1", "without ']'"),
        ("[::1]x:1", "after ']'"),
        ("[nothex]:1", "not an IPv6 address"),
        (":29500", "no host"),
        ("h:0", "out of range"),
        ("h:65536", "out of range"),
        ("h:http", "not a number"),
        ("", "empty"),
    ],
)
def test_split_host_port_errors_name_the_setting(text, needle):
    with pytest.raises(AddressError, match="--dist-init-addr") as info:
        split_host_port(text, what="--dist-init-addr")
    assert needle in str(info.value)


def test_tcp_init_method_round_trip():
    for host, port in [("127.0.0.1", 1), ("::1", 29500), ("h", 65535)]:
        method = tcp_init_method(host, port)
        assert parse_tcp_init_method(method) == (host, port)
    assert format_host_port("::1", 5) == "[::1]:5"
    assert parse_tcp_init_method("tcp://h:5?world_size=2") == ("h", 5)
    with pytest.raises(AddressError, match="not a tcp://"):
        parse_tcp_init_method("env://")
