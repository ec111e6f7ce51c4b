"""sglang's spawn path on a real two-node kernel (a throw-away VM, tests/numavm.py):
where a spawned rank's memory is, which no fake host can show.

One VM boot (node 0 = CPUs 0-1, node 1 = CPUs 2-3, a PCI device on node 1) runs
tests/vm_scripts/spawn_locality.py: three ranks spawned inside
``configure_subprocess`` as sglang's Engine spawns them (two CPU-device ranks given
one node each by SGLANG_CPU_OMP_THREADS_BIND, and a GPU rank whose stand-in NVML GPU is
the PCI device on node 1), each touching 64 MiB. Everything else the spawn path does is
checked faster on fake hosts (tests/test_fake_hosts.py) and this host
(tests/test_spawn.py); benchmarks/vm_page_locality.py compares the other ways to bind.
"""

from __future__ import annotations

import pytest
from numavm import run_script_in_vm

NODE_CPUS = {0: [0, 1], 1: [2, 3]}
MIN_LOCAL = 0.99  # of a rank's anonymous resident memory, on its node


def local_share(report: dict, node: int) -> float:
    anon = {int(n): kb for n, kb in report["anon_kb"].items()}
    return anon.get(node, 0) / sum(anon.values())


@pytest.mark.vm
def test_spawned_ranks_memory_is_on_their_node():
    out = run_script_in_vm(
        "tests/vm_scripts/spawn_locality.py",
        *("--mode", "exec", "--ranks", "cpu0,cpu1,gpu", "--touch-mb", "64"),
        vm_args=["--nodes", "2", "--cpus", "4", "--pci-node", "1"],
        vm_timeout_s=420,
    )
    assert [(row["rank"], row["node"]) for row in out["ranks"]] == [
        ("cpu0", 0),
        ("cpu1", 1),
        ("gpu", 1),
    ]
    for row in out["ranks"]:
        report, node = row["report"], row["node"]
        assert row["exitcode"] == 0 and report, row
        assert report["thread_cpus"] == [NODE_CPUS[node]], row
        assert (report["policy"], report["policy_nodes"]) == ("bind", [node]), row
        share = local_share(report, node)
        assert share >= MIN_LOCAL, f"{row['rank']}: {share:.2%} on node {node}: {row}"
