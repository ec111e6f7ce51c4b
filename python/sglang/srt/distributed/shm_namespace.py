"""One engine stage's ``/dev/shm`` segment names, from its own init address."""

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
_FORMS = "'tcp://host:port', 'tcp://[ipv6]:port', 'env://' or 'file:///path'"
_SHORTER = "give --dist-init-addr (or --host) as an IP address or a shorter host name"


class ShmCollectiveError(RuntimeError):
    """The CPU collective's segments cannot be named or set up."""


def quoted(value: object) -> str:
    """repr (control characters stay visible), cut short (no flooded line)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def check_int(name: str, value: object, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:  # bool is no rank
        raise ShmCollectiveError(f"{name}={quoted(value)}: expected {low} to {high}")
    return value


def parse_port(text: str, *, what: str) -> int:
    digits = text.strip().lstrip("0")
    if not _PORT_RE.fullmatch(digits) or int(digits) > 65535:
        raise ShmCollectiveError(f"{what}: port {quoted(text)}: expected 1 to 65535")
    return int(digits)


def _address(method: str, what: str) -> tuple[str, int]:
    scheme, sep, rest = method.partition("://")
    scheme = scheme.lower() if sep else ""
    if scheme == "env":  # as torch reads it; never written here
        host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ShmCollectiveError(f"{what}: set MASTER_ADDR and MASTER_PORT")
        port = parse_port(port, what="MASTER_PORT")
        return NetworkAddress(host, port).host, port  # an IPv6 address's [] dropped
    if scheme == "file":  # the path torch opens, whatever each rank's working dir
        path = urlparse(method).path.encode("utf-8", "surrogatepass")
        if not path:
            raise ShmCollectiveError(f"{what} names no file; expected {_FORMS}")
        return f"file.{hashlib.sha256(path).hexdigest()[:16]}", 0
    # As torch's rendezvous: the query string and a trailing "/" are ignored.
    rest = rest.partition("?")[0].removesuffix("/")
    if scheme != "tcp":
        raise ShmCollectiveError(f"{what}: expected {_FORMS}")
    if len(rest) > NAME_MAX:  # NetworkAddress's messages would show it all
        raise ShmCollectiveError(f"{what} is too long for /dev/shm; {_SHORTER}")
    try:
        host = NetworkAddress.parse(rest).host
    except ValueError as exc:  # NetworkAddress's message, control characters shown
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(exc))
        raise ShmCollectiveError(f"{what}: {shown}; expected {_FORMS}") from None
    if ":" in host and not rest.startswith("["):
        raise ShmCollectiveError(f"{what}: write an IPv6 host as 'tcp://[ipv6]:port'")
    return host, parse_port(rest.rpartition(":")[2], what=what)


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
        if not isinstance(self.addr, str) or not _ADDR_RE.fullmatch(self.addr):
            raise ShmCollectiveError(
                f"{what}: expected a host name or address of letters, digits and "
                f". _ - : % (a /dev/shm segment name holds it)"
            )
        check_int("ShmNamespace.port", self.port, 0, 65535)
        check_int("ShmNamespace.uid", self.uid, 0, 2**32 - 1)
        check_int("ShmNamespace.pp_rank", self.pp_rank, 0, MAX_RANK)
        if len(self.segment_name(MAX_RANK)) > NAME_MAX:
            raise ShmCollectiveError(
                f"{what} is too long for a segment name in /dev/shm ({NAME_MAX} "
                f"characters at most); {_SHORTER}"
            )

    @classmethod
    def from_init_method(cls, method: str, *, pp_rank: int = 0) -> ShmNamespace:
        what = f"dist_init_method={quoted(method)}"
        method = method.strip() if isinstance(method, str) else ""
        host, port = _address(method, what)
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

    @property
    def group_namespace(self) -> str:
        """The namespace for a kernel whose ``initialize`` takes a group: names no
        longer than the released kernel's, and never the same."""
        return f"sglang_ar_{self.uid}_{self.kernel_addr}_{self.port}"
