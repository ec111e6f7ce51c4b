"""is_port_available and host:port parsing, against real sockets."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from sglang.srt.utils import is_port_available
from sglang.srt.utils.network import (
    AddressError,
    format_host_port,
    parse_tcp_init_method,
    split_host_port,
    tcp_init_method,
)


def _listener(family: int, host: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, 0))
    sock.listen(1)
    return sock


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_host_resolves_both_families_for_binding():
    # The IPv6 cases below mean nothing without an IPv6 stack: fail, do not skip.
    infos = socket.getaddrinfo(None, 1, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    families = {info[0] for info in infos}
    assert {socket.AF_INET, socket.AF_INET6} <= families


def test_free_port_is_available():
    assert is_port_available(_free_port())


@pytest.mark.parametrize(
    "family, host",
    [
        (socket.AF_INET, "127.0.0.1"),
        (socket.AF_INET, "0.0.0.0"),
        (socket.AF_INET6, "::1"),
        (socket.AF_INET6, "::"),
    ],
)
def test_listening_port_is_not_available(family, host):
    with _listener(family, host) as sock:
        port = sock.getsockname()[1]
        assert not is_port_available(port)
    assert is_port_available(port)


def test_bound_but_not_listening_port_is_not_available():
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(("::", 0))
        assert not is_port_available(sock.getsockname()[1])


@pytest.mark.parametrize("port", [0, -1, 65536, "80", None, True])
def test_invalid_ports_are_not_available(port):
    assert is_port_available(port) is False


def test_router_import_does_not_load_torch():
    code = (
        "import sys\n"
        "from sglang.srt.utils import is_port_available\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(is_port_available)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


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
