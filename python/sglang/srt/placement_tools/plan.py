"""plan: one row per rank of this host, from the core's own decision
(``numa_utils.resolve_placement``), for sglang's spawn path or for a Ray actor."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
from typing import Iterable, Iterator, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
# A model config the probe ranks' ServerArgs resolve against; no weights are read.
PROBE_MODEL = os.path.join(HERE, "probe_model")
# The stand-in NVML (``standin/pynvml.py``) lists the GPUs named in this variable.
STANDIN = os.path.join(HERE, "standin")
GPUS_VAR = "PLACEMENT_TOOLS_GPUS"
NVIDIA = "0x10de"
SNAPSHOT_MARKER = "sglang-placement-snapshot.json"
# What a snapshot replaces, relative to /sys, and the files of each that are copied.
MOUNTED = ("devices/system/node", "devices/system/cpu", "bus/pci/devices")
SYSFS_FILES = (
    ("devices/system/node", "online possible has_cpu has_memory has_normal_memory"),
    ("devices/system/node/node[0-9]*", "cpulist cpumap meminfo distance"),
    ("devices/system/cpu", "online possible present offline kernel_max"),
    ("devices/system/cpu/cpu[0-9]*", "online"),
    ("devices/system/cpu/cpu[0-9]*/topology", "*"),
    ("bus/pci/devices/*", "numa_node vendor device class local_cpulist local_cpus"),
)
_PCI = re.compile(r"(?:([0-9a-f]{4}):)?([0-9a-f]{2}:[0-9a-f]{2}\.[0-7])")


class UsageError(ValueError):
    """Bad input (a flag, a setting, a file): one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Rank:
    dp_rank: int
    pp_rank: int
    tp_rank: int
    gpu_id: int

    @property
    def label(self) -> str:
        return f"DP{self.dp_rank} PP{self.pp_rank} TP{self.tp_rank}"


def format_cpulist(ids: Iterable[int]) -> str:
    """``0-3,8`` for {0, 1, 2, 3, 8}, as sysfs writes CPU and node lists."""
    spans: list[list[int]] = []
    for i in sorted(set(ids)):
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def parse_cpulist(text: str, *, what: str) -> set[int]:
    ids: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.strip().partition("-")
        if not (first.isdigit() and (last or first).isdigit()):
            raise UsageError(f"{what}={text!r} is not a CPU list such as 0-7,16")
        if not int(first) <= int(last or first) < 1 << 16:
            raise UsageError(f"{what}={text!r}: {part!r} is not a range of CPU ids")
        ids.update(range(int(first), int(last or first) + 1))
    return ids


def node_ranks(args, node_rank: int, *, ray: bool = False) -> list[Rank]:
    """The ranks sglang launches on node ``node_rank``, in launch order, with the
    gpu_id it gives each: the engine's ``base_gpu_id + (pp_rank % pp_per_node) *
    tp_per_node + (tp_rank % tp_per_node) * gpu_id_step``, plus the data-parallel
    controller's base per dp rank. RayEngine passes ids from 0 (step 1) and Ray
    picks each actor's GPU: its plan takes them in that order."""
    pp_per_node = max(args.pp_size // args.nnodes, 1)
    nodes_per_group = max(args.nnodes // args.pp_size, 1)
    tp_per_node = args.tp_size // nodes_per_group
    first_pp = pp_per_node * (node_rank // nodes_per_group)
    first_tp = tp_per_node * (node_rank % nodes_per_group)
    base, step = (0, 1) if ray else (args.base_gpu_id, args.gpu_id_step)
    per_dp = pp_per_node * tp_per_node if ray else args.tp_size * args.pp_size * step
    return [
        Rank(
            dp,
            pp,
            tp,
            base
            + dp * per_dp
            + (pp % pp_per_node) * tp_per_node
            + (tp % tp_per_node) * step,
        )
        for dp in range(args.dp_size)
        for pp in range(first_pp, first_pp + pp_per_node)
        for tp in range(first_tp, first_tp + tp_per_node)
    ]


def ray_gpu_ids(ranks: list[Rank]) -> list[Rank]:
    """Ray gives its actors the GPUs CUDA_VISIBLE_DEVICES lists, by those ids."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else []
    if not ids or not all(v.isdigit() for v in ids):
        return ranks
    return [
        dataclasses.replace(r, gpu_id=int(ids[r.gpu_id])) if r.gpu_id < len(ids) else r
        for r in ranks
    ]


def server_args_for(args, *, log_level: str = "error"):
    """sglang's own ServerArgs with the engine flags, for the probe model."""
    from sglang.srt.server_args import ServerArgs

    names = "tp_size pp_size dp_size nnodes node_rank base_gpu_id gpu_id_step"
    fields = {name: getattr(args, name) for name in names.split()}
    return ServerArgs(
        model_path=PROBE_MODEL,
        device=args.device,
        numa_node=args.numa_node,
        log_level=log_level,
        **fields,
    )


def gpu_pci(index: int) -> Optional[str]:
    """The PCI address of CUDA device ``index`` as NVML names it (through
    CUDA_VISIBLE_DEVICES, as upstream asks NVML), in sysfs's spelling; None where
    NVML does not answer."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        try:
            nvml_index = torch.cuda._get_nvml_device_index(index)
            handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, no such device
        return None
    domain, _, rest = (bus.decode() if isinstance(bus, bytes) else bus).partition(":")
    return f"{int(domain, 16):04x}:{rest.lower()}"


def plan_rank(server_args, rank: Rank, *, launcher: str, notes=()) -> dict:
    """The row of ``rank``: a spawn inside ``maybe_reindex_device_id``, as the
    engine starts it, or a Ray actor given Ray GPU ``rank.gpu_id``."""
    if launcher == "ray":
        return plan_index(server_args, rank, rank.gpu_id, launcher="ray", notes=notes)
    from sglang.srt.utils.common import maybe_reindex_device_id

    with maybe_reindex_device_id(rank.gpu_id) as gpu_id:
        return plan_index(server_args, rank, gpu_id, launcher="mp", notes=notes)


def plan_index(server_args, rank: Rank, gpu_id: int, *, launcher: str, notes=()):
    from sglang.srt.utils import numa_utils

    ray = launcher == "ray"
    placement = numa_utils.resolve_placement(server_args, gpu_id, ray_actor=ray)
    device = server_args.device
    pci = None
    if device == "cuda":
        pci = gpu_pci(numa_utils.visible_gpu_index(gpu_id) if ray else gpu_id)
    return placement_row(server_args, rank, gpu_id, placement, launcher, pci, notes)


def placement_row(server_args, rank, gpu_id, placement, launcher, pci, notes) -> dict:
    args = placement.numactl_args or ""
    mem = re.search(r"--(?:membind|preferred)=(\S+)", args)
    if mem:
        mem_nodes = mem[1]
    else:
        keep = placement.mem_policy != "none" and placement.node is not None
        mem_nodes = str(placement.node) if keep else ""
    device, node = server_args.device, placement.node
    if device == "cpu":
        bind = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND", "all")
        why = [f"CPU rank {gpu_id}: SGLANG_CPU_OMP_THREADS_BIND={bind!r}"]
    else:  # the row's head names the GPU's PCI address
        why = [] if pci else [f"no PCI address for GPU {gpu_id}: NVML does not list it"]
    if node is not None:
        source = "its GPU's NUMA affinity"
        if server_args.numa_node is not None:
            source = "--numa-node"
        elif device == "cpu":
            source = "the node of its CPUs"
        why.append(f"node {node} from {source}")
    why += [placement.reason] if placement.reason else []
    if os.environ.get("SGLANG_SET_CPU_AFFINITY", "").lower() in ("1", "true", "yes"):
        if placement.strategy == "none":
            why.append("SGLANG_SET_CPU_AFFINITY=1: sglang's NUMA-blind core slice")
        elif device != "cpu":
            why.append(f"SGLANG_SET_CPU_AFFINITY=1: its slice of node {node}'s cores")
    if placement.strategy == "exec":  # notes: numactl's options on another host
        why += [f"exec under numactl {args}", *notes]
    return {
        "dp_rank": rank.dp_rank,
        "pp_rank": rank.pp_rank,
        "tp_rank": rank.tp_rank,
        "launcher": launcher,
        "device": device,
        "gpu_id": gpu_id,
        "pci": pci,
        "numa_node": node,
        "cpus": format_cpulist(placement.cpus),
        "mem_policy": placement.mem_policy,
        "mem_nodes": mem_nodes,
        "strategy": placement.strategy,
        "numactl_args": placement.numactl_args,
        "reason": "; ".join(why),
    }


def who(row: dict, *, ray: bool = True) -> str:
    if row["device"] == "cpu":
        return f"gpu_id {row['gpu_id']}"
    head = f"{'Ray GPU' if ray and row['launcher'] == 'ray' else 'GPU'} {row['gpu_id']}"
    return f"{head} ({row['pci']})" if row["pci"] else head


def format_plan_row(row: dict) -> str:
    head = f"[DP{row['dp_rank']} PP{row['pp_rank']} TP{row['tp_rank']}] {who(row)}"
    if row["strategy"] == "none":
        return f"{head}: not bound -- {row['reason']}"
    policy, nodes = row["mem_policy"], row["mem_nodes"]
    mem = {"bind": f"membind {nodes}", "preferred": f"preferred {nodes}"}
    return (
        f"{head}: node {row['numa_node']} CPUs {row['cpus']} "
        f"{mem.get(policy, 'no memory policy')} via {row['strategy']} -- "
        f"{row['reason']}"
    )


# ----------------------------------------------------------------- another host


def sysfs_files(root: str) -> Iterator[str]:
    """The files under ``root`` (a sysfs or a snapshot) that placement reads, relative
    to it; a PCI device's directory may be a link, as in /sys."""
    for directory, names in SYSFS_FILES:
        for name in names.split():
            for path in sorted(glob.glob(os.path.join(root, directory, name))):
                if os.path.isfile(path):
                    yield os.path.relpath(path, root)


def read_text(root: str, rel: str) -> Optional[str]:
    try:
        with open(os.path.join(root, rel)) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def check_snapshot(root: str) -> None:
    if read_text(root, "devices/system/cpu/online") is None:
        raise UsageError(
            f"--sysfs-root {root}: not a sysfs tree or snapshot (no readable "
            "devices/system/cpu/online); make one with: python -m "
            "sglang.srt.placement_tools capture DIR"
        )


def snapshot_gpus(root: str) -> list[str]:
    """The NVIDIA GPUs of ``root``'s PCI devices, in PCI order (NVML's)."""
    found = []
    for address in sorted(os.listdir(os.path.join(root, "bus/pci/devices"))):
        rel = f"bus/pci/devices/{address}"
        vendor, cls = read_text(root, f"{rel}/vendor"), read_text(root, f"{rel}/class")
        if vendor == NVIDIA and (cls or "").startswith("0x03"):
            found.append(address)
    return found


def parse_gpus(text: str, root: str) -> list[str]:
    found: list[str] = []
    for part in text.split(","):
        match = _PCI.fullmatch(part.strip().lower())
        if not match:
            raise UsageError(
                f"--gpus={text!r}: {part!r} is not a PCI address; give one per "
                "device index, e.g. --gpus 0000:18:00.0,0000:2a:00.0"
            )
        address = f"{match[1] or '0000'}:{match[2]}"
        if address in found:
            raise UsageError(f"--gpus={text!r} lists {address} twice")
        if not os.path.isdir(os.path.join(root, "bus/pci/devices", address)):
            raise UsageError(
                f"--gpus: {address} is not a PCI device of {root} (see lspci -D)"
            )
        found.append(address)
    return found


def mount_snapshot(root: str, parent_namespace: str) -> None:
    """Replace /sys's node, cpu and PCI device directories by ``root``'s files, each
    on a tmpfs of this (private) mount namespace, never the one it was started in."""
    if os.readlink("/proc/self/ns/mnt") == parent_namespace:
        raise UsageError("--in-namespace: this process shares its mount namespace")
    files = list(sysfs_files(root))
    for rel in MOUNTED:
        target = f"/sys/{rel}"
        mount = ["mount", "-t", "tmpfs", "-o", "mode=0755", "snapshot", target]
        subprocess.run(mount, check=True)
    for rel in files:
        os.makedirs(os.path.dirname(f"/sys/{rel}"), exist_ok=True)
        shutil.copyfile(os.path.join(root, rel), f"/sys/{rel}")


def stand_in_host(*, gpus: Optional[list], allowed: Optional[set], probe: bool):
    """This process plans a host it is not: ``gpus`` through the stand-in NVML (a
    CUDA platform with those devices), ``allowed`` as its CPUs, and, unless
    ``probe``, numactl's options taken as they are (another host's numactl)."""
    import psutil
    import torch

    from sglang.srt.utils import numa_utils

    if gpus is not None:
        os.environ[GPUS_VAR] = ",".join(gpus)
        sys.modules.pop("pynvml", None)
        sys.path.insert(0, STANDIN)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = len(gpus) if visible is None else len([v for v in visible.split(",")])
        numa_utils._is_cuda = True
        torch.cuda.device_count = lambda: count
    if allowed is not None:
        os.sched_getaffinity = lambda pid: set(allowed)
        psutil.Process.cpu_affinity = lambda self, cpus=None: sorted(allowed)
    if not probe:
        numa_utils._probe_numactl_args = lambda numactl_args, **_: (numactl_args, "")


def namespace_argv(argv: list[str]) -> list[str]:
    """``argv`` again, in a private mount namespace (a user namespace too where this
    user is not root), for ``mount_snapshot``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise UsageError("--sysfs-root needs unshare (util-linux) on PATH")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    here = os.readlink("/proc/self/ns/mnt")
    again = [sys.executable, "-m", "sglang.srt.placement_tools", *argv]
    return [unshare, *user, "--mount", "--propagation", "private", *again] + [
        f"--in-namespace={here}"
    ]
