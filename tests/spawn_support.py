"""sglang's spawn shape for tests: ``with numa_utils.configure_subprocess(args, gpu_id): proc.start()``.

``start_rank`` starts one child exactly as ``Engine._launch_scheduler_processes``
does and returns what the child saw of its own binding (or the error that
stopped the spawn, and whether a child was started at all). ``numactl_standin``
writes a numactl that behaves like one this machine cannot have (seccomp
refusing it, libnuma missing, a cpuset that shrinks after the probe), and
``fake_host`` a sysfs tree with GPUs on two nodes.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import stat
import sys
import types
from pathlib import Path
from typing import Any, Optional

import fakesys


def report_binding(queue: Any) -> None:
    """A child's target (top level): its CPUs and memory policy, as the kernel reports them."""
    from sglang.srt.placement.libnuma import read_mempolicy

    policy, nodes = read_mempolicy()
    queue.put(
        {
            "pid": os.getpid(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "policy": policy,
            "nodes": sorted(nodes),
        }
    )


def args(**fields: Any) -> types.SimpleNamespace:
    """The ServerArgs fields placement reads, with upstream's defaults."""
    base = dict(
        tp_size=1,
        pp_size=1,
        dp_size=1,
        nnodes=1,
        node_rank=0,
        base_gpu_id=0,
        gpu_id_step=1,
        numa_node=None,
        device="cuda",
    )
    base.update(fields)
    return types.SimpleNamespace(**base)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def start_rank(server_args: Any, gpu_id: int, *, timeout_s: float = 120.0) -> dict:
    """Spawn one child inside ``configure_subprocess(server_args, gpu_id)``; what happened, as a dict:
    ``report`` (the child's binding) or ``error`` (the exception at the block), ``started`` (a child ran),
    and ``warnings`` (WARNING and ERROR lines logged meanwhile)."""
    from sglang.srt.utils import numa_utils

    records = _Records()
    root = logging.getLogger()
    root.addHandler(records)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=report_binding, args=(queue,))
    out: dict = {"warnings": records.lines}
    try:
        try:
            with numa_utils.configure_subprocess(server_args, gpu_id):
                proc.start()
        except Exception as exc:  # noqa: BLE001 - the caller asserts on it
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["started"] = proc.pid is not None
        if proc.pid is not None:
            out["report"] = _report_or_none(queue, proc, timeout_s=timeout_s)
            proc.join(30)
            out["exitcode"] = proc.exitcode
    finally:
        root.removeHandler(records)
    return out


def _report_or_none(queue: Any, proc: Any, *, timeout_s: float) -> Optional[dict]:
    """The child's report; None once it has exited without one (or at the deadline)."""
    import queue as queues
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.5)
        except queues.Empty:
            if not proc.is_alive():
                try:
                    return queue.get(timeout=1)
                except queues.Empty:
                    return None
    return None


# --------------------------------------------------------------------------- hosts and numactl stand-ins


def fake_host(
    root: Path,
    *,
    node_cpus: Optional[dict[int, set[int]]] = None,
    gpus_per_node: int = 2,
) -> Path:
    """A two-node tree with ``gpus_per_node`` GPUs on each node (GPU i at fakesys.gpu_address(i)).

    Default: node 0 is this host's real CPUs, node 1 two CPUs that exist only in the tree.
    """
    real = frozenset(os.sched_getaffinity(0))
    node_cpus = node_cpus or {0: set(real), 1: {max(real) + 1, max(real) + 2}}
    pci = [fakesys.host_bridge(0)]
    index = 0
    for node in sorted(node_cpus):
        for _ in range(gpus_per_node):
            pci.append(fakesys.PciSpec(fakesys.gpu_address(index), node))
            index += 1
    return fakesys.write_sysfs(
        root,
        fakesys.Host(
            nodes={
                node: fakesys.NodeSpec(cpus=frozenset(cpus))
                for node, cpus in node_cpus.items()
            },
            pci=pci,
        ),
    )


_STANDIN = r'''#!{python}
"""numactl stand-in ({mode}): behaves like a numactl this machine cannot have."""
import json, os, sys
mode, log, marker, tree, real = {mode!r}, {log!r}, {marker!r}, {tree!r}, {real!r}
argv = sys.argv[1:]
count = next((i for i, a in enumerate(argv) if not a.startswith("--")), len(argv))
options, program = argv[:count], argv[count:]
if log:
    with open(log, "a") as f:
        f.write(json.dumps(argv) + "\n")
def refuse(message, status=1):
    sys.stderr.write(message + "\n")
    sys.exit(status)
if mode == "refuse-all":
    refuse("numactl: set_mempolicy: Operation not permitted" if any("bind" in o or "preferred" in o for o in options)
           else "numactl: sched_setaffinity: Operation not permitted")
if mode == "no-libnuma":
    refuse("numactl: error while loading shared libraries: libnuma.so.1: cannot open shared object file: "
           "No such file or directory", 127)
if mode == "refuse-membind" and any(o.startswith("--membind") for o in options):
    refuse("numactl: setting membind: Invalid argument")
if mode == "shrinks-after-probe":
    if os.path.exists(marker):
        refuse("numactl: sched_setaffinity: Invalid argument")
    if os.path.basename(program[0]) == "true":
        open(marker, "w").close()  # the cpuset shrinks right after the probe passed
if mode == "hang" and os.path.basename(program[0]) != "true":
    import time
    time.sleep(3600)  # a rank that never gets to Python
if mode == "fake-host":
    # The real numactl, on the CPUs of the fake tree's nodes (its CPUs are this host's), and the
    # memory of the nodes this kernel has (it has no second node).
    cpus, kept = set(), []
    for option in options:
        name, _, value = option.partition("=")
        for part in value.split(","):
            lo, _, hi = part.partition("-")
            ids = range(int(lo), int(hi or lo) + 1)
            if name == "--physcpubind":
                cpus.update(ids)
            elif name == "--cpunodebind":
                for node in ids:
                    text = open(f"{{tree}}/devices/system/node/node{{node}}/cpulist").read().strip()
                    for span in text.split(","):
                        a, _, b = span.partition("-")
                        cpus.update(range(int(a), int(b or a) + 1))
            elif all(os.path.isdir(f"/sys/devices/system/node/node{{n}}") for n in ids):
                kept.append(option)
    cpu = ["--physcpubind=" + ",".join(map(str, sorted(cpus)))] if cpus else []
    os.execv(real, [real, *cpu, *kept, *program])
# Accepted: run the program without binding anything.
os.execvp(program[0], program)
'''


def numactl_standin(
    directory: Path, mode: str, *, tree: Optional[Path] = None
) -> tuple[Path, Path]:
    """Write ``directory/numactl`` in ``mode``; returns (its directory, its argv log). In
    ``fake-host`` mode it applies the CPU binding on the nodes of sysfs ``tree``."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "numactl-calls.jsonl"
    path = directory / "numactl"
    path.write_text(
        _STANDIN.format(
            python=sys.executable,
            mode=mode,
            log=str(log),
            marker=str(directory / "probe-passed"),
            tree=str(tree or ""),
            real=shutil.which("numactl") or "numactl",
        )
    )
    path.chmod(stat.S_IRWXU)
    return directory, log


def numactl_calls(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def use_fake_host(monkeypatch: Any, root: Path) -> Path:
    """``root`` as this host's sysfs, on a CUDA platform, for this process and the ones it
    starts (the harness reads the variables, see tests/harness/sitecustomize.py)."""
    from sglang.srt.placement import topology
    from sglang.srt.utils import numa_utils

    monkeypatch.setattr(topology, "SYSFS_ROOT", str(root))
    monkeypatch.setattr(numa_utils, "_is_cuda", True)
    monkeypatch.setattr(numa_utils, "_is_xpu", False)
    monkeypatch.setenv("PLACEMENT_TESTS_SYSFS", str(root))
    monkeypatch.setenv("PLACEMENT_TESTS_PLATFORM", "cuda")
    return root


def without_numactl(monkeypatch: Any) -> None:
    """PATH without any numactl on it."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    kept = [d for d in path if not os.path.exists(os.path.join(d, "numactl"))]
    monkeypatch.setenv("PATH", os.pathsep.join(kept))
