"""In-process binding on a real two-node kernel (a throw-away VM): pages touched before the bind move.

The script pins itself to cpu 0 (node 0), touches memory, binds in process to
node 1 (cpus 2-3, membind 1) and reports /proc/self as JSON.
"""

from __future__ import annotations

import pytest
from numavm import run_script_in_vm

from sglang.srt.placement_tools.observe import ObservedBinding

SCRIPT = "tests/vm_scripts/inprocess_bind.py"


def run_in_vm(*script_args: str) -> dict:
    return run_script_in_vm(
        SCRIPT, *script_args, vm_args=["--nodes", "2", "--cpus", "4"], vm_timeout_s=150
    )


@pytest.mark.vm
def test_in_process_bind_moves_pages_and_reads_back_as_planned():
    out = run_in_vm()
    observed = ObservedBinding.from_dict(out["observed"])
    assert observed.cpus == {2, 3}
    assert (observed.policy, observed.policy_nodes) == ("bind", {1})
    assert out["worker_cpus"] == [2, 3]
    assert out["diffs"] == []
    assert out["ratio_before"] < 0.5, "the script's first pages should be on node 0"
    assert observed.local_page_ratio([1]) >= 0.95, out
    assert out["summary"].startswith("DP0 PP0 TP0: cpus 2-3")
