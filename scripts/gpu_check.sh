#!/usr/bin/env bash
# The whole loop on one GPU with the verl engine: CUDA vLLM + the capture proxy + `steptap learn --engine verl`
# (one FSDP2 TrainingWorker on the GPU, verl's CUDA platform, NCCL) + the digits agent population, with a small
# real model; then it prints what it checked, one line each, and exits non-zero if any check failed.
#
#   bash scripts/gpu_check.sh --model /path/to/Qwen2.5-0.5B-Instruct [--updates 8] [--out DIR] [--skip-setup]
#
# Needs: an NVIDIA GPU (nvidia-smi), a local HF model directory with untied embeddings or not (full-weight
# swaps of tied models are refused by `steptap up`; pass --learn-args to change settings), the project venv
# (scripts/setup.sh builds it, and the CUDA vLLM venv, the first time).
#
# Checks: the GPU is visible to torch and vLLM; the learner used the verl engine on CUDA (not the CPU shims);
# every update was published (policy versions 1..N on the proxy); later batches were sampled by newer weights;
# the mean reward rose; nothing was left running.
#
# Status: written without a GPU at hand; not yet run by the project. Weights go to vLLM through the disk
# (HF safetensors directory + /admin/weights), as on CPU; streaming them over NCCL (verl's checkpoint engine /
# vLLM's weight-transfer routes) is not wired yet.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=""
UPDATES=8
OUT=""
SKIP_SETUP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --updates) UPDATES=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --skip-setup) SKIP_SETUP=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$MODEL" ] || { echo "gpu_check.sh: --model DIR is required (a local HF model directory)" >&2; exit 2; }
OUT=${OUT:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
failed=0
check() {  # check NAME COMMAND...: prints PASS/FAIL NAME
  if "${@:2}" >/dev/null 2>&1; then echo "PASS  $1"; else echo "FAIL  $1"; failed=1; fi
}

check "nvidia-smi sees a GPU" nvidia-smi -L
[ "$SKIP_SETUP" = 1 ] || bash scripts/setup.sh
check "torch in the project venv sees CUDA" .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"
check "verl version in range" .venv/bin/python -c "from steptap.learner.engines.verl_engine import check_verl_version as c; c()"

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/steptap up --workdir "$OUT" --task digits --model "$MODEL" --port 0 --engine verl \
  --max-updates "$UPDATES" --no-view --status-every 30 \
  --config examples/digits/learner-gpu.toml \
  --vllm-args="-- --gpu-memory-utilization ${GPU_SHARE:-0.4}" \
  --learn-args="--workers 1 --truncation-mode drop --push-every 1 --checkpoint-every 4" \
  --agents ".venv/bin/python examples/digits/agents.py --concurrency 16 --round-groups 8" || failed=1

.venv/bin/python - "$OUT" "$UPDATES" <<'EOF' || failed=1
import json, sys
from pathlib import Path
out, n = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()] if (out / "metrics.jsonl").exists() else []
log = (out / "logs" / "learn.log").read_text(errors="replace") if (out / "logs" / "learn.log").exists() else ""
ok = True
def check(name, cond):
    global ok
    print(("PASS  " if cond else "FAIL  ") + name)
    ok &= bool(cond)
check(f"{n} updates logged", len(rows) == n)
check("the learner ran the verl engine on CUDA", " engine on cuda: 1 workers ready" in log)
check("every update published (policy versions 1..N)", [r.get("policy_version") for r in rows] == list(range(1, n + 1)))
check("later batches sampled by newer weights", len(rows) > 1 and rows[-1].get("behaviour_version", 0) > rows[0].get("behaviour_version", 0))
check("grad norm, clip fraction, entropy, KL to behaviour logged", rows and all(k in rows[-1] for k in ("grad_norm", "pg_clipfrac", "entropy", "ppo_kl")))
curve = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
check(f"mean reward rose ({curve[0] if curve else None} -> {curve[-1] if curve else None})", len(curve) > 2 and curve[-1] > curve[0])
sys.exit(0 if ok else 1)
EOF
check "no Ray or vLLM process left" bash -c '! pgrep -f "ray::SteptapTrainingWorker|vllm.entrypoints" >/dev/null'
echo "gpu_check: $([ $failed = 0 ] && echo all checks passed || echo SOME CHECKS FAILED); logs in $OUT"
exit $failed
