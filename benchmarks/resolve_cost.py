"""Cost of resolving 64 ranks on an 8-node host snapshot, and how often numactl is probed.

    .venv/bin/python benchmarks/resolve_cost.py [--repeat 50]

Builds an 8-node sysfs tree (2 packages x 4 nodes, 8 cores x 2 threads, 2 L3 groups and 8 GPUs per
node), reads
it once, then times plan_engine() for tp=8 x dp=8 = 64 ranks in each affinity mode. The numactl
prober runs a counting stand-in for the numactl binary (this host has one node, so the options of
nodes 1-7 would be refused), to show one probe per distinct option set however many ranks share it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fakesys  # noqa: E402

from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.placement import numactl  # noqa: E402
from sglang.srt.placement.modes import AffinityMode  # noqa: E402
from sglang.srt.placement.resolve import HostCapabilities, HostFacts  # noqa: E402
from sglang.srt.placement.topology import read_topology  # noqa: E402
from sglang.srt.placement.types import ProcessAffinity  # noqa: E402
from sglang.srt.placement_tools import PlanArgs  # noqa: E402
from sglang.srt.placement_tools.engine import plan_engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()

    shape = fakesys.Shape(
        sockets=2,
        nodes_per_socket=4,
        cores_per_node=8,
        threads_per_core=2,
        gpus_per_node=8,
        l3_per_node=2,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = fakesys.write_sysfs(Path(tmp) / "sys", shape)
        start = time.perf_counter()
        topology = read_topology(root)
        read_ms = (time.perf_counter() - start) * 1e3
    affinity = ProcessAffinity(
        cpus=topology.online_cpus,
        mems=frozenset(n.node_id for n in topology.nodes),
        source="snapshot",
    )
    server_args = PlanArgs(tp_size=8, dp_size=8)
    print(
        f"topology: {len(topology.nodes)} nodes, {len(topology.online_cpus)} CPUs, "
        f"{len(topology.pci_devices)} PCI devices; read once in {read_ms:.1f} ms"
    )

    for mode in AffinityMode:
        probes: list[tuple[str, ...]] = []

        def counting_numactl(argv, probes=probes):
            probes.append(tuple(argv))
            return None  # a kernel that accepts every option set

        numactl.run_numactl = counting_numactl
        prober = numactl.NumactlProber(numactl_path="numactl")
        capabilities = HostCapabilities(numactl=prober, libnuma=True)
        timings = []
        with envs.SGLANG_NUMA_AFFINITY_MODE.override(mode):
            for _ in range(args.repeat):
                start = time.perf_counter()
                placements = plan_engine(
                    server_args,
                    facts=HostFacts(
                        topology=topology, affinity=affinity, capabilities=capabilities
                    ),
                    env={},
                )
                timings.append((time.perf_counter() - start) * 1e3)
        distinct = {p.numactl_args for p in placements}
        print(
            f"mode={mode.value:12s} ranks={len(placements)} resolve median {statistics.median(timings):.2f} ms, "
            f"max {max(timings):.2f} ms over {args.repeat} runs; numactl probes {len(probes)} "
            f"for {len(distinct)} distinct option sets"
        )
        if len(probes) > len(distinct):
            raise SystemExit(
                "numactl was probed more often than there are distinct option sets"
            )


if __name__ == "__main__":
    main()
