"""A Ray scheduler actor's own bind on a real two-node kernel (a throw-away VM): pages touched before it move.

The script pins itself to cpu 0 (node 0), imports torch, touches memory (private and
shared), then runs ``bind_scheduler_process`` (what sglang's ``SchedulerActor`` runs in
``configure_scheduler_process``) as the actor of Ray's GPU 1 with ``--numa-node 0 1``,
and reports /proc/self as JSON.
"""

from __future__ import annotations

import pytest
from numavm import run_script_in_vm

from sglang.srt.placement_tools.verify import ObservedBinding

SCRIPT = "tests/vm_scripts/inprocess_bind.py"


def run_in_vm(*script_args: str) -> dict:
    # torch's import alone takes minutes under emulation.
    return run_script_in_vm(
        SCRIPT, *script_args, vm_args=["--nodes", "2", "--cpus", "4"], vm_timeout_s=600
    )


@pytest.mark.vm
def test_a_ray_actors_bind_after_torch_leaves_its_pages_on_the_gpus_node():
    out = run_in_vm()
    observed = ObservedBinding.from_dict(out["observed"])
    assert out["strategy"] == "in-process"
    assert observed.cpus == {2, 3}
    assert (observed.policy, observed.policy_nodes) == ("bind", {1})
    assert out["worker_cpus"] == [2, 3] and out["threads_bound"] > 1
    assert out["diffs"] == []
    assert out["ratio_before"] < 0.5, "the script's first pages should be on node 0"
    # Its own (anonymous) pages moved; file pages (the interpreter's, torch's libraries)
    # are the page cache every process shares, and stay.
    assert out["anon_ratio_after_bind"] >= 0.99, out
    assert observed.local_page_ratio([1], anon_only=True) >= 0.99, out
    # Only this process's own pages moved: the shared mapping's stayed on node 0.
    assert out["shared_ratio_after_bind"] == 0.0, out
    assert out["summary"].startswith("Ray GPU 1: cpus 2-3")
