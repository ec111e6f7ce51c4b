"""sglang's spawn path on a real two-node kernel (a throw-away VM): what ``plan --json`` says is what each
rank spawned inside ``configure_subprocess`` observes.

The VM has node 0 = CPUs 0-1 and node 1 = CPUs 2-3. Each test boots one VM and
runs tests/vm_scripts/spawn_path.py there.
"""

from __future__ import annotations

import pytest
from numavm import run_script_in_vm

SCRIPT = "tests/vm_scripts/spawn_path.py"
NODE_CPUS = {0: "0-1", 1: "2-3"}


def run_in_vm(*script_args: str) -> dict:
    return run_script_in_vm(
        SCRIPT, *script_args, vm_args=["--nodes", "2", "--cpus", "4"], vm_timeout_s=600
    )


def assert_as_planned(row: dict, *, node: int) -> None:
    plan, observed = row["plan"], row["observed"]
    assert (
        plan["numa_node"],
        plan["cpus"],
        plan["mem_policy"],
        plan["mem_nodes"],
        plan["strategy"],
    ) == (node, NODE_CPUS[node], "bind", str(node), "exec"), plan
    assert observed["cpus"] == plan["cpus"], row
    assert (observed["policy"], observed["policy_nodes"]) == (
        "bind",
        plan["mem_nodes"],
    ), row
    anon = {int(k): v for k, v in observed["anon_kb"].items()}
    assert anon.get(node, 0) / sum(anon.values()) >= 0.99, row


@pytest.mark.vm
def test_cpu_ranks_spawned_by_sglang_observe_their_plan():
    out = run_in_vm("cpu-engines")
    tp2 = out["tp2"]
    assert [row["gpu_id"] for row in tp2] == [0, 1]
    for row, node in zip(tp2, (0, 1)):
        assert_as_planned(row, node=node)
    # sglang-router's data parallelism: two tp=1 engines, --base-gpu-id 0 and 1, groups 0-1|2-3.
    router = out["router"]
    assert [row["gpu_id"] for row in router] == [0, 1]
    for row, node in zip(router, (0, 1)):
        assert_as_planned(row, node=node)


@pytest.mark.vm
def test_one_visible_gpu_per_spawn_binds_each_gpus_node():
    """tp=2 x dp=2 under SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1: every spawn is GPU 0 with one visible GPU."""
    rows = run_in_vm("gpu-reindex")["rows"]
    assert [(row["gpu_id"], row["spawned_gpu_id"]) for row in rows] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
    ]
    for row, node in zip(rows, (0, 0, 1, 1)):
        assert_as_planned(row, node=node)
