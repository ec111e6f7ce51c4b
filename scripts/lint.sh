#!/usr/bin/env bash
# sglang's own linters at the versions and settings of its pre-commit config (black 26.1.0 at
# 88 columns, isort 7.0.0 with profile black and sglang first-party, ruff 0.15.1 with
# F401,F821,UP037, codespell 2.4.1) on the operator tools (python/). The pull requests'
# own lines are checked by tests/test_stack.py. scripts/setup.sh installs the linters
# (requirements/lint.txt). Exits non-zero on any finding.
# Usage: bash scripts/lint.sh [DIR ...]   (default: python/)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
targets=("${@:-python}")
status=0
"$bin/black" --check "${targets[@]}" || status=1
"$bin/isort" --check-only --profile black -p sglang "${targets[@]}" || status=1
"$bin/ruff" check --quiet --no-cache --isolated --select=F401,F821,UP037 "${targets[@]}" || status=1
"$bin/codespell" -L cann,thi,makro,wil,rouge,PRIS,renderD "${targets[@]}" || status=1
if [ "$status" -ne 0 ]; then
    echo "lint: sglang's linters report the findings above (fix: black, isort --profile black" \
        "-p sglang, ruff check --select=F401,F821,UP037 --fix)" >&2
fi
exit "$status"
