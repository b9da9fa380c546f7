#!/usr/bin/env bash
# Rebuilds app/calc.bundle (not part of the image or the agent's copy): fixed authors and dates, so the
# commit and tree hashes tests/test_outputs.py holds never change. Usage: bash environment/make_bundle.sh
set -euo pipefail
out=$(cd "$(dirname "$0")" && pwd)/app/calc.bundle
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export GIT_CONFIG_NOSYSTEM=1 HOME=/nonexistent
n=0
commit() {  # commit MESSAGE: fixed author, committer and dates, so the hashes never change
  n=$((n + 1))
  local d="2024-01-$(printf %02d $n)T12:00:00+00:00"
  GIT_AUTHOR_NAME="Grace Hopper" GIT_AUTHOR_EMAIL=grace@example.com GIT_AUTHOR_DATE=$d \
  GIT_COMMITTER_NAME="Grace Hopper" GIT_COMMITTER_EMAIL=grace@example.com GIT_COMMITTER_DATE=$d \
    git commit -q -a -m "$1"
}
git init -q -b main .
cat > calc.py <<'PY'
"""A tiny calculator."""


def add(a: int, b: int) -> int:
    return a + b


def sub(a: int, b: int) -> int:
    return a - b
PY
cat > test_calc.py <<'PY'
"""Run with `python3 test_calc.py`: exits non-zero when a check fails."""

from calc import add, sub

assert add(2, 3) == 5
assert sub(7, 10) == -3
print("ok")
PY
git add .; commit "Add add and sub"
GIT_COMMITTER_DATE=2024-01-01T12:00:00+00:00 GIT_COMMITTER_NAME="Grace Hopper" GIT_COMMITTER_EMAIL=grace@example.com git tag -a v1.0 -m "v1.0"
cat >> calc.py <<'PY'


def mul(a: int, b: int) -> int:
    return a * b
PY
commit "Add mul"
printf '\nassert mul(4, 5) == 20\nprint("mul ok")\n' >> test_calc.py; sed -i 's/from calc import add, sub/from calc import add, mul, sub/' test_calc.py
commit "Test mul"
printf '# calc\n\nA tiny calculator.\n' > README.md; git add README.md; commit "Add a README"
sed -i 's/    return a - b/    return a - b if a >= b else -(b - a)/' calc.py; commit "Simplify sub"
sed -i 's/    return a - b if a >= b else -(b - a)/    return abs(a - b)/' calc.py; commit "Tidy sub"
printf '\nRun the checks with `python3 test_calc.py`.\n' >> README.md; commit "Document the checks"
cat >> calc.py <<'PY'


def neg(a: int) -> int:
    return -a
PY
commit "Add neg"
git bundle create -q "$out" --all
