"""A local Ray cluster for the tools' tests, held by this script in its own process.

    python tests/tools_ray.py GPUS -- CMD ...

runs CMD with RAY_ADDRESS set to a new local cluster and exits with CMD's status.

The cluster has this process's CPUs and GPUS declared GPUs (RayEngine asks one per
scheduler actor, whatever the device); its files live in a private directory, removed
afterwards. Its workers run this interpreter, with this process's environment and
mount namespace (a fake host's, under tests/fakehost.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    gpus, command = int(sys.argv[1]), sys.argv[3:]
    import ray

    # Short: Ray's socket paths under it must stay within 107 characters.
    directory = tempfile.mkdtemp(prefix="tools-ray-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = directory
    for knob in ("RAY_enable_worker_prestart", "RAY_prestart_worker_first_driver"):
        os.environ.setdefault(knob, "0")  # a worker for each actor, no idle ones
    os.environ.pop("RAY_ADDRESS", None)
    try:
        context = ray.init(
            address="local",
            num_cpus=len(os.sched_getaffinity(0)),
            num_gpus=gpus,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
            _temp_dir=os.path.join(directory, "ray"),
        )
        env = {**os.environ, "RAY_ADDRESS": context.address_info["address"]}
        return subprocess.run(command, env=env).returncode
    finally:
        ray.shutdown()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
