"""Inside the two-node VM: ranks spawned as sglang spawns them, and where their memory is.

    python tests/vm_scripts/spawn_locality.py [--mode exec|unbound|in-process]
                                              [--ranks cpu0,cpu1,gpu] [--touch-mb 64]

The VM (tests/numavm.py --nodes 2 --cpus 4 --pci-node 1) has node 0 = CPUs 0-1 and
node 1 = CPUs 2-3, and a PCI device on node 1. The ranks:

* ``cpu0``, ``cpu1``: CPU-device ranks 0 and 1 of a tp=2 engine with
  ``SGLANG_CPU_OMP_THREADS_BIND=0-1|2-3``: nodes 0 and 1.
* ``gpu``: GPU 0 of a tp=1 CUDA engine, the stand-in NVML's one GPU being the PCI
  device on node 1 (tests/fakes/pynvml.py): node 1, found as sglang finds it.

The modes:

* ``exec``: each rank spawned inside ``numa_utils.configure_subprocess(server_args,
  gpu_id)``, as sglang's Engine spawns it (tests/harness/rank_probe.py).
* ``unbound``: spawned without it; it touches memory running on node 0, then as much
  again running anywhere (nothing places it).
* ``in-process``: spawned without it; it touches memory running on node 0, then binds
  itself to its node as an in-process placement does (``numa_bind_to_node``, as
  ``configure_scheduler_process`` runs it for a Ray actor or a spawn whose numactl
  wrapper cannot run), and touches as much again.

Each rank touches ``--touch-mb`` MiB (in-process: twice) and reports its CPUs, memory
policy and resident kB per node. numa_utils' heavy imports are stood in for
(``guest_stubs``). Prints one JSON object on its last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, os.pardir, "fakes"), HERE]
import guest_stubs  # noqa: E402  (puts tests/harness on the path)
import rank_probe  # noqa: E402

NODE_CPUS = {0: [0, 1], 1: [2, 3]}
RANKS = {"cpu0": 0, "cpu1": 1, "gpu": 1}  # rank -> its node


def engine(rank: str) -> types.SimpleNamespace:
    """The ServerArgs fields the spawn path reads, of the engine ``rank`` belongs to."""
    device, tp = ("cuda", 1) if rank == "gpu" else ("cpu", 2)
    return types.SimpleNamespace(
        device=device,
        tp_size=tp,
        dp_size=1,
        pp_size=1,
        base_gpu_id=0,
        gpu_id_step=1,
        numa_node=None,
    )


def node1_pci_device() -> str:
    """The PCI device numavm put on node 1 (not its bridges)."""
    for path in sorted(os.listdir("/sys/bus/pci/devices")):
        base = os.path.join("/sys/bus/pci/devices", path)
        with open(os.path.join(base, "numa_node")) as f, open(
            os.path.join(base, "class")
        ) as g:
            if f.read().strip() == "1" and not g.read().startswith("0x0604"):
                return path
    raise SystemExit("no PCI device on node 1: boot the VM with --pci-node 1")


def exec_rank(rank: str, touch_mb: int) -> dict:
    from sglang.srt.utils import numa_utils

    numa_utils._is_cuda = rank == "gpu"  # the platform this engine runs on
    (row,) = rank_probe.launch(
        engine(rank), gpu_ids=[0 if rank != "cpu1" else 1], touch_mb=touch_mb
    )
    return row


def late_rank(writer, node: int, touch_mb: int, bind: bool) -> None:
    """A spawn target: touch memory running on node 0, then (``bind``) bind itself to
    ``node``, touch as much again, report."""
    every_cpu = os.sched_getaffinity(0)
    os.sched_setaffinity(0, NODE_CPUS[0])
    block = bytearray(touch_mb << 20)
    block[::4096] = b"\x01" * len(range(0, len(block), 4096))
    os.sched_setaffinity(0, every_cpu)  # what it may run on, as any unplaced process
    if bind:
        guest_stubs.install()
        from sglang.srt.utils import numa_utils

        numa_utils.numa_bind_to_node(node, cpus=NODE_CPUS[node])
    rank_probe.report_rank(writer, touch_mb)


def late_rank_row(rank: str, touch_mb: int, *, bind: bool) -> dict:
    import multiprocessing

    reader, writer = multiprocessing.Pipe(duplex=False)
    proc = multiprocessing.Process(
        target=late_rank, args=(writer, RANKS[rank], touch_mb, bind)
    )
    proc.start()
    writer.close()
    report = reader.recv() if reader.poll(600) else None
    proc.join(60)
    return {"report": report, "exitcode": proc.exitcode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode", choices=("exec", "unbound", "in-process"), default="exec"
    )
    parser.add_argument("--ranks", default="cpu0,cpu1,gpu")
    parser.add_argument("--touch-mb", type=int, default=64)
    args = parser.parse_args()
    import multiprocessing

    multiprocessing.set_start_method("spawn", force=True)  # as sglang's Engine does
    guest_stubs.install()
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "0-1|2-3"
    os.environ["FAKE_NVML_GPUS"] = node1_pci_device()
    rows = []
    for rank in args.ranks.split(","):
        if args.mode == "exec":
            row = exec_rank(rank, args.touch_mb)
        else:
            row = late_rank_row(rank, args.touch_mb, bind=args.mode == "in-process")
        rows.append({"rank": rank, "node": RANKS[rank], **row})
    print(
        json.dumps(
            {"mode": args.mode, "gpu": os.environ["FAKE_NVML_GPUS"], "ranks": rows}
        )
    )


if __name__ == "__main__":
    main()
