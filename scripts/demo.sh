#!/usr/bin/env bash
# The demo: set up on a fresh machine, then watch a policy learn from its own agents' traffic.
#
#   bash scripts/demo.sh                    # CPU: the offline tiny model, about 10 minutes of learning at most
#   bash scripts/demo.sh --model Qwen/Qwen2.5-0.5B-Instruct --config examples/digits/learner-gpu.toml  # GPU
#
# It runs `steptap up` (vLLM + the capture proxy + the learner, supervised together) with the digits agent
# population (examples/digits): agents answer short questions and earn the fraction of their response tokens that
# are digits. The learner trains on their trajectories with GRPO and hot-swaps the weights into
# vLLM after every update, while the agents keep running. It stops by itself when the mean reward of the last three
# updates reaches --target, or after --minutes of learning (set-up not counted), then writes
# runs/demo-<timestamp>/curves.png (reward and loss per update) and summary.json (task, start and end reward,
# minutes of learning, set-up time, updates, policy versions).
#
# Options: --minutes M (10)  --target R (0.85)  --model DIR_OR_NAME (default: tiny model built offline)
#          --config FILE (examples/digits/learner.toml)  --concurrency N (16)  --round G (8; 0: sample
#          continuously, overlapping with training)  --skip-setup  --out DIR
set -euo pipefail
cd "$(dirname "$0")/.."

MINUTES=10
TARGET=0.85
MODEL=""
CONFIG=examples/digits/learner.toml
CONCURRENCY=16
ROUND=8         # groups per sampling round = the learner's batch_groups: each batch is sampled by the newest policy
SKIP_SETUP=0
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) MINUTES=$2; shift 2 ;;
    --target) TARGET=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --round) ROUND=$2; shift 2 ;;
    --skip-setup) SKIP_SETUP=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-runs/demo-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"

t0=$(date +%s)
if [ "$SKIP_SETUP" = 0 ]; then
  echo "== set-up: bash scripts/setup.sh --demo (project venv + vLLM venv; minutes the first time, seconds after)"
  bash scripts/setup.sh --demo
fi
setup_s=$(( $(date +%s) - t0 ))
echo "== set-up took ${setup_s} s"

# Two cores are shared by vLLM, the proxy, the learner and the agents: keep every BLAS pool to one thread.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

DURATION=$(awk -v m="$MINUTES" 'BEGIN { if (m + 0 <= 0) exit 1; printf "%d", m * 60 }') ||
  { echo "demo.sh: --minutes must be a positive number, got '$MINUTES'" >&2; exit 2; }
up_args=(--workdir "$OUT" --task digits --config "$CONFIG" --port 0
         --duration "$DURATION" --stop-at-reward "$TARGET"
         --agents ".venv/bin/python examples/digits/agents.py --concurrency $CONCURRENCY --round-groups $ROUND")
[ -n "$MODEL" ] && up_args+=(--model "$MODEL")
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # vLLM and the learner share the GPU: vLLM takes only part of its memory (its default is 90%).
  up_args+=(--vllm-args="-- --gpu-memory-utilization ${GPU_SHARE:-0.4}")
fi
[ -t 1 ] || up_args+=(--no-view --status-every 20)

echo "== steptap up ${up_args[*]}"
rc=0
.venv/bin/steptap up "${up_args[@]}" || rc=$?
if [ "$rc" != 0 ]; then
  echo "demo.sh: steptap up failed (exit $rc); logs in $OUT/logs" >&2
  exit "$rc"
fi

echo "== plotting"
.venv/bin/steptap plot "$OUT/metrics.jsonl" -o "$OUT/curves.png"

.venv/bin/python - "$OUT" "$setup_s" <<'EOF'
import json, sys
from pathlib import Path
out, setup_s = Path(sys.argv[1]).resolve(), float(sys.argv[2])
up = json.loads((out / "summary.json").read_text())
summary = {
    "task": "digits: reward = fraction of response tokens that are digits",
    "model": up["model"],
    "start_reward": up["start_reward"],
    "end_reward": up["end_reward"],
    "reward_rise": None if up["start_reward"] is None or up["end_reward"] is None
                   else round(up["end_reward"] - up["start_reward"], 4),
    "learning_minutes": up["learning_minutes"],
    "setup_s": setup_s,
    "startup_s": up["startup_s"],
    "updates": up["updates"],
    "policy_versions": up["policy_versions"],
    "reward_by_policy_version": up["reward_by_policy_version"],
    "stop_reason": up["stop_reason"],
    "health": up.get("health", []),  # what the run's health named at the end (docs/health.md): [] when healthy
    "curves": str(out / "curves.png"),
    "metrics": up["metrics"],
}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
echo "== done: $OUT/summary.json and $OUT/curves.png"
