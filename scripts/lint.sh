#!/usr/bin/env bash
# ruff (pyproject [tool.ruff]) on the whole tree, vulture (dead code in the three packages), then mypy: strict
# on middleware/, the default checks on learner/ and adapters/ (pyproject [tool.mypy]). Exits non-zero on any
# finding. Uses the project's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
.venv/bin/ruff check --no-cache .
# Dead names in the packages; tests, bench and examples count as users (a public function they call is alive).
# What only a framework or decoder reads is named, with why, in scripts/vulture_whitelist.py.
if [ -x .venv/bin/vulture ]; then
  dead=$(.venv/bin/vulture middleware learner adapters tests bench examples scripts/vulture_whitelist.py \
    --min-confidence 60 | grep -E '^(middleware|learner|adapters)/' || true)
  if [ -n "$dead" ]; then
    printf '%s\n' "$dead" "vulture: delete the dead code, or name it with why in scripts/vulture_whitelist.py" >&2
    exit 1
  fi
elif [ "${CI:-}" = true ]; then
  echo "vulture missing from .venv: pip install -e '.[dev]'" >&2
  exit 1
else
  echo "lint: vulture not installed in .venv (pip install -e '.[dev]'), dead-code check skipped" >&2
fi
# mypy cannot follow the editable install's package-dir mapping (steptap.middleware -> middleware/): it
# checks a tree of links that has the installed layout, run from there; paths are mapped back on output.
links=$(mktemp -d)
trap 'rm -rf "$links"' EXIT
mkdir "$links/steptap"
for pkg in middleware learner adapters; do ln -s "$root/$pkg" "$links/steptap/$pkg"; done
cd "$links"
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "${MYPY_CACHE_DIR:-$root/.venv/mypy-cache}" \
  --python-executable "$root/.venv/bin/python" -p steptap.middleware -p steptap.learner -p steptap.adapters \
  | sed 's#^steptap/##'
