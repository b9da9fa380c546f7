#!/usr/bin/env bash
# The whole loop on one GPU with the verl engine: CUDA vLLM + the capture proxy + `steptap learn --engine verl`
# (one FSDP2 TrainingWorker on the GPU, verl's CUDA platform, NCCL) + the digits agent population, with a small
# real model; then it prints what it checked, one line each, and exits non-zero if any check failed.
#
#   bash scripts/gpu_check.sh --model /path/to/Qwen2.5-0.5B-Instruct [--updates 8] [--out DIR] [--skip-setup]
#       [--gsm8k-model Qwen/Qwen3-4B-Instruct-2507] [--gsm8k-data DIR] [--skip-gsm8k | --gsm8k-only]
#
# Needs: an NVIDIA GPU (nvidia-smi), a local HF model directory with untied embeddings or not (full-weight
# swaps of tied models are refused by `steptap up`; pass --learn-args to change settings), the project venv
# (scripts/setup.sh builds it, and the CUDA vLLM venv, the first time).
#
# Checks: the GPU is visible to torch and vLLM; the learner used the verl engine on CUDA (not the CPU shims);
# every update was published (policy versions 1..N on the proxy); later batches were sampled by newer weights;
# the mean reward rose; nothing was left running.
#
# Then the same loop again with `weight_sync = "collective"` (learner/transfer.py: the weights broadcast into
# vLLM's workers through its weight-transfer routes and steptap's engine, no directory written). On one GPU the
# verl driver's published tensors are its CPU copy, so that run goes over gloo into the CUDA vLLM; NCCL refuses
# two ranks on one device ("Duplicate GPU detected"), so the NCCL check needs a second GPU: with two or more,
# a last step starts vLLM on GPU 0, sends a perturbed model from GPU 1 over NCCL through the proxy, and checks
# vLLM's logprobs follow the sent model's. With one GPU it prints that NCCL was not exercised.
#
# Last, the GSM8K + calculator recipe (examples/gsm8k_tool) shortened to 20 updates of 8 prompts x 5 answers:
# Qwen3-4B-Instruct-2507 (--gsm8k-model; a hub name is downloaded once) with LoRA on the verl engine, vLLM and
# the learner sharing the GPU, GSM8K converted by make_data.py --hub (downloaded once; --gsm8k-data DIR: an
# existing train/test.parquet), held-out accuracy on 200 test problems at versions 0, 5, 10, 15 (20 when the
# evaluation finishes before the stack stops). It prints training reward by version and the held-out accuracy,
# and checks 20 updates, every adapter published, the calculator called, both evaluations; a rise is printed,
# not asserted (20 small updates of a model that already solves most problems are within the noise).
# Expected time: about 20-30 minutes on one H100 (an estimate: model download, vLLM start and Ray start a few
# minutes, then ~40-60 s per update); not measured yet.
#
# Without a GPU the script stops at once with exit status 3 (nothing else runs).
#
# Status: written without a GPU at hand; NOT RUN by the project yet (neither the disk loop, nor the collective
# loop, nor the NCCL step, nor the GSM8K run). On CPU the same collective code path runs over gloo in
# tests/integration/test_weight_transfer.py.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=""
UPDATES=8
OUT=""
SKIP_SETUP=0
GSM8K_MODEL=${STEPTAP_GSM8K_MODEL:-Qwen/Qwen3-4B-Instruct-2507}
GSM8K_DATA=""
GSM8K=1   # 0: skip it; 2: only it
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --updates) UPDATES=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --skip-setup) SKIP_SETUP=1; shift ;;
    --gsm8k-model) GSM8K_MODEL=$2; shift 2 ;;
    --gsm8k-data) GSM8K_DATA=$2; shift 2 ;;
    --skip-gsm8k) GSM8K=0; shift ;;
    --gsm8k-only) GSM8K=2; shift ;;
    -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$MODEL" ] || [ "$GSM8K" = 2 ] || { echo "gpu_check.sh: --model DIR is required (a local HF model directory)" >&2; exit 2; }
if ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  echo "gpu_check.sh: FAIL: NO GPU: nvidia-smi lists none (or is missing); nothing was checked" >&2
  exit 3
fi
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

export TOKENIZERS_PARALLELISM=false
run_loop() {  # run_loop WORKDIR [EXTRA LEARNER FLAGS]: the digits loop on the verl engine, N updates
  HF_HUB_OFFLINE=1 .venv/bin/steptap up --workdir "$1" --task digits --model "$MODEL" --port 0 --engine verl \
    --max-updates "$UPDATES" --no-view --status-every 30 \
    --config examples/digits/learner-gpu.toml \
    --vllm-args="-- --gpu-memory-utilization ${GPU_SHARE:-0.4}" \
    --learn-args="--workers 1 --truncation-mode drop --push-every 1 --checkpoint-every 4 ${2:-}" \
    --agents ".venv/bin/python examples/digits/agents.py --concurrency 16 --round-groups 8" || failed=1
}
if [ "$GSM8K" != 2 ]; then
run_loop "$OUT"

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

# --- the same loop, weights by collective transfer ---------------------------------------------------------------
echo "--- weight_sync = collective (gloo from the verl driver's CPU copy on one GPU) ---"
run_loop "$OUT/collective" "--weight-sync collective"
.venv/bin/python - "$OUT/collective" "$UPDATES" <<'EOF' || failed=1
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
check(f"collective: {n} updates logged", len(rows) == n)
check("collective: every version went by transfer", log.count("by collective transfer") == n)
check("collective: every update published (policy versions 1..N)", [r.get("policy_version") for r in rows] == list(range(1, n + 1)))
weights = out / "steptap-weights"
check("collective: no weights directory written", not (weights.exists() and any(weights.glob("v*"))))
curve = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
check(f"collective: mean reward rose ({curve[0] if curve else None} -> {curve[-1] if curve else None})", len(curve) > 2 and curve[-1] > curve[0])
sys.exit(0 if ok else 1)
EOF
check "collective: no Ray or vLLM process left" bash -c '! pgrep -f "ray::SteptapTrainingWorker|vllm.entrypoints" >/dev/null'

# --- NCCL: the learner's tensors on another GPU than vLLM's ------------------------------------------------------
if [ "$(nvidia-smi -L | grep -c GPU)" -ge 2 ]; then
  echo "--- NCCL transfer: vLLM on GPU 0, the learner's tensors on GPU 1 ---"
  .venv/bin/python - "$MODEL" "$OUT/nccl" <<'EOF' || failed=1
import json, os, subprocess, sys, time, urllib.request
from pathlib import Path
model_dir, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
from steptap.middleware.launch.vllm_server import VLLMServer
srv = VLLMServer(model_dir, port=18731, served_model_name="m", log_path=out / "vllm.log", gpu=True,
                 extra_args=["--gpu-memory-utilization", os.environ.get("GPU_SHARE", "0.4")],
                 env={"CUDA_VISIBLE_DEVICES": "0"})
srv.start()
proxy = subprocess.Popen([".venv/bin/steptap", "serve", "--backend", srv.url, "--port", "18732", "--log", str(out / "log")],
                         env={**os.environ, "STEPTAP_CONTROL_TOKEN": "gpu-check"})
ok = True
def check(name, cond):
    global ok
    print(("PASS  " if cond else "FAIL  ") + name)
    ok &= bool(cond)
try:
    srv.wait_healthy(900)
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # before torch initialises CUDA: the learner's GPU
    import torch
    from transformers import AutoModelForCausalLM
    from steptap.learner.transfer import named_weights, send_collective
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, device="cuda") * 0.02)
    for _ in range(60):
        try:
            urllib.request.urlopen("http://127.0.0.1:18732/health", timeout=5)
            break
        except OSError:
            time.sleep(2)
    weights = named_weights(model)
    check("nccl: the learner's tensors are on CUDA (backend nccl)", all(t.is_cuda for _, t in weights))
    t0 = time.perf_counter()
    v = send_collective(weights, "http://127.0.0.1:18732", "gpu-check", version=1)
    print(f"      NCCL swap of {sum(t.numel() for _, t in weights)} parameters: {time.perf_counter() - t0:.2f} s")
    check("nccl: the proxy serves version 1", v == 1)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "logprobs": True, "temperature": 1.0, "return_token_ids": True}
    req = urllib.request.Request("http://127.0.0.1:18732/v1/chat/completions", method="POST",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = json.loads(urllib.request.urlopen(req, timeout=120).read())
    ch = r["choices"][0]
    got = [c["logprob"] for c in ch["logprobs"]["content"]]
    ids, P = r["prompt_token_ids"] + ch["token_ids"], len(r["prompt_token_ids"])
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids], device="cuda")).logits[0].float(), -1)
    ref = [lp[P - 1 + i, t].item() for i, t in enumerate(ch["token_ids"])]
    gap = max(abs(a - b) for a, b in zip(got, ref))
    # vLLM on GPU runs its own kernels and dtype: a loose bound, printed, not a derived tolerance.
    check(f"nccl: vLLM's logprobs follow the sent model (max gap {gap:.4f} < 0.05)", gap < 0.05)
finally:
    proxy.terminate()
    proxy.wait(30)
    srv.stop()
sys.exit(0 if ok else 1)
EOF
else
  echo "SKIP  NCCL transfer: one GPU (NCCL refuses two ranks on one device); the collective run above used gloo"
fi
fi  # the digits loops

# --- GSM8K + calculator (examples/gsm8k_tool), 20 updates --------------------------------------------------------
if [ "$GSM8K" != 0 ]; then
  echo "--- GSM8K + calculator: $GSM8K_MODEL, LoRA on the verl engine, 20 updates of 8 prompts x 5 ---"
  G="$OUT/gsm8k"
  if [ -z "$GSM8K_DATA" ]; then  # the hub's openai/gsm8k, downloaded once into the Hugging Face cache
    GSM8K_DATA="$G-data"
    .venv/bin/python examples/gsm8k_tool/make_data.py --hub --out "$GSM8K_DATA" || failed=1
  fi
  .venv/bin/python examples/gsm8k_tool/launch.py --model "$GSM8K_MODEL" \
    --data "$GSM8K_DATA" --replicas 1 --gpu-share "${GPU_SHARE:-0.45}" --batch-groups 8 --updates 20 \
    --epochs 1 --rows 400 --eval-rows 200 --eval-every 5 \
    -- --workdir "$G" --no-view --status-every 30 || failed=1
  .venv/bin/python examples/gsm8k_tool/curve.py "$G/metrics.jsonl" || true
  .venv/bin/python - "$G" <<'EOF' || failed=1
import sys
from pathlib import Path
sys.path.insert(0, "examples/gsm8k_tool")
from curve import by_version
from steptap.learner.plot import read_rows
from steptap.middleware.log.offline import LogReader
out = Path(sys.argv[1])
rows = read_rows(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
updates = [r for r in rows if "update" in r]
log = (out / "logs" / "learn.log").read_text(errors="replace") if (out / "logs" / "learn.log").exists() else ""
ok = True
def check(name, cond):
    global ok
    print(("PASS  " if cond else "FAIL  ") + name)
    ok &= bool(cond)
check("gsm8k: 20 updates logged", len(updates) == 20)
check("gsm8k: the learner ran the verl engine on CUDA", " engine on cuda: 1 workers ready" in log)
check("gsm8k: every update published (policy versions 1..20)", [r.get("policy_version") for r in updates] == list(range(1, 21)))
trajs = [t for t in LogReader(str(out / "trajectories")).trajectories() if t.mode == "train"] if (out / "trajectories").exists() else []
calls = sum(1 for t in trajs for s in t.steps if s.response and s.response.get("tool_calls"))
check(f"gsm8k: the model called the calculator ({calls} calls in {len(trajs)} episodes)", calls > 0)
evals = {v: c["accuracy"] for v, c in by_version(rows).items() if "accuracy" in c}
check(f"gsm8k: held-out accuracy at version 0 and after >= 15 updates ({evals})", 0 in evals and max(evals) >= 15)
if evals:
    last = max(evals)
    print(f"      held-out accuracy (200 GSM8K test problems, T=0): {evals.get(0)} at version 0, {evals[last]} at version {last}")
sys.exit(0 if ok else 1)
EOF
  check "gsm8k: no Ray or vLLM process left" bash -c '! pgrep -f "ray::SteptapTrainingWorker|vllm.entrypoints" >/dev/null'
fi
echo "gpu_check: $([ $failed = 0 ] && echo all checks passed || echo SOME CHECKS FAILED); logs in $OUT"
exit $failed
