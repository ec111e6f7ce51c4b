"""Small network helpers: port probing and ``host:port`` parsing.

Imports nothing but the standard library, so that ``from sglang.srt.utils import
is_port_available`` (done by sglang-router at module load) stays cheap.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

logger = logging.getLogger(__name__)

_MAX_PORT = 65535


class AddressError(ValueError):
    """A ``host:port`` value or an init method is malformed."""


def _passive_addresses(port: int) -> list[tuple[int, tuple]]:
    """The (family, sockaddr) pairs a server listening on every address would bind."""
    try:
        infos = socket.getaddrinfo(
            None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
    except socket.gaierror:
        infos = []
    seen: set[tuple[int, tuple]] = set()
    result: list[tuple[int, tuple]] = []
    for family, _type, _proto, _name, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        key = (family, tuple(sockaddr))
        if key not in seen:
            seen.add(key)
            result.append(key)
    if not result:
        result.append((socket.AF_INET, ("0.0.0.0", port)))
    return result


def _can_bind(family: int, sockaddr: tuple) -> bool:
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        # The family is resolved but unusable here (IPv6 disabled in the kernel):
        # nothing can listen on it, so it cannot hold the port.
        return True
    with sock:
        # Same option a server sets, so a port left in TIME_WAIT counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # Probe IPv6 on its own: a dual-stack bind would also test IPv4,
            # which has its own entry.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(sockaddr)
            sock.listen(1)
        except (OSError, OverflowError):
            return False
    return True


def is_port_available(port: int) -> bool:
    """True if ``port`` can be bound (TCP) on every address family this host resolves
    for a passive bind (normally ``0.0.0.0`` and ``::``); False if anything listens on
    it on any of them, or if ``port`` is not a valid port number."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= _MAX_PORT:
        return False
    return all(_can_bind(family, sockaddr) for family, sockaddr in _passive_addresses(port))


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

