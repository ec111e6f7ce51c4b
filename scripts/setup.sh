#!/usr/bin/env bash
# Builds the environment the project runs and is tested in, on a fresh Debian machine: numactl, a
# CPython 3.11 virtual environment in .venv holding the pinned sglang 0.5.23 and what its modules import
# (requirements/sglang-0.5.23-cpu.txt), a pristine copy of that sglang package, and the installed package
# rebuilt from the pristine copy with this working tree's overlay (scripts/overlay.py) on every run, so
# what runs is always python/ as it is now. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v numactl >/dev/null 2>&1 || ! ldconfig -p | grep -q 'libnuma\.so\.1'; then
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq numactl libnuma1 >/dev/null
fi

python=${PYTHON:-python3.11}
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    echo "setup: sglang 0.5.23 is a CPython 3.11 wheel; $python is not Python 3.11: set PYTHON=/path/to/python3.11" >&2
    exit 2
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv

requirements=requirements/sglang-0.5.23-cpu.txt
stamp=.venv/.installed-$(sha256sum "$requirements" | cut -c1-16)
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -f "$stamp" ]; then
    # The overlaid package goes first: pip would keep it as the installed 0.5.23.
    rm -rf "$site/sglang" "$site"/sglang-*.dist-info
    # The list is complete and pinned, so nothing outside it is pulled in.
    .venv/bin/python -m pip install -qq --no-deps -r "$requirements"
    rm -rf .venv/pristine
    mkdir -p .venv/pristine
    cp -a "$site/sglang" .venv/pristine/sglang
    rm -f .venv/.installed-*
    touch "$stamp"
fi

lint=requirements/lint.txt
lint_stamp=.venv/.lint-$(sha256sum "$lint" | cut -c1-16)
if [ ! -f "$lint_stamp" ]; then
    .venv/bin/python -m pip install -qq --no-deps -r "$lint"
    rm -f .venv/.lint-*
    touch "$lint_stamp"
fi

# Hard links make the copy instant; the overlay replaces files (write, then rename), never writes
# through a link, so the pristine copy stays pristine.
rm -rf "$site/sglang"
cp -al .venv/pristine/sglang "$site/sglang"
.venv/bin/python scripts/overlay.py "$site/sglang" >/dev/null
