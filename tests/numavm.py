"""Run one of tests/vm_scripts in a throw-away multi-NUMA VM (../shared/tools/numa-vm) and read its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
NUMA_VM = REPO.parent / "shared" / "tools" / "numa-vm"
# The first use installs the VM's Debian packages; the VM's own --timeout covers only the run.
INSTALL_AND_RUN_TIMEOUT_S = 900


def run_script_in_vm(
    script: str, *script_args: str, vm_args: Sequence[str], vm_timeout_s: int
) -> dict:
    """Boot a VM with ``vm_args``, run ``python script script_args`` there, return its last stdout line as JSON."""
    assert (
        NUMA_VM.is_file()
    ), f"{NUMA_VM} is missing: the VM tests need ../shared/tools/numa-vm"
    proc = subprocess.run(
        [
            str(NUMA_VM),
            *vm_args,
            "--timeout",
            str(vm_timeout_s),
            "--",
            sys.executable,
            script,
            *script_args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=INSTALL_AND_RUN_TIMEOUT_S,
    )
    assert (
        proc.returncode == 0
    ), f"numa-vm exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
