"""The multiprocessing launcher on a real two-node kernel (a throw-away VM), with a PCI device on node 1.

One boot: the script plans the rank of that device (--gpus), then launches it
through run_ranks_mp twice, as planned (exec under numactl) and bound
in-process, from a parent pinned to node 0, and verifies each from inside.
"""

from __future__ import annotations

import pytest

from numavm import run_script_in_vm

SCRIPT = "tests/vm_scripts/mp_page_locality.py"
PCI_ON_NODE_1 = "0000:81:00.0"  # the first device behind numa-vm's first --pci-numa bridge


def run_in_vm(*script_args: str) -> dict:
    return run_script_in_vm(SCRIPT, *script_args, vm_args=["--nodes", "2", "--cpus", "4", "--pci-numa", "1:e1000e"],
                            vm_timeout_s=400)


@pytest.mark.vm
def test_mp_ranks_on_the_devices_node_verify_in_the_vm():
    out = run_in_vm("--gpus", PCI_ON_NODE_1, "--strategies", "exec,in-process")
    (plan,) = out["plan"]
    assert (plan["pci"], plan["numa_node"], plan["cpus"], plan["mem_nodes"], plan["mem_policy"], plan["strategy"]) == (
        PCI_ON_NODE_1, 1, "2-3", "1", "bind", "exec"
    ), plan
    assert out["parent_cpus"] == [0]
    exec_row, in_process_row = out["rows"]
    for row, strategy, minimum in ((exec_row, "exec", 0.99), (in_process_row, "in-process", 0.95)):
        assert row["strategy"] == strategy
        assert row["ok"], row["differences"]
        assert row["observed_cpus"] == "2-3"
        assert row["observed_policy"] == "bind:1"
        assert row["local_page_ratio"] >= minimum, row
