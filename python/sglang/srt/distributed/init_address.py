"""Parsing an engine's init address (``host:port``, ``tcp://host:port``, ``[v6]:port``) with errors that name the setting and show the value escaped."""

from __future__ import annotations

import ipaddress
import logging
import re

logger = logging.getLogger(__name__)

_MAX_PORT = 65535
# ASCII only: str.isdigit() also accepts '²' (which int() refuses) and '٨٠' (which
# int() reads as 80).
_PORT_RE = re.compile(r"[0-9]+")
_SHOWN_MAX = 80


class AddressError(ValueError):
    """A ``host:port`` value or an init method is malformed."""


def quoted(value: object) -> str:
    """``repr(value)`` for an error message, cut short when long: a NUL or control
    character stays visible and a huge value cannot flood the line."""
    text = repr(value)
    if len(text) <= _SHOWN_MAX:
        return text
    return f"{text[:_SHOWN_MAX]}... ({len(text)} characters)"


def parse_port(text: str, *, what: str) -> int:
    """A TCP port from text; ``what`` names the setting in the error."""
    stripped = text.strip() if isinstance(text, str) else ""
    if not _PORT_RE.fullmatch(stripped):
        raise AddressError(
            f"{what}: port {quoted(text)} is not a number; expected an integer from 1 to "
            f"{_MAX_PORT} in ASCII digits"
        )
    # Bounded before int(): a long digit string would cost time, and int() refuses 4300+ digits.
    digits = stripped.lstrip("0")
    if len(digits) > len(str(_MAX_PORT)) or not 0 < int(digits or "0") <= _MAX_PORT:
        raise AddressError(
            f"{what}: port {quoted(text)} is out of range; expected 1 to {_MAX_PORT}"
        )
    return int(digits)


def split_host_port(text: str, *, what: str) -> tuple[str, int]:
    """Split ``host:port`` or ``[ipv6]:port`` into ``(host, port)``; IPv6 comes back
    without brackets. ``what`` names the setting in errors."""
    value = text.strip()
    if not value:
        raise AddressError(f"{what}: empty address; expected 'host:port' or '[ipv6]:port'")
    if value.startswith("["):
        close = value.find("]")
        if close < 0:
            raise AddressError(
                f"{what}: {quoted(text)} opens '[' without ']'; expected '[ipv6]:port'"
            )
        host = value[1:close]
        rest = value[close + 1 :]
        _check_ipv6(host, text=text, what=what)
        if not rest:
            raise AddressError(
                f"{what}: {quoted(text)} has no port; expected {quoted(f'[{host}]:port')}"
            )
        if not rest.startswith(":"):
            raise AddressError(
                f"{what}: {quoted(text)} has {quoted(rest)} after ']'; "
                f"expected {quoted(f'[{host}]:port')}"
            )
        return host, parse_port(rest[1:], what=what)
    if ":" not in value:
        raise AddressError(f"{what}: {quoted(text)} has no port; expected 'host:port'")
    host, port_text = value.rsplit(":", 1)
    if ":" in host:
        raise AddressError(
            f"{what}: {quoted(text)} looks like an IPv6 address without brackets; "
            f"write it as {quoted(f'[{host}]:{port_text}')}"
        )
    if not host:
        raise AddressError(f"{what}: {quoted(text)} has no host; expected 'host:port'")
    return host, parse_port(port_text, what=what)


def _check_ipv6(host: str, *, text: str, what: str) -> None:
    address = host.split("%", 1)[0]
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        raise AddressError(
            f"{what}: {quoted(text)} has {quoted(host)} in brackets, which is not an IPv6 address"
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
        raise AddressError(f"{what}: {quoted(method)} is not a tcp:// init method")
    rest = method[len(prefix) :]
    rest, _, _query = rest.partition("?")
    if rest.endswith("/"):
        rest = rest[:-1]
    return split_host_port(rest, what=what)

