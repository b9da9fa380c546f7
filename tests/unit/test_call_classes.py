"""Side calls and branches (sessions/classify.py): each step's class and rule, the main line judged against
its own last call (a side call between two turns leaves it one sequence, logged as deltas), the class counted
in /metrics, restored by a rebuild, old records decoding as main-line steps, and the learner's rows honouring
the session's ``train`` choice. A real log and session manager; the steps are built as capture builds them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import generate_latest

from steptap.learner.rows import build_batch
from steptap.middleware.config import ProxyConfig
from steptap.middleware.delta import full_steps
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Sampling, Step, Trajectory, step_json_decoder, trajectory_json_decoder
from steptap.middleware.sessions.classify import Decision, MainLine, apply, decide, supersede
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.manager import SessionManager
from steptap.middleware.sessions.prefix import first_messages

SYSTEM = {"role": "system", "content": "You are a coding agent."}
TITLE_SYSTEM = {"role": "system", "content": "Write a five-word title for this conversation."}


def step(messages: list[dict[str, Any]], prompt: list[int], response: list[int], model: str = "m",
         started: float = 0.0) -> Step:
    return Step(model=model, served_model="m", request={"model": model, "messages": messages},
                sampling=Sampling(temperature=1.0), prompt_token_ids=prompt, response_token_ids=response,
                response_logprobs=[-0.5] * len(response), finish_reason="stop", started_at=started,
                response={"role": "assistant", "content": f"reply {started}"})


def session_calls() -> list[Step]:
    """A main turn, a title call (another system prompt), the next main turn (extends the first), a compaction
    (the same system prompt, the history replaced by a summary), a turn extending the compacted history."""
    task = {"role": "user", "content": "fix it"}
    first = step([SYSTEM, task], [1, 2, 3], [10, 11], started=1)
    title = step([TITLE_SYSTEM, task], [7, 8], [20], started=2)
    second = step([SYSTEM, task, {"role": "assistant", "content": "reply 1"},
                   {"role": "tool", "content": "x"}],
                  [1, 2, 3, 10, 11, 4], [12], started=3)
    summary = [SYSTEM, {"role": "user", "content": "Summary of the work so far."}]
    compacted = step(summary, [1, 2, 3, 30, 31], [13], started=4)
    after = step([*summary, {"role": "assistant", "content": "reply 4"},
                  {"role": "user", "content": "go on"}],
                 [1, 2, 3, 30, 31, 13, 5], [14], started=5)
    return [first, title, second, compacted, after]


def test_each_rule_decides_its_class() -> None:
    line = MainLine()
    first, title, second, compacted, after = session_calls()
    assert decide(line, first, "first") == decide(MainLine(), first, "history_edited")  # no main line yet
    verdicts = []
    for s, prefix in [(first, "first"), (title, "history_edited"), (second, "extends"),
                      (compacted, "truncated"), (after, "extends")]:
        apply(line, [s], [prefix])  # type: ignore[list-item]
        verdicts.append((s.call_class, s.call_rule, s.branch))
    assert verdicts == [("main", "first", 0), ("side", "other", 0), ("main", "extends", 0),
                        ("branch", "rewrites_history", 1), ("main", "extends", 1)]
    # a configured alias is a side call whatever its prompt; the session's own aliases count too
    assert decide(line, step([SYSTEM], [1], [2], model="haiku"), "extends", ["haiku"]).rule == "side_model"
    own = MainLine(side_models=frozenset({"small"}))
    assert decide(own, step([], [1], [2], model="small"), "first").call_class == "side"
    # the same conversation rendered otherwise stays on the main line, and so does an edit after the first two
    # messages (OpenClaw moves its context message to the end of each request)
    assert decide(line, after, "rerendered").call_class == "main"
    summary = after.request["messages"][1]
    moved = step([SYSTEM, summary, {"role": "user", "content": "go on"},
                  {"role": "assistant", "content": "x"}],
                 [1, 2, 3, 30, 31, 13, 5, 14, 8], [16])
    assert decide(line, moved, "history_edited") == Decision("main", "edited", 1)


def billed(fingerprint: str, text: str) -> dict[str, Any]:
    """A system message as Claude Code sends it (in chat form): its billing line first (vLLM drops it)."""
    billing = f"x-anthropic-billing-header: cc_version=2.1.197.{fingerprint}; cc_entrypoint=cli;"
    return {"role": "system", "content": [{"type": "text", "text": billing}, {"type": "text", "text": text}]}


def test_claude_code_retry_and_compaction_as_it_sends_them() -> None:
    """Measured shapes of Claude Code 2.1.197: the billing line changes with the conversation (left out, as
    vLLM leaves it out); an empty reply retried by appending to the task is an edit; a compaction that opens
    with another first message, under the same system prompt, is a branch."""
    context = {"type": "text", "text": "<system-reminder>context</system-reminder>"}
    task = {"role": "user", "content": [context, {"type": "text", "text": "Say hello."}]}
    line = MainLine()
    first = step([billed("7b2", "You are Claude Code."), task], [1, 2], [3])
    apply(line, [first], ["first"])
    nudge = "[Your previous response had no visible output. Please continue.]"
    retry = {"role": "user", "content": [*task["content"], {"type": "text", "text": nudge}]}
    again = step([billed("7b2", "You are Claude Code."), retry], [1, 2, 4], [5])
    assert decide(line, again, "history_edited") == Decision("main", "edited", 0)
    continued = "This session is being continued from a previous conversation."
    summary = {"role": "user", "content": [context, {"type": "text", "text": continued}]}
    compacted = step([billed("f9d", "You are Claude Code."), summary], [1, 2, 6], [7])
    assert decide(line, compacted, "history_edited") == Decision("branch", "rewrites_history", 1)
    # another system prompt after the billing line is still another: a title call
    title = step([billed("363", "Generate a concise title."), task], [8], [9])
    assert decide(line, title, "history_edited") == Decision("side", "other", 0)
    # a shorter first message, or another role, is not a continuation
    cut = step([billed("7b2", "You are Claude Code."), {"role": "user", "content": [context]}], [1], [2])
    assert decide(line, cut, "history_edited").call_class == "branch"


def test_turns_replaced_after_the_task_open_a_branch_and_turns_kept_do_not() -> None:
    """Codex 0.169.0's compaction (measured) keeps its opening messages and the task and puts the summary in
    place of the turns: a branch. A retry or a sliding window keeps some of the agent's turns: an edit."""
    dev = {"role": "system", "content": "You are Codex."}
    env, task = {"role": "user", "content": "<environment_context>"}, {"role": "user", "content": "do it"}
    function = {"name": "exec_command", "arguments": '{"cmd": "ls"}'}
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                   "function": function}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}
    line = MainLine()
    first = step([dev, env, task], [1, 2, 3], [4])
    apply(line, [first], ["first"])
    checkpoint = {"role": "user", "content": "CONTEXT CHECKPOINT COMPACTION"}
    compaction = step([dev, env, task, call, result, checkpoint], [1, 2, 3, 4, 5, 6], [7])
    compaction.response = {"role": "assistant", "content": "The summary."}
    summary = {"role": "user", "content": "Another language model started this problem: The summary."}
    after = step([dev, env, task, summary], [1, 2, 3, 8], [9])
    branch = Decision("branch", "rewrites_history", 1)
    assert decide(line, after, "truncated", last=(compaction, None)) == branch
    # the same call judged without the main line's last call at hand (a restart): an edit, as before
    assert decide(line, after, "truncated") == Decision("main", "edited", 0)
    # a sliding window keeps the last call's reply; a retry keeps its tool call: edits
    later = step([dev, env, task, call, result], [1, 2, 3, 4, 5], [10])
    later.response = {"role": "assistant", "content": "next"}
    go = {"role": "user", "content": "go"}
    window = step([dev, env, task, {"role": "assistant", "content": "next"}, go], [1, 2, 3, 11], [12])
    assert decide(line, window, "history_edited", last=(later, None)).rule == "edited"
    retry = step([dev, env, task, call, {**result, "content": "a.txt (retry)"}], [1, 2, 3, 13], [14])
    assert decide(line, retry, "history_edited", last=(later, None)).rule == "edited"
    # a last call without any turn of the agent (the first) never counts as replaced
    assert decide(line, window, "history_edited", last=(first, None)).rule == "edited"


def test_a_failed_call_does_not_start_or_move_the_line() -> None:
    line = MainLine()
    failed = step([SYSTEM], [], [])
    failed.status = "failed"
    assert apply(line, [failed], ["first"]) is True and not line.started
    assert failed.call_class == "main"


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[SessionManager]:
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    yield SessionManager(ProxyConfig(log=str(tmp_path / "log"), side_models=["claude-haiku"]), log, Metrics(),
                         None, set())  # type: ignore[arg-type]
    await log.close()


async def test_a_session_records_counts_and_rebuilds_its_lines(manager: SessionManager,
                                                                tmp_path: Path) -> None:
    calls = session_calls()
    session = await manager.open(session_id="s1", train="all", side_models=["small-fast"])
    # the names a call may use without the backend serving them: the proxy's, and the session's for a call
    # that reaches it (its key), never another session's
    assert manager.side_aliases(Identity("path", "s1", session.key)) == ["claude-haiku", "small-fast"]
    assert manager.side_aliases(Identity("path", "s1", None)) == ["claude-haiku"]
    assert manager.side_aliases(Identity("anonymous")) == ["claude-haiku"]
    for s in calls[:2]:
        await manager.record(session, [s])
    # the session's own alias and the proxy's: side calls, and neither moves the main line
    for model in ("small-fast", "claude-haiku"):
        await manager.record(session, [step([SYSTEM], [1, 2, 3, 10, 11, 9], [15], model=model, started=2.5)])
    await manager.record(session, [calls[2]])
    held = session.trajectory.steps
    assert [(s.call_class, s.call_rule, s.prefix) for s in held] == [
        ("main", "first", "first"), ("side", "other", "history_edited"), ("side", "side_model", "extends"),
        ("side", "side_model", "extends"), ("main", "extends", "extends")]
    # the second turn is judged against the first, not the side calls before it: logged as a delta of it
    assert held[4].delta is not None and held[4].delta.base == 0
    # a restart after a side call: the rebuilt session goes on from the main line
    await manager.log.close()  # type: ignore[attr-defined]
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    again = SessionManager(manager.config, log, Metrics(), None, set())
    assert await again.rebuild() == 1
    session = again.sessions["s1"]
    assert session.trajectory.train == "all" and session.trajectory.side_models == ["small-fast"]
    await again.record(session, [step([SYSTEM], [5], [6], model="small-fast", started=3.5)])
    for s in calls[3:]:
        await again.record(session, [s])
    steps = full_steps(session.trajectory.steps)
    assert [(s.call_class, s.branch) for s in steps[5:]] == [("side", 0), ("branch", 1), ("main", 1)]
    assert steps[7].prefix == "extends" and session.trajectory.steps[7].delta is not None
    text = generate_latest(again.metrics.registry).decode()
    assert 'steptap_call_class_steps_total{call_class="branch",rule="rewrites_history"} 1.0' in text
    assert 'steptap_call_class_steps_total{call_class="side",rule="side_model"} 1.0' in text
    await log.close()
    manager.log = await TrajectoryLog.open(str(tmp_path / "log"))  # for the fixture's close


def test_records_made_before_the_classes_decode_as_main_line_steps() -> None:
    data = msgspec.json.decode(msgspec.json.encode(Step(prompt_token_ids=[1], response_token_ids=[2])))
    for key in ("call_class", "call_rule", "branch"):
        del data[key]
    old = step_json_decoder.decode(msgspec.json.encode(data))
    assert isinstance(old, Step) and (old.call_class, old.call_rule, old.branch) == ("main", "", 0)
    traj = msgspec.json.decode(msgspec.json.encode(Trajectory(id="t")))
    del traj["train"], traj["side_models"]
    assert trajectory_json_decoder.decode(msgspec.json.encode(traj)).train == "main"


def classified() -> list[Step]:
    line, calls = MainLine(), session_calls()
    prefixes = ["first", "history_edited", "extends", "truncated", "extends"]
    for i, (s, prefix) in enumerate(zip(calls, prefixes, strict=True)):
        s.index = i
        s.prefix = prefix  # type: ignore[assignment]
        apply(line, [s], [prefix])  # type: ignore[list-item]
    return calls


def test_rows_train_the_main_line_by_default_and_every_call_on_request() -> None:
    main = build_batch([Trajectory(id="a", status="finished", steps=classified())], version=0)
    assert main.counts["dropped_side"] == 1 and main.counts["trained_steps"] == 4
    # the title call between the first two turns does not break them: one sequence; the branch opens another
    assert [[main.samples[i].step_index for i in seq.samples] for seq in main.sequences] == [[0, 2], [3, 4]]
    every = build_batch([Trajectory(id="a", status="finished", steps=classified(), train="all")], version=0)
    assert every.counts["dropped_side"] == 0 and every.counts["trained_side_steps"] == 1
    layout = [[every.samples[i].step_index for i in seq.samples] for seq in every.sequences]
    assert layout == [[0, 2], [1], [3, 4]]


def test_an_open_body_checks_train_and_side_models() -> None:
    from steptap.middleware.sessions.control import OpenBody

    assert msgspec.json.decode(b'{"train": "all", "side_models": ["h"]}', type=OpenBody).train == "all"
    too_many = b'{"side_models": [' + b'"h",' * 40 + b'"h"]}'
    for bad in (b'{"train": "side"}', b'{"side_models": "h"}', too_many):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(bad, type=OpenBody)


def test_serve_takes_side_models_repeated() -> None:
    from steptap.middleware.server.serve import config_from_args

    config = config_from_args(["--backend", "http://b", "--side-models", "claude-haiku",
                               "--side-models", "small"])
    assert config.side_models == ["claude-haiku", "small"]
    assert config_from_args(["--backend", "http://b"]).side_models == []


def test_steptap_run_opens_its_sessions_with_train_and_side_models() -> None:
    from steptap.adapters.run import _parse_args
    from steptap.middleware.client.api import session_body

    args = _parse_args(["--proxy", "http://p", "--control-token", "t", "--train", "all", "--side-model",
                        "haiku",
                        "--", "true"])
    assert (args.train, args.side_models) == ("all", ["haiku"])
    body = session_body({"train": args.train, "side_models": args.side_models})
    from steptap.middleware.sessions.control import OpenBody

    opened = msgspec.json.decode(msgspec.json.encode(body), type=OpenBody)
    assert (opened.train, opened.side_models) == ("all", ["haiku"])
    assert "train" not in session_body({"train": "main"})  # the default, unsent



async def test_a_refused_call_leaves_the_main_line_as_it_was(tmp_path: Path) -> None:
    from steptap.middleware.exceptions import SessionFull

    log = await TrajectoryLog.open(str(tmp_path / "log"))
    manager = SessionManager(ProxyConfig(log=str(tmp_path / "log"), max_session_steps=1), log, Metrics(),
                             None,
                             set())  # type: ignore[arg-type]
    session = await manager.open(session_id="s1")
    first, _, second, compacted, _ = session_calls()
    await manager.record(session, [first])
    with pytest.raises(SessionFull):
        await manager.record(session, [compacted])  # would have opened branch 1
    assert (session.line.branch, session.line.start) == (0, first_messages(first))
    await log.close()


TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
TITLER = {"role": "system", "content": "You are a title generator. You output ONLY a thread title."}


def title_first_calls() -> list[Step]:
    """opencode's order: its title call (its small model, no tools) recorded first, then its agent loop
    (another system prompt, tools): two calls of the loop, the second extending the first."""
    task = {"role": "user", "content": "fix it"}
    title = step([TITLER, task], [7, 8], [20], started=1)
    loop = step([SYSTEM, task], [1, 2, 3], [10, 11], started=2)
    loop.request["tools"] = TOOLS
    turns = [{"role": "assistant", "content": "reply 2"}, {"role": "tool", "content": "x"}]
    again = step([SYSTEM, task, *turns],
                 [1, 2, 3, 10, 11, 4], [12], started=3)
    again.request["tools"] = TOOLS
    return [title, loop, again]


def test_a_tool_less_first_call_is_superseded_by_the_agent_loop_in_either_order() -> None:
    title, loop, again = title_first_calls()
    line = MainLine()
    loop.prefix = "history_edited"  # as judged against the title call: the main line starts anew
    for s, prefix in [(title, "first"), (loop, "history_edited"), (again, "extends")]:
        apply(line, [s], [prefix])  # type: ignore[list-item]
    assert [(s.call_class, s.call_rule) for s in (title, loop, again)] == [
        ("main", "first"), ("main", "supersedes"), ("main", "extends")]
    assert loop.prefix == "first"
    steps = [title, loop, again]
    for i, s in enumerate(steps):
        s.index = i
    supersede(steps, 1)
    assert [(s.call_class, s.call_rule) for s in steps] == [
        ("side", "superseded"), ("main", "supersedes"), ("main", "extends")]
    assert title.call_class == "main"  # a new object: the logged one is not touched
    # the other order: the title call is a side call at once
    title, loop, again = title_first_calls()
    line = MainLine()
    for s, prefix in [(loop, "first"), (title, "history_edited"), (again, "extends")]:
        apply(line, [s], [prefix])  # type: ignore[list-item]
    assert [(s.call_class, s.call_rule) for s in (loop, title, again)] == [
        ("main", "first"), ("side", "other"), ("main", "extends")]
    # only a tool-less first call alone is provisional: a main line of two calls, or one with tools, stays
    title, loop, again = title_first_calls()
    line = MainLine()
    apply(line, [title], ["first"])
    follow = step([TITLER, {"role": "user", "content": "fix it"}, {"role": "assistant", "content": "reply 1"},
                   {"role": "user", "content": "more"}], [7, 8, 20, 9], [21], started=1.5)
    apply(line, [follow], ["extends"])
    assert decide(line, loop, "history_edited") == Decision("side", "other", 0)
    line = MainLine()
    apply(line, [again], ["first"])
    other = step([TITLER], [7], [8])
    other.request["tools"] = TOOLS
    assert decide(line, other, "history_edited") == Decision("side", "other", 0)


async def test_a_superseded_title_call_is_side_in_the_session_the_log_and_after_a_restart(
        manager: SessionManager, tmp_path: Path) -> None:
    from steptap.middleware.log.offline import LogReader

    title, loop, again = title_first_calls()
    session = await manager.open(session_id="t1")
    for s in (title, loop):
        await manager.record(session, [s])
    held = session.trajectory.steps
    assert [(s.call_class, s.call_rule, s.prefix) for s in held] == [
        ("side", "superseded", "first"), ("main", "supersedes", "first")]
    assert held[1].delta is None  # the main line's start: logged whole, never a delta of the title
    # a restart: the rebuilt session says the same, and the next call extends the agent's first
    await manager.log.close()  # type: ignore[attr-defined]
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    again_mgr = SessionManager(manager.config, log, Metrics(), None, set())
    assert await again_mgr.rebuild() == 1
    session = again_mgr.sessions["t1"]
    assert [(s.call_class, s.call_rule) for s in session.trajectory.steps] == [
        ("side", "superseded"), ("main", "supersedes")]
    await again_mgr.record(session, [again])
    assert session.trajectory.steps[2].delta is not None and session.trajectory.steps[2].delta.base == 1
    await again_mgr.finish(session)
    await log.close()
    manager.log = await TrajectoryLog.open(str(tmp_path / "log"))  # for the fixture's close
    # the log keeps each step as it was logged; the finished trajectory says what it finished as
    (done,) = list(LogReader(str(tmp_path / "log")).trajectories())
    assert [(s.call_class, s.call_rule) for s in done.steps] == [
        ("side", "superseded"), ("main", "supersedes"), ("main", "extends")]
    batch = build_batch([done], version=0)
    assert batch.counts["dropped_side"] == 1
    assert [[batch.samples[i].step_index for i in seq.samples] for seq in batch.sequences] == [[1, 2]]
