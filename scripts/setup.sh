#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian machine: numactl, a virtual environment in .venv,
# the CPU build of torch 2.13.0, the package itself and its ray, test and nvml extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v numactl >/dev/null 2>&1 || ! ldconfig -p | grep -q 'libnuma\.so\.1'; then
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq numactl libnuma1 >/dev/null
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
stamp=.venv/.sglang-placement-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch is pinned to the CPU build; an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q "torch==2.13.0" -e ".[ray,test,nvml]"
    touch "$stamp"
fi
