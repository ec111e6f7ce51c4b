#!/usr/bin/env bash
# sglang's own linters (black, isort, ruff's F401, codespell at the versions and settings of its
# pre-commit config) on every file the overlay writes into a pristine sglang 0.5.23, and on the ported
# upstream tests; exits non-zero on any finding. An upstream file the overlay rewrites is held to a
# linter only where the pristine file passes it (upstream's own findings are upstream's).
# scripts/setup.sh installs the linters (requirements/lint.txt).
# Usage: bash scripts/lint.sh [REPO_PYTHON_DIR]   (default: python/)
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
repo_python=${1:-python}
pristine=.venv/pristine/sglang
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -al "$pristine" "$work/sglang"
"$py" scripts/overlay.py "$work/sglang" --repo-python "$repo_python" >/dev/null
mapfile -t written < <("$py" - "$work/sglang" <<'PY'
import json, sys
from pathlib import Path
package = Path(sys.argv[1])
manifest = json.loads((package / ".placement-overlay.json").read_text())
for rel in sorted(set(manifest["added"]) | set(manifest["replaced"])):
    if rel.endswith(".py"):
        print(rel)
PY
)
mapfile -t ported < <(find tests/upstream -name '*.py' ! -name '__init__.py' | sort)

black=("$py" -m black --check)
isort=("$py" -m isort --check-only --quiet --profile black -p sglang)
ruff=("$py" -m ruff check --quiet --no-cache --isolated --select=F401)
codespell=("$py" -m codespell_lib -L cann,thi,makro,wil,rouge,PRIS,renderD)

held_to() {  # the written files a linter applies to, then the ported tests
    local -n linter=$1
    for rel in "${written[@]}"; do
        if [ -f "$pristine/$rel" ] && ! "${linter[@]}" "$pristine/$rel" >/dev/null 2>&1; then
            continue
        fi
        echo "$work/sglang/$rel"
    done
    printf '%s\n' "${ported[@]}"
}

status=0
for name in black isort ruff codespell; do
    mapfile -t files < <(held_to "$name")
    declare -n run=$name
    "${run[@]}" "${files[@]}" || status=1
    unset -n run
done
if [ "$status" -ne 0 ]; then
    echo "lint: sglang's linters report the findings above (fix: run black, isort --profile black" \
        "-p sglang and ruff check --select=F401 --fix on python/ and tests/upstream/)" >&2
fi
exit "$status"
