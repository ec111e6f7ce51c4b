"""The names of one engine's ``/dev/shm`` segments, from its own init address.

The CPU kernel names them ``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``,
so co-located engines must never hand it the same address and port.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from typing import Optional
from urllib.parse import urlparse

from sglang.srt.utils.network import NetworkAddress

SHM_SEGMENT_PREFIX = "deepspeed_allreduce_buffer"
NAME_MAX = 255
# Room for ranks up to 99999 is reserved in every name, so a namespace that passes
# validation never yields an over-long name later.
MAX_RANK = 99999
# Reserved for the pipeline-stage suffix; never valid in a host name or address.
_STAGE_MARK = "@pp"
_ADDR_RE = re.compile(r"[A-Za-z0-9._:%-]+")
_MAX_PORT = 65535
# ASCII only: str.isdigit() and int() also accept '٨٠' (read as 80), int() also
# ' 80', '+80' and '8_0'.
_PORT_RE = re.compile(r"[0-9]+")
_SHOWN_MAX = 80
_TCP_FORMS = "'tcp://host:port' or 'tcp://[ipv6]:port'"
_ALL_FORMS = f"{_TCP_FORMS}, 'env://' or 'file:///path'"
_SHORTER = "give --dist-init-addr (or --host) as an IP address or a shorter host name"


class ShmCollectiveError(RuntimeError):
    """The CPU collective's segments cannot be named (a bad address, port or rank) or
    set up (another user's file under their names, a full or read-only /dev/shm)."""


def quoted(value: object) -> str:
    """A NUL or control character stays visible; a huge value cannot flood the line."""
    text = repr(value)
    short = len(text) <= _SHOWN_MAX
    return text if short else f"{text[:_SHOWN_MAX]}... ({len(text)} characters)"


def check_int(name: str, value: object, low: int, high: int) -> int:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or not low <= value <= high:
        raise ShmCollectiveError(
            f"{name}={quoted(value)}: expected an integer from {low} to {high}"
        )
    return value


def parse_port(text: str, *, what: str) -> int:
    stripped = text.strip() if isinstance(text, str) else ""
    if not _PORT_RE.fullmatch(stripped):
        raise ShmCollectiveError(
            f"{what}: port {quoted(text)} is not a number; expected an integer from 1 "
            f"to {_MAX_PORT} in ASCII digits"
        )
    # Bounded before int(), which is slow on long strings and refuses 4300+ digits.
    digits = stripped.lstrip("0")
    if len(digits) > len(str(_MAX_PORT)) or not 0 < int(digits or "0") <= _MAX_PORT:
        raise ShmCollectiveError(
            f"{what}: port {quoted(text)} is out of range; expected 1 to {_MAX_PORT}"
        )
    return int(digits)


def _tcp_address(method: str, *, what: str) -> tuple[str, int]:
    # The query string and a trailing "/" are ignored, as torch's rendezvous does.
    rest = method[len("tcp://") :].partition("?")[0]
    rest = rest[:-1] if rest.endswith("/") else rest
    # No longer address fits a segment name; upstream's messages show it whole.
    if len(rest) > NAME_MAX:
        raise ShmCollectiveError(
            f"{what} is too long: no /dev/shm segment name can hold a {len(rest)}-"
            f"character address; {_SHORTER}"
        )
    try:
        address = NetworkAddress.parse(rest)
    except ValueError as exc:
        # Upstream's message shows the value as it is: escape what is unprintable.
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(exc))
        raise ShmCollectiveError(f"{what}: {shown}; expected {_TCP_FORMS}") from None
    if ":" in address.host and not rest.startswith("["):
        raise ShmCollectiveError(
            f"{what}: host {quoted(address.host)} has ':' but no brackets; write an "
            "IPv6 address as 'tcp://[ipv6]:port'"
        )
    return address.host, parse_port(rest.rpartition(":")[2], what=what)


def _env_address(what: str) -> tuple[str, int]:
    # torch reads the rendezvous address from MASTER_ADDR/MASTER_PORT.
    host = os.environ.get("MASTER_ADDR", "")
    port_text = os.environ.get("MASTER_PORT", "")
    if not host or not port_text:
        raise ShmCollectiveError(
            f"{what} takes the address from MASTER_ADDR and MASTER_PORT, but "
            f"MASTER_ADDR={quoted(host)}, MASTER_PORT={quoted(port_text)}; set both, "
            f"or use a tcp://host:port init method"
        )
    port = parse_port(port_text, what="MASTER_PORT")
    # NetworkAddress drops an IPv6 MASTER_ADDR's brackets, as upstream does.
    return NetworkAddress(host, port).host, port


def _file_address(method: str, what: str) -> tuple[str, int]:
    # The path torch's _file_rendezvous_handler opens, as it is (file://tmp/x is
    # /x): the same for every rank, whatever its working directory.
    path = urlparse(method).path
    if not path:
        raise ShmCollectiveError(f"{what} names no file; expected 'file:///path'")
    digest = hashlib.sha256(path.encode("utf-8", "surrogatepass")).hexdigest()
    return f"file.{digest[:16]}", 0


@dataclasses.dataclass(frozen=True)
class ShmNamespace:
    """Names one engine's (one pipeline stage's) shared-memory segments.

    ``addr``/``port`` come from the engine's init address (``port`` 0: not over TCP);
    ``uid`` is the real user id the kernel puts in the name; ``pp_rank`` > 0 gives
    each pipeline stage its own segments (stage 0 keeps the released kernel's names).
    """

    addr: str
    port: int
    uid: int = dataclasses.field(default_factory=os.getuid)
    pp_rank: int = 0

    def __post_init__(self) -> None:
        what = f"ShmNamespace.addr={quoted(self.addr)}"
        if not isinstance(self.addr, str) or not self.addr:
            raise ShmCollectiveError(f"{what}: expected a host name or address")
        if not _ADDR_RE.fullmatch(self.addr):
            bad = sorted({c for c in self.addr if not _ADDR_RE.fullmatch(c)})
            raise ShmCollectiveError(
                f"{what} contains {quoted(''.join(bad))}; only letters, digits and "
                f". _ - : % are allowed in a /dev/shm segment name"
            )
        check_int("ShmNamespace.port", self.port, 0, _MAX_PORT)
        check_int("ShmNamespace.uid", self.uid, 0, 2**32 - 1)
        check_int("ShmNamespace.pp_rank", self.pp_rank, 0, MAX_RANK)
        longest = len(self.segment_name(MAX_RANK))
        if longest > NAME_MAX:
            raise ShmCollectiveError(
                f"{what} is too long: segment names would be up to {longest} "
                f"characters, over the {NAME_MAX} allowed in /dev/shm; {_SHORTER}"
            )

    @classmethod
    def from_init_method(
        cls, method: str, *, uid: Optional[int] = None, pp_rank: int = 0
    ) -> "ShmNamespace":
        """The namespace of the engine whose init method is ``method``.

        ``tcp://host:port`` and ``tcp://[ipv6]:port`` give ``(host, port)``; ``env://``
        reads (never writes) ``MASTER_ADDR``/``MASTER_PORT``, as torch does;
        ``file:///path`` gives ``file.<16 hex of sha256(path)>`` and port 0.
        """
        what = f"dist_init_method={quoted(method)}"
        if not isinstance(method, str) or not method.strip():
            raise ShmCollectiveError(f"{what}: expected {_ALL_FORMS}")
        method = method.strip()
        scheme = method.split("://", 1)[0].lower() if "://" in method else ""
        if scheme == "tcp":
            host, port = _tcp_address(method, what=what)
        elif scheme == "env":
            host, port = _env_address(what)
        elif scheme == "file":
            host, port = _file_address(method, what)
        else:
            raise ShmCollectiveError(
                f"{what}: unsupported scheme; expected {_ALL_FORMS}"
            )
        uid = os.getuid() if uid is None else uid
        try:
            return cls(addr=host, port=port, uid=uid, pp_rank=pp_rank)
        except ShmCollectiveError as exc:
            raise ShmCollectiveError(f"{what}: {exc}") from None

    @property
    def kernel_addr(self) -> str:  # MASTER_ADDR for the released kernel
        stage = f"{_STAGE_MARK}{self.pp_rank}" if self.pp_rank else ""
        return self.addr + stage

    @property
    def prefix(self) -> str:
        """Every segment name of this namespace is ``prefix + "_" + rank``."""
        return f"{SHM_SEGMENT_PREFIX}_{self.uid}_{self.kernel_addr}_{self.port}"

    def segment_name(self, rank: int) -> str:
        return f"{self.prefix}_{check_int('rank', rank, 0, MAX_RANK)}"
