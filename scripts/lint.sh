#!/usr/bin/env bash
# sglang's own linters (black, isort, codespell at the versions and settings of its pre-commit config) on
# every file the overlay writes into a pristine sglang 0.5.23, and on the ported upstream tests; exits
# non-zero on any finding. scripts/setup.sh installs them (requirements/lint.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -al .venv/pristine/sglang "$work/sglang"
"$py" scripts/overlay.py "$work/sglang" >/dev/null
mapfile -t written < <("$py" - "$work/sglang" <<'PY'
import json, sys
from pathlib import Path
package = Path(sys.argv[1])
manifest = json.loads((package / ".placement-overlay.json").read_text())
for rel in sorted(set(manifest["added"]) | set(manifest["replaced"])):
    if rel.endswith(".py"):
        print(package / rel)
PY
)
mapfile -t ported < <(find tests/upstream -name '*.py' ! -name '__init__.py' | sort)
files=("${written[@]}" "${ported[@]}")
status=0
"$py" -m black --check --quiet "${files[@]}" || status=1
"$py" -m isort --check-only --quiet --profile black --known-first-party sglang "${files[@]}" || status=1
"$py" -m codespell -L cann,thi,makro,wil,rouge,PRIS "${files[@]}" || status=1
if [ "$status" -ne 0 ]; then
    echo "lint: sglang's linters report the findings above (fix: black and isort --profile black" \
        "--known-first-party sglang on python/ and tests/upstream/)" >&2
fi
exit "$status"
