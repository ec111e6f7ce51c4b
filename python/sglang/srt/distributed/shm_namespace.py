"""One engine's ``/dev/shm`` segment names, from its own init address and stage."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from urllib.parse import urlparse

from sglang.srt.utils.network import NetworkAddress

NAME_MAX = 255
MAX_RANK = 99999  # room for it is kept in every name: a valid namespace never overflows
_ADDR_RE = re.compile(r"[A-Za-z0-9._:%-]+")
# ASCII, and at most 5 digits before int(): int() also takes '٨٠', '+80' and '8_0'.
_PORT_RE = re.compile(r"[1-9][0-9]{0,4}")
_TCP_FORMS = "'tcp://host:port' or 'tcp://[ipv6]:port'"
_ALL_FORMS = f"{_TCP_FORMS}, 'env://' or 'file:///path'"
_SHORTER = "give --dist-init-addr (or --host) as an IP address or a shorter host name"


class ShmCollectiveError(RuntimeError):
    """The CPU collective's segments cannot be named or set up."""


def quoted(value: object) -> str:
    """repr (control characters stay visible), cut short (no flooded line)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def check_int(name: str, value: object, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:  # bool is no rank
        raise ShmCollectiveError(
            f"{name}={quoted(value)}: expected an integer from {low} to {high}"
        )
    return value


def parse_port(text: str, *, what: str) -> int:
    digits = text.strip().lstrip("0")
    if not _PORT_RE.fullmatch(digits) or int(digits) > 65535:
        raise ShmCollectiveError(
            f"{what}: port {quoted(text)}: expected 1 to 65535 in ASCII digits"
        )
    return int(digits)


def _tcp_address(method: str, what: str) -> tuple[str, int]:
    # As torch's rendezvous: the query string and a trailing "/" are ignored.
    rest = method[len("tcp://") :].partition("?")[0].removesuffix("/")
    if len(rest) > NAME_MAX:  # upstream's messages below would show it whole
        raise ShmCollectiveError(
            f"{what} is too long: no /dev/shm segment name can hold a {len(rest)}-"
            f"character address; {_SHORTER}"
        )
    try:
        address = NetworkAddress.parse(rest)
    except ValueError as exc:
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(exc))
        raise ShmCollectiveError(f"{what}: {shown}; expected {_TCP_FORMS}") from None
    if ":" in address.host and not rest.startswith("["):
        raise ShmCollectiveError(
            f"{what}: host {quoted(address.host)} has ':' but no brackets; write an "
            "IPv6 address as 'tcp://[ipv6]:port'"
        )
    return address.host, parse_port(rest.rpartition(":")[2], what=what)


def _env_address(method: str, what: str) -> tuple[str, int]:
    host = os.environ.get("MASTER_ADDR", "")  # read, never written, as torch does
    port_text = os.environ.get("MASTER_PORT", "")
    if not host or not port_text:
        raise ShmCollectiveError(
            f"{what} reads MASTER_ADDR={quoted(host)} and MASTER_PORT="
            f"{quoted(port_text)}: set both, or use a tcp://host:port init method"
        )
    port = parse_port(port_text, what="MASTER_PORT")
    return NetworkAddress(host, port).host, port  # an IPv6 address's [] dropped


def _file_address(method: str, what: str) -> tuple[str, int]:
    # The path torch opens (file://tmp/x is /x), whatever each rank's working dir.
    path = urlparse(method).path
    if not path:
        raise ShmCollectiveError(f"{what} names no file; expected 'file:///path'")
    digest = hashlib.sha256(path.encode("utf-8", "surrogatepass")).hexdigest()
    return f"file.{digest[:16]}", 0


_SCHEMES = {"tcp": _tcp_address, "env": _env_address, "file": _file_address}


@dataclasses.dataclass(frozen=True)
class ShmNamespace:
    """One engine stage's segments: its init address (port 0: not TCP), the uid the
    kernel names, and ``pp_rank`` (stage 0 keeps the released kernel's names)."""

    addr: str
    port: int
    uid: int = dataclasses.field(default_factory=os.getuid)
    pp_rank: int = 0

    def __post_init__(self) -> None:
        what = f"ShmNamespace.addr={quoted(self.addr)}"
        if not isinstance(self.addr, str) or not self.addr:
            raise ShmCollectiveError(f"{what}: expected a host name or address")
        if not _ADDR_RE.fullmatch(self.addr):
            bad = "".join(sorted(set(_ADDR_RE.sub("", self.addr))))
            raise ShmCollectiveError(
                f"{what} contains {quoted(bad)}; only letters, digits and . _ - : % "
                f"are allowed in a /dev/shm segment name"
            )
        check_int("ShmNamespace.port", self.port, 0, 65535)
        check_int("ShmNamespace.uid", self.uid, 0, 2**32 - 1)
        check_int("ShmNamespace.pp_rank", self.pp_rank, 0, MAX_RANK)
        longest = len(self.segment_name(MAX_RANK))
        if longest > NAME_MAX:
            raise ShmCollectiveError(
                f"{what} is too long: segment names would be up to {longest} "
                f"characters, over the {NAME_MAX} allowed in /dev/shm; {_SHORTER}"
            )

    @classmethod
    def from_init_method(cls, method: str, *, pp_rank: int = 0) -> ShmNamespace:
        """tcp://host:port, tcp://[ipv6]:port, env:// (MASTER_*) or file:///path."""
        what = f"dist_init_method={quoted(method)}"
        method = method.strip() if isinstance(method, str) else ""
        scheme, sep, _ = method.partition("://")
        address = _SCHEMES.get(scheme.lower()) if sep else None
        if address is None:
            problem = "unsupported scheme; " if method else ""
            raise ShmCollectiveError(f"{what}: {problem}expected {_ALL_FORMS}")
        host, port = address(method, what)
        try:
            return cls(addr=host, port=port, pp_rank=pp_rank)
        except ShmCollectiveError as exc:
            raise ShmCollectiveError(f"{what}: {exc}") from None

    @property
    def kernel_addr(self) -> str:
        """MASTER_ADDR for the released kernel ("@pp" is in no host or address)."""
        return f"{self.addr}@pp{self.pp_rank}" if self.pp_rank else self.addr

    @property
    def prefix(self) -> str:
        return f"deepspeed_allreduce_buffer_{self.uid}_{self.kernel_addr}_{self.port}"

    def segment_name(self, rank: int) -> str:
        return f"{self.prefix}_{check_int('rank', rank, 0, MAX_RANK)}"
