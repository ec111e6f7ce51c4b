"""Parsing an engine's init address (``host:port``, ``tcp://host:port``, ``[v6]:port``) with errors that name the setting."""

from __future__ import annotations

import ipaddress
import logging

logger = logging.getLogger(__name__)

_MAX_PORT = 65535


class AddressError(ValueError):
    """A ``host:port`` value or an init method is malformed."""


def parse_port(text: str, *, what: str) -> int:
    """A TCP port from text; ``what`` names the setting in the error."""
    stripped = text.strip()
    if not stripped.isdigit():
        raise AddressError(
            f"{what}: port {text!r} is not a number; expected an integer from 1 to {_MAX_PORT}"
        )
    port = int(stripped)
    if not 0 < port <= _MAX_PORT:
        raise AddressError(f"{what}: port {port} is out of range; expected 1 to {_MAX_PORT}")
    return port


def split_host_port(text: str, *, what: str) -> tuple[str, int]:
    """Split ``host:port`` or ``[ipv6]:port`` into ``(host, port)``; IPv6 comes back
    without brackets. ``what`` names the setting in errors."""
    value = text.strip()
    if not value:
        raise AddressError(f"{what}: empty address; expected 'host:port' or '[ipv6]:port'")
    if value.startswith("["):
        close = value.find("]")
        if close < 0:
            raise AddressError(f"{what}: {text!r} opens '[' without ']'; expected '[ipv6]:port'")
        host = value[1:close]
        rest = value[close + 1 :]
        _check_ipv6(host, text=text, what=what)
        if not rest:
            raise AddressError(f"{what}: {text!r} has no port; expected '[{host}]:port'")
        if not rest.startswith(":"):
            raise AddressError(
                f"{what}: {text!r} has {rest!r} after ']'; expected '[{host}]:port'"
            )
        return host, parse_port(rest[1:], what=what)
    if ":" not in value:
        raise AddressError(f"{what}: {text!r} has no port; expected 'host:port'")
    host, port_text = value.rsplit(":", 1)
    if ":" in host:
        raise AddressError(
            f"{what}: {text!r} looks like an IPv6 address without brackets; "
            f"write it as '[{host}]:{port_text}'"
        )
    if not host:
        raise AddressError(f"{what}: {text!r} has no host; expected 'host:port'")
    return host, parse_port(port_text, what=what)


def _check_ipv6(host: str, *, text: str, what: str) -> None:
    address = host.split("%", 1)[0]
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        raise AddressError(
            f"{what}: {text!r} has {host!r} in brackets, which is not an IPv6 address"
        ) from None


def format_host_port(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tcp_init_method(host: str, port: int) -> str:
    """A ``tcp://`` init method for ``torch.distributed``."""
    return f"tcp://{format_host_port(host, port)}"


def parse_tcp_init_method(method: str, *, what: str = "dist_init_method") -> tuple[str, int]:
    """``(host, port)`` of a ``tcp://host:port`` init method (query string ignored)."""
    prefix = "tcp://"
    if not method.startswith(prefix):
        raise AddressError(f"{what}: {method!r} is not a tcp:// init method")
    rest = method[len(prefix) :]
    rest, _, _query = rest.partition("?")
    if rest.endswith("/"):
        rest = rest[:-1]
    return split_host_port(rest, what=what)

