#!/usr/bin/env bash
# ruff (pyproject [tool.ruff]) on the whole tree, then mypy: strict on middleware/, the default checks on
# learner/ and adapters/ (pyproject [tool.mypy]). Exits non-zero on any finding. Uses the project's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
.venv/bin/ruff check --no-cache .
# mypy cannot follow the editable install's package-dir mapping (steptap.middleware -> middleware/): it
# checks a tree of links that has the installed layout, run from there; paths are mapped back on output.
links=$(mktemp -d)
trap 'rm -rf "$links"' EXIT
mkdir "$links/steptap"
for pkg in middleware learner adapters; do ln -s "$root/$pkg" "$links/steptap/$pkg"; done
cd "$links"
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.venv/mypy-cache" \
  --python-executable "$root/.venv/bin/python" -p steptap.middleware -p steptap.learner -p steptap.adapters \
  | sed 's#^steptap/##'
