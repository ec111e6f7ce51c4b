"""Segment names under attack: name lengths, ports, file:// paths, escaped errors.

A segment name is the engine's init address in ``/dev/shm``: these tests feed it the
longest, oddest and most hostile values an operator or a launcher can pass, against
a real /dev/shm and the stand-in kernel.
"""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import pytest
import shm_kernel_standin as kernel

from sglang.srt.distributed.shm_collective import (
    init_shm_collective,
    unlink_shm_segments,
)
from sglang.srt.distributed.shm_namespace import (
    NAME_MAX,
    ShmCollectiveError,
    ShmNamespace,
    parse_port,
)

SHM = "/dev/shm"
UID = os.getuid()


def _from_env(addr: str, port: str) -> ShmNamespace:
    with mock.patch.dict(os.environ, {"MASTER_ADDR": addr, "MASTER_PORT": port}):
        return ShmNamespace.from_init_method("env://")


# ------------------------------------------------------------------------------ name length


def test_longest_accepted_host_makes_a_segment_and_one_more_character_is_rejected():
    # Room for rank 99999 is kept in every name, so its name is the longest.
    fixed = len(f"deepspeed_allreduce_buffer_{UID}__65535_99999")
    longest = "h" * (NAME_MAX - fixed)
    ns = ShmNamespace(addr=longest, port=65535)
    assert ShmNamespace.from_init_method(f"tcp://{longest}:65535") == ns
    assert len(ns.segment_name(99999)) == NAME_MAX
    segment = os.path.join(SHM, ns.segment_name(0))
    with kernel.registered("released"):
        try:
            init_shm_collective(ns, tp_size=1, tp_rank=0)
            assert os.path.exists(segment)
        finally:
            assert unlink_shm_segments() == [segment]
    assert not os.path.exists(segment)
    for make in (
        lambda: ShmNamespace(addr=longest + "h", port=65535),
        lambda: ShmNamespace.from_init_method(f"tcp://{longest}h:65535"),
        lambda: dataclasses.replace(ns, pp_rank=1),
    ):
        with pytest.raises(ShmCollectiveError, match="too long.*--dist-init-addr"):
            make()


# -------------------------------------------------------------------------------------- port


@pytest.mark.parametrize(
    "port_text", ["²", "٨٠", "1²", "\x00", "8\x0b0", "+80", "8_0", "0x50", "-1"]
)
def test_port_must_be_ascii_digits_and_the_error_shows_the_value(port_text):
    method = f"tcp://127.0.0.1:{port_text}"
    with pytest.raises(ShmCollectiveError) as info:
        ShmNamespace.from_init_method(method)
    message = str(info.value)
    assert message.startswith(f"dist_init_method={method!r}: ")
    assert repr(port_text)[1:-1] in message.partition(": ")[2]
    assert message.isprintable()
    if "\x00" in port_text:
        return  # no environment variable can hold a NUL
    with pytest.raises(ShmCollectiveError) as info:
        _from_env("h", port_text)
    assert "MASTER_PORT" in str(info.value) and repr(port_text) in str(info.value)


def test_port_digit_count_is_bounded_before_conversion():
    with pytest.raises(ShmCollectiveError, match="expected 1 to 65535"):
        parse_port("9" * 5000, what="MASTER_PORT")
    assert parse_port("029500", what="x") == 29500


# ---------------------------------------------------------------------------------- file://


def test_file_init_method_uses_torchs_path_whatever_the_working_directory(
    tmp_path, monkeypatch
):
    import torch.distributed as dist

    method = f"file://ignored{tmp_path}/store"
    store, _rank, _world = next(dist.rendezvous(method + "?rank=0&world_size=1"))
    # torch drops the netloc: the store is tmp_path/store, not ./ignored/...
    assert (tmp_path / "store").exists() and not (tmp_path / "ignored").exists()
    del store
    seen = []
    for cwd in ("a", "b"):
        (tmp_path / cwd).mkdir()
        monkeypatch.chdir(tmp_path / cwd)
        seen.append(
            (
                ShmNamespace.from_init_method(method),
                ShmNamespace.from_init_method("file://tmp/x"),
            )
        )
    assert seen[0] == seen[1]
    assert seen[0][0] == ShmNamespace.from_init_method(
        f"file://{tmp_path}/store?rank=1&world_size=2"
    )
    assert seen[0][1] == ShmNamespace.from_init_method("file:///x")
    assert seen[0][0] != seen[0][1]
    with pytest.raises(ShmCollectiveError, match="names no file"):
        ShmNamespace.from_init_method("file://tmp")


# ------------------------------------------------------------------------ escaped messages


@pytest.mark.parametrize(
    "call",
    [
        lambda: ShmNamespace.from_init_method("tcp://fe80::1%\n\x00:1"),
        lambda: ShmNamespace.from_init_method("tcp://[fe80::1%\x00]"),
        lambda: ShmNamespace.from_init_method("tcp://[fe80::1%\x1b]x"),
        lambda: ShmNamespace.from_init_method("tcp://h\x00:8\n0"),
        lambda: ShmNamespace.from_init_method("tcp://h\x00:1\x7f"),
        lambda: ShmNamespace.from_init_method("tcp://h:" + "9" * 250),
        lambda: ShmNamespace.from_init_method("tcp://h\x00:1"),
        lambda: ShmNamespace.from_init_method("bad\x00://x"),
        lambda: _from_env("a\u2028b", "1"),
        lambda: _from_env("", "\x1b"),
        lambda: ShmNamespace(addr="\n", port=1),
    ],
)
def test_outside_values_in_errors_are_escaped(call):
    with pytest.raises((ShmCollectiveError, ValueError)) as info:
        call()
    assert str(info.value).isprintable(), str(info.value)
