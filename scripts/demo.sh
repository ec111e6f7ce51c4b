#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then shows and verifies where a small engine's ranks run on this host:
# a CPU-device engine with two tensor-parallel ranks, each on its own half of this process's CPUs
# (SGLANG_CPU_OMP_THREADS_BIND), planned, then started through sglang's own launch paths (each spawn
# inside numa_utils.configure_subprocess, as the engine does; each Ray actor through RayEngine's
# _create_scheduler_actor, on a local Ray cluster) and read back from inside every rank.
# Arguments go to plan and verify: -v also shows upstream's warnings and Ray's notices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
if [ -z "${SGLANG_CPU_OMP_THREADS_BIND:-}" ]; then
    SGLANG_CPU_OMP_THREADS_BIND=$("$py" -c '
import os
cpus = sorted(os.sched_getaffinity(0))
half = max(len(cpus) // 2, 1)
print(",".join(map(str, cpus[:half])) + "|" + ",".join(map(str, cpus[half:] or cpus[:half])))
')
    export SGLANG_CPU_OMP_THREADS_BIND
fi
echo "== plan: SGLANG_CPU_OMP_THREADS_BIND=$SGLANG_CPU_OMP_THREADS_BIND, --device cpu --tp-size 2"
"$py" -m sglang.srt.placement_tools plan --device cpu --tp-size 2 "$@"
echo
echo "== verify through sglang's launch paths (each rank reads its binding back)"
"$py" -m sglang.srt.placement_tools verify --device cpu --tp-size 2 --launcher both "$@"
