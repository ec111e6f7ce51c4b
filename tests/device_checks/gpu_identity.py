#!/usr/bin/env python3
"""Print one JSON object describing how this host's GPUs are identified.

Run from the repository root on a GPU machine: ``python tests/device_checks/gpu_identity.py``.
It records torch's and NVML's view of each GPU, the sysfs NUMA facts of its PCI
function, and what ``identify_accelerators`` answers under several
``CUDA_VISIBLE_DEVICES`` values and runtimes. Every section records its own
error. The checks run in a child process group that is killed at ``--deadline``
seconds; what finished before then is still printed, so the script never hangs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "python"))

START = time.monotonic()


def section(name: str, fn: Callable[[], Any]) -> Any:
    """Run one part of the check and write its result as one JSON line, at once."""
    began = time.monotonic()
    try:
        value = fn()
        line = {"section": name, "status": "ok", "value": value}
    except BaseException as exc:  # record, then carry on with the next section
        value = None
        line = {
            "section": name,
            "status": "error",
            "value": {
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(limit=4),
            },
        }
    line["seconds"] = round(time.monotonic() - began, 2)
    sys.stdout.write(json.dumps(line, default=repr) + "\n")
    sys.stdout.flush()
    return value


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"<{type(exc).__name__}: {exc.strerror}>"


def env_facts() -> dict[str, Any]:
    keys = (
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "NVIDIA_VISIBLE_DEVICES",
        "ZE_AFFINITY_MASK",
    )
    return {
        "python": sys.version.split()[0],
        "env": {k: os.environ.get(k) for k in keys},
        "sched_getaffinity": sorted(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
    }


def sysfs_gpus() -> list[dict[str, Any]]:
    base = "/sys/bus/pci/devices"
    found = []
    for addr in sorted(os.listdir(base)):
        vendor = read_text(f"{base}/{addr}/vendor")
        if vendor.lower() != "0x10de":
            continue
        found.append(
            {
                "address": addr,
                "class": read_text(f"{base}/{addr}/class"),
                "device": read_text(f"{base}/{addr}/device"),
                "numa_node": read_text(f"{base}/{addr}/numa_node"),
                "local_cpulist": read_text(f"{base}/{addr}/local_cpulist"),
            }
        )
    return found


def topology_summary() -> dict[str, Any]:
    from sglang.srt.placement.cpulist import format_cpulist
    from sglang.srt.placement.devices import accelerator_pci_devices
    from sglang.srt.placement.topology import read_topology

    topo = read_topology("/sys")
    return {
        "root": topo.root,
        "node_ids": list(topo.node_ids),
        "nodes": {
            str(n.node_id): {
                "cpus": format_cpulist(n.cpus),
                "memory_kb": n.memory_kb,
                "distances": list(n.distances),
            }
            for n in topo.nodes
        },
        "online_cpus": format_cpulist(topo.online_cpus),
        "pci_device_count": len(topo.pci_devices),
        "nvidia_gpus": [
            {"address": d.address, "numa_node": d.numa_node, "class": d.pci_class}
            for d in accelerator_pci_devices(topo, device="cuda")
        ],
    }


def nvml_facts() -> dict[str, Any]:
    import pynvml

    out: dict[str, Any] = {"module": getattr(pynvml, "__file__", "?")}
    pynvml.nvmlInit()
    try:
        out["driver"] = _try(pynvml.nvmlSystemGetDriverVersion)
        count = pynvml.nvmlDeviceGetCount()
        out["count"] = count
        devices = []
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            info = _try(lambda: pynvml.nvmlDeviceGetPciInfo(h))
            dev: dict[str, Any] = {
                "index": i,
                "name": _try(lambda: pynvml.nvmlDeviceGetName(h)),
                "uuid": _try(lambda: pynvml.nvmlDeviceGetUUID(h)),
                "busId": (
                    _try(lambda: info.busId) if not isinstance(info, str) else info
                ),
                "busIdLegacy": (
                    _try(lambda: info.busIdLegacy)
                    if not isinstance(info, str)
                    else info
                ),
                "busId_type": type(getattr(info, "busId", None)).__name__,
                "numa_node_id": _try(lambda: pynvml.nvmlDeviceGetNumaNodeId(h)),
                "memory_affinity_node": _try(
                    lambda: _bits(
                        pynvml.nvmlDeviceGetMemoryAffinity(
                            h, 1, pynvml.NVML_AFFINITY_SCOPE_NODE
                        )
                    )
                ),
                "memory_affinity_socket": _try(
                    lambda: _bits(
                        pynvml.nvmlDeviceGetMemoryAffinity(
                            h, 1, pynvml.NVML_AFFINITY_SCOPE_SOCKET
                        )
                    )
                ),
                "cpu_affinity": _try(
                    lambda: _bits(
                        pynvml.nvmlDeviceGetCpuAffinity(
                            h, max(1, ((os.cpu_count() or 1) + 63) // 64)
                        )
                    )
                ),
                "is_mig_mode": _try(lambda: pynvml.nvmlDeviceGetMigMode(h)),
            }
            devices.append(dev)
        out["devices"] = devices
    finally:
        pynvml.nvmlShutdown()
    return out


def torch_facts() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda}
    out["is_available"] = torch.cuda.is_available()
    out["device_count"] = torch.cuda.device_count()
    devices = []
    for i in range(out["device_count"]):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": _try(lambda: p.name),
                "pci_domain_id": _try(lambda: p.pci_domain_id),
                "pci_bus_id": _try(lambda: p.pci_bus_id),
                "pci_device_id": _try(lambda: p.pci_device_id),
                "uuid_str": _try(lambda: str(p.uuid)),
                "uuid_type": type(getattr(p, "uuid", None)).__name__,
            }
        )
    out["devices"] = devices
    return out


def identify_matrix(uuid: str | None) -> dict[str, Any]:
    from sglang.srt.placement.devices import NvmlRuntime, identify_accelerators
    from sglang.srt.placement.topology import read_topology

    topo = read_topology("/sys")
    runtimes: dict[str, Any] = {"none": None}
    out: dict[str, Any] = {}
    try:
        runtimes["nvml"] = NvmlRuntime()
    except BaseException as exc:
        out["runtime_nvml"] = f"{type(exc).__name__}: {exc}"
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    envs: dict[str, dict[str, str]] = {
        "unset": base,
        "0": {**base, "CUDA_VISIBLE_DEVICES": "0"},
    }
    if uuid:
        envs["uuid"] = {**base, "CUDA_VISIBLE_DEVICES": uuid}
        envs["uuid_prefix"] = {**base, "CUDA_VISIBLE_DEVICES": uuid[:12]}
    for env_name, env in envs.items():
        for rt_name, runtime in runtimes.items():
            key = f"cvd={env_name}/runtime={rt_name}"
            try:
                accs = identify_accelerators(
                    device="cuda", topology=topo, logical_ids=[0], env=env, runtime=runtime
                )
                out[key] = [
                    {
                        "gpu_id": a.index,
                        "physical_id": a.physical_id,
                        "pci": a.pci,
                        "source": a.source,
                    }
                    for a in accs
                ]
            except BaseException as exc:
                out[key] = f"{type(exc).__name__}: {exc}"
    nvml = runtimes.get("nvml")
    if nvml is not None:
        nvml.close()
    return out


def _try(fn: Callable[[], Any]) -> Any:
    try:
        value = fn()
        return value.decode() if isinstance(value, bytes) else value
    except BaseException as exc:
        return f"<{type(exc).__name__}: {exc}>"


def _bits(words: Any) -> list[int]:
    return [
        w * 64 + b
        for w, word in enumerate(list(words))
        for b in range(64)
        if int(word) >> b & 1
    ]


SECTIONS = (
    "host",
    "sysfs_gpus",
    "topology",
    "nvml",
    "torch",
    "identify",
)


def run_checks(deadline: float) -> None:
    section("host", env_facts)
    section("sysfs_gpus", sysfs_gpus)
    section("topology", topology_summary)
    nvml = section("nvml", nvml_facts)
    torch_info = section("torch", torch_facts)
    uuid = None
    if isinstance(nvml, dict) and nvml.get("devices"):
        uuid = nvml["devices"][0].get("uuid")
    elif isinstance(torch_info, dict) and torch_info.get("devices"):
        text = str(torch_info["devices"][0].get("uuid_str"))
        uuid = text if text.startswith("GPU-") else f"GPU-{text}"
    if not (isinstance(uuid, str) and uuid.startswith("GPU-")):
        uuid = None
    section("uuid_used", lambda: uuid)
    section("identify", lambda: identify_matrix(uuid))


def supervise(deadline: float) -> int:
    """Run the checks in a child process group and kill it at the deadline: a hung driver call cannot hang us."""
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--deadline",
            str(deadline - 3),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the child and any process it started
        out, err = proc.communicate()
    result: dict[str, Any] = {"sections": {}}
    for raw in out.decode(errors="replace").splitlines():
        try:
            line = json.loads(raw)
            result[line["section"]] = line["value"]
            result["sections"][
                line["section"]
            ] = f"{line['status']} in {line['seconds']} s"
        except (ValueError, KeyError, TypeError):
            result.setdefault("stray_output", []).append(raw[-500:])
    missing = [name for name in SECTIONS if name not in result["sections"]]
    if missing:
        result["missing_sections"] = missing
    if timed_out:
        result["watchdog"] = (
            f"killed the checks after {deadline} s; the first missing section hung"
        )
    result["child_rc"] = proc.returncode
    result["child_stderr_tail"] = err.decode(errors="replace")[-2000:]
    result["elapsed_s"] = round(time.monotonic() - START, 2)
    sys.stdout.write(json.dumps(result, indent=1, sort_keys=True, default=repr) + "\n")
    return 3 if timed_out else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--deadline",
        type=float,
        default=55.0,
        help="seconds before the checks are killed",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_checks(args.deadline)
    else:
        sys.exit(supervise(args.deadline))


if __name__ == "__main__":
    main()
