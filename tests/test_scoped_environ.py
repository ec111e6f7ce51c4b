"""scoped_environ: variables set for one block, the previous values (or their absence) put back."""

from __future__ import annotations

import os

import pytest

from sglang.srt.distributed.shm_collective import scoped_environ


def test_values_hold_only_inside_the_block(monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_SCOPED_A", "before")
    monkeypatch.delenv("SGLANG_TEST_SCOPED_B", raising=False)
    with scoped_environ(
        {"SGLANG_TEST_SCOPED_A": "inside", "SGLANG_TEST_SCOPED_B": "new"}
    ):
        assert os.environ["SGLANG_TEST_SCOPED_A"] == "inside"
        assert os.environ["SGLANG_TEST_SCOPED_B"] == "new"
    assert os.environ["SGLANG_TEST_SCOPED_A"] == "before"
    assert "SGLANG_TEST_SCOPED_B" not in os.environ


def test_previous_values_and_absence_come_back_on_error(monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_SCOPED_A", "before")
    monkeypatch.delenv("SGLANG_TEST_SCOPED_B", raising=False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="boom"):
        with scoped_environ(
            {"SGLANG_TEST_SCOPED_A": "inside", "SGLANG_TEST_SCOPED_B": "new"}
        ):
            raise RuntimeError("boom")
    assert dict(os.environ) == before


def test_a_variable_removed_inside_the_block_is_restored(monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_SCOPED_A", "before")
    with scoped_environ({"SGLANG_TEST_SCOPED_A": "inside"}):
        del os.environ["SGLANG_TEST_SCOPED_A"]
    assert os.environ["SGLANG_TEST_SCOPED_A"] == "before"
