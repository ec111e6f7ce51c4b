"""Run a command on a host this machine is not: a fake sysfs tree (``fakesys``) mounted
over ``/sys/devices/system/node``, ``/sys/devices/system/cpu`` and
``/sys/bus/pci/devices`` in a private mount namespace, and a stand-in NVML
(``fakes/pynvml.py``) listing the host's GPUs. The code under test runs unchanged:
libnuma, numactl, lscpu and sglang read the fake tree through the real paths, while the
kernel still binds only this machine's CPUs and memory, so fake hosts name this machine's
CPUs (0 and 1 on the 2-CPU CI host) where a rank is really bound.

Needs root (``unshare --mount``); ``require_root`` skips, saying so, elsewhere.
``PLACEMENT_TESTS_PLATFORM=cuda`` (see ``harness/sglang_light``) makes numa_utils see a
CUDA platform with the GPUs the stand-in NVML shows under CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

import fakesys
import pytest
import rank_probe

TESTS = Path(__file__).resolve().parent
FAKES = TESTS / "fakes"
LAUNCHER = TESTS / "harness" / "launch_ranks.py"
# The directories a fake tree replaces, relative to both roots.
MOUNTED = ("devices/system/node", "devices/system/cpu", "bus/pci/devices")
# Mount each fake directory over the real one, then exec the command.
_MOUNT = (
    "tree=$1; shift; for d in devices/system/node devices/system/cpu bus/pci/devices; "
    'do mount --bind "$tree/$d" "/sys/$d" || exit 97; done; exec "$@"'
)


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("fake hosts are mounted in a private mount namespace: run as root")


def gpu_env(gpus: Sequence[str], **extra: str) -> dict[str, str]:
    """What makes a process see ``gpus`` (PCI addresses, NVML order) on a CUDA platform."""
    return {
        "FAKE_NVML_GPUS": ",".join(gpus),
        "PLACEMENT_TESTS_PLATFORM": "cuda",
        **extra,
    }


def run(
    spec,
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    timeout: float = 300,
    input: Optional[str] = None,
) -> subprocess.CompletedProcess:
    """``argv`` inside a mount namespace whose sysfs is ``spec``'s (a fakesys Shape or
    Host); ``env`` is added to this process's environment, and the stand-in NVML goes
    first on PYTHONPATH."""
    require_root()
    with tempfile.TemporaryDirectory(prefix="fakehost-") as root:
        tree = fakesys.write_sysfs(Path(root) / "sys", spec)
        for directory in MOUNTED:
            (tree / directory).mkdir(parents=True, exist_ok=True)
        # A device's entry links into devices/pci*: copied, as the link would point
        # into the real /sys/devices once mounted. A vanished device's entry links
        # to a path nothing is at, in or out of the namespace.
        for link in (tree / "bus/pci/devices").iterdir():
            target = link.resolve()
            link.unlink()
            if target.is_dir():
                shutil.copytree(target, link)
            else:
                link.symlink_to(Path(root) / "vanished" / link.name)
        full = {**os.environ, **(env or {})}
        paths = [str(FAKES), full.get("PYTHONPATH", "")]
        full["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private"]
            + ["sh", "-c", _MOUNT, "sh", str(tree), *argv],
            env=full,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )
    if done.returncode == 97:
        raise RuntimeError(f"mounting the fake sysfs failed: {done.stderr}")
    return done


def python(spec, code: str, *, env=None, timeout: float = 300):
    """Python ``code`` on ``spec``'s host (``run``)."""
    return run(spec, [sys.executable, "-c", code], env=env, timeout=timeout)


def launch(
    spec,
    job: dict,
    *,
    env: Optional[Mapping[str, str]] = None,
    timeout: float = 600,
) -> list[dict]:
    """``job`` (``rank_probe.run_job``: scenarios of ranks spawned as sglang spawns them)
    run by an engine's launching process on ``spec``'s host; one result per scenario,
    each with the tail of the launcher's stderr as ``stderr``."""
    argv = [sys.executable, str(LAUNCHER)]
    done = run(spec, argv, env=env, timeout=timeout, input=json.dumps(job))
    if done.returncode != 0:
        raise AssertionError(
            f"the launcher exited with {done.returncode}:\n{done.stderr[-4000:]}"
        )
    results = rank_probe.parse_results(done.stdout)
    for result in results:
        result["stderr"] = done.stderr[-4000:]
    return results


def path_without_numactl(directory: Path) -> str:
    """A PATH holding every program of this one but numactl (links in ``directory``,
    which is made)."""
    directory.mkdir()
    for entry in os.environ["PATH"].split(os.pathsep):
        if os.path.isdir(entry):
            for program in os.listdir(entry):
                link = directory / program
                if program != "numactl" and not link.exists():
                    link.symlink_to(os.path.join(entry, program))
    return str(directory)
