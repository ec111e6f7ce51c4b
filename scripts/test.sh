#!/usr/bin/env bash
# Sets up (scripts/setup.sh: the pinned sglang 0.5.23 with this working tree's overlay) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export SGLANG_PRISTINE_DIR="$PWD/.venv/pristine"
exec .venv/bin/python -m pytest tests "$@"
