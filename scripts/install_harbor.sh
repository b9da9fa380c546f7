#!/usr/bin/env bash
# Builds Harbor's own virtualenv in the user cache, for the tests only: steptap never imports Harbor (it needs
# Python >= 3.12, steptap runs on 3.11). The tests run tests/harbor_check.py in it to read
# `steptap export --format rollout-detail` with Harbor's own pydantic models and to lint the built-in tasks
# (examples/tasks) with Harbor's linter.
#   ~/.cache/steptap/harbor   a venv with Harbor from PyPI (HARBOR_SPEC)
# The interpreter: $HARBOR_PYTHON, else python3.13 or python3.12 on PATH, else one of pyenv's 3.12+.
# Idempotent: a stamp of the spec skips the work when nothing changed. Prints a few lines; pip's output goes to
# harbor-install.log beside the venv.
set -euo pipefail
HARBOR_SPEC='harbor==0.25.*'
root=${XDG_CACHE_HOME:-$HOME/.cache}/steptap
venv=$root/harbor
log=$root/harbor-install.log
say() { echo "[harbor] $*"; }
mkdir -p "$root"
stamp=$(printf '%s\n' "$HARBOR_SPEC" | sha256sum | cut -c1-16)
ready() { [ "$(cat "$venv/.steptap-stamp" 2>/dev/null)" = "$stamp" ]; }
if ready; then
  say "Harbor's virtualenv is up to date ($venv)"
  exit 0
fi

find_python() {
  local c
  for c in ${HARBOR_PYTHON:-} python3.13 python3.12 "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null
    then
      command -v "$c"
      return 0
    fi
  done
  return 1
}
py=$(find_python) || { say "no Python >= 3.12 found (set HARBOR_PYTHON): the Harbor checks will fail under CI"; exit 1; }

exec 9>"$root/.harbor.lock"
flock 9  # one build at a time; a second caller finds it done
if ready; then
  say "Harbor's virtualenv is up to date ($venv)"
  exit 0
fi
say "building $venv with $HARBOR_SPEC on $("$py" --version) (minutes the first time; log: $log)"
echo "=== $(date -u '+%Y-%m-%d %H:%M:%S') scripts/install_harbor.sh" >>"$log"
rm -rf "$venv"  # the stamp is written last: a partial build never looks complete
if ! { "$py" -m venv "$venv" && "$venv/bin/python" -m pip install "$HARBOR_SPEC"; } >>"$log" 2>&1; then
  say "failed; the end of $log:"
  tail -n 30 "$log"
  exit 1
fi
echo "$stamp" >"$venv/.steptap-stamp"
say "done: $("$venv/bin/python" -m pip show harbor 2>/dev/null | sed -n 's/^Version: /harbor /p')"
