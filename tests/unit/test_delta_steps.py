"""Delta steps (schema 4): a session logs and holds each step's new ids and messages only, its finished
Trajectory refers to its logged steps, and every reader hands out full steps equal, msgpack byte for byte, to
the steps as they were made: the log (follow), the NDJSON and msgpack streams, the client, the offline reader,
recovery (a rebuilt session), ``steps_of``, the learner's rows and export. A real log, a real session manager
and the real stream routes; the steps are built as capture builds them (no vLLM needed for the log's
shape)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from steptap.adapters.export_parquet import step_rows
from steptap.learner.rows import build_batch
from steptap.middleware.auth import CONTROL_TOKEN_KEY
from steptap.middleware.client import SteptapClient
from steptap.middleware.config import ProxyConfig
from steptap.middleware.delta import (
    DeltaError,
    compress,
    compress_prefix,
    expand,
    full_steps,
    resolve,
    steps_of,
)
from steptap.middleware.errors import error_middleware
from steptap.middleware.exceptions import SessionFull
from steptap.middleware.log.offline import LogReader
from steptap.middleware.log.stream import LOG_KEY, add_routes
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Sampling, Step, StepRef, Trajectory, msgpack_encoder
from steptap.middleware.sessions.manager import SessionManager

TOKEN = "stc-test-token"
SYSTEM = "You are a coding agent. " * 200
TOOLS = [{"type": "function", "function": {"name": f"tool{i}", "description": "does things " * 30,
                                            "parameters": {"type": "object", "properties": {}}}}
         for i in range(8)]
enc = msgpack_encoder.encode


def turns(n: int, first: int = 3000, per_turn: int = 150, reply: int = 12) -> list[Step]:
    """``n`` calls of one agent session, full form, as capture makes them: each prompt is the last prompt +
    reply + a tool result; turn 5 re-renders its history (not ``extends``: logged whole), turn 9 fails."""
    steps: list[Step] = []
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "fix it"}]
    prompt = [(7 * i) % 150_000 for i in range(first)]
    for t in range(n):
        response = [(t * 31 + k) % 150_000 for k in range(reply)]
        request: dict[str, Any] = {"model": "m", "messages": [dict(m) for m in messages], "tools": TOOLS,
                                   "temperature": 1.0, "stream": t % 2 == 0, "max_tokens": 64 + t % 3}
        if t == 3:
            request["stream_options"] = {"include_usage": True}
        failed = t == 9
        steps.append(Step(
            model="m", served_model="m", endpoint="chat.completions", request=request,
            sampling=Sampling(temperature=1.0, max_tokens=64),
            prompt_token_ids=[] if failed else list(prompt), response_token_ids=[] if failed else response,
            response_logprobs=[] if failed else [math.nan if k == 0 else -0.1 * k for k in range(reply)],
            finish_reason="stop", status="failed" if failed else "ok",
            response={"role": "assistant", "content": f"reply {t}"}, started_at=1000.0 + t, latency_s=0.5,
        ))
        if failed:
            continue
        messages += [{"role": "assistant", "content": f"reply {t}"},
                     {"role": "tool", "content": f"out {t} " * 40}]
        prompt = prompt + response + [(t * 13 + k) % 150_000 for k in range(per_turn)]
        if t == 4:  # the template rendered the history otherwise: the next prompt does not extend this one
            prompt = prompt[:10] + [1] + prompt[10:]
    return steps


def test_a_delta_expands_to_the_step_byte_for_byte() -> None:
    steps = turns(4)
    for i, s in enumerate(steps):
        s.index = i
    base, step = steps[1], steps[2]
    logged = compress(step, base)
    assert logged.delta is not None and logged.delta.base == 1
    assert len(logged.prompt_token_ids) == 150  # only the new ids
    assert logged.request["messages"] == step.request["messages"][4:]  # only the new messages
    assert "tools" not in logged.request and "model" not in logged.request  # the base's values
    assert logged.request["stream"] is True and logged.request["max_tokens"] == 66  # what changed is kept
    assert enc(expand(logged, base)) == enc(step)
    # 1 and 1.0 and true are different values: never taken for one another
    base.request["n"], step.request["n"] = 1, 1.0
    step.request["flag"], base.request["flag"] = True, 1
    assert enc(expand(compress(step, base), base)) == enc(step)
    # a key the base has and the step has not stays absent; the order of keys is kept
    del step.request["temperature"]
    step.request = {"tools": step.request.pop("tools"), **step.request}
    again = expand(compress(step, base), base)
    assert list(again.request) == list(step.request) and enc(again) == enc(step)
    with pytest.raises(DeltaError):
        full_steps([logged])  # its base is not there


def test_a_list_whose_late_items_were_edited_logs_from_the_first_edit() -> None:
    """Claude Code marks its newest message with ``cache_control`` and drops the mark from the one before at
    the next call: each call's messages start with all but the last of the previous call's. Logged from the
    edited message on (schema 8), a delta stays the same size however long the session; before, the whole list
    was logged again each call."""
    def mark(m: dict[str, Any]) -> dict[str, Any]:
        part = {"type": "text", "text": m["content"], "cache_control": {"type": "ephemeral"}}
        return {**m, "content": [part]}

    steps = turns(8)[:8]
    for i, s in enumerate(steps):
        s.index = i
        msgs = s.request["messages"]
        msgs[-1] = mark(msgs[-1])  # the newest message carries the mark, the earlier ones not
    sizes: list[int] = []
    for base, step in zip(steps[5:7], steps[6:8], strict=True):  # 5 -> 6, 6 -> 7 (turn 4 re-rendered)
        logged = compress(step, base)
        n = len(base.request["messages"])
        assert logged.delta is not None and logged.delta.tails == {"messages": n - 1}
        assert logged.request["messages"] == step.request["messages"][n - 1:]  # the unmarked one, the new
        assert enc(expand(logged, base)) == enc(step)
        sizes.append(len(logged.request["messages"]))
    assert sizes == [3, 3]  # each call: the unmarked message and the two new ones, not the history again
    # an item edited further back: the shared start is found, whatever its length
    step, base = steps[7], steps[6]
    step.request["messages"][3] = {"role": "tool", "content": "edited"}
    logged = compress(step, base)
    assert logged.delta is not None and logged.delta.tails == {"messages": 3}
    assert enc(expand(logged, base)) == enc(step)
    # a list shorter than its base's (a history cut in a call that still extends the tokens)
    step.request["messages"] = step.request["messages"][:2]
    logged = compress(step, base)
    assert logged.delta is not None and logged.delta.tails == {"messages": 2}
    assert logged.request["messages"] == []
    assert enc(expand(logged, base)) == enc(step)
    # a long list of ids (not a conversation) edited early: logged whole, not bisected over its encodes
    base.request["ids"] = list(range(10_000))
    step.request["ids"] = [*range(100), -1, *range(101, 10_001)]
    whole = compress(step, base)
    assert whole.delta is not None and "ids" not in whole.delta.tails
    assert whole.request["ids"] == step.request["ids"] and enc(expand(whole, base)) == enc(step)
    # a base with fewer items than the delta starts with: a clear error, never a wrong request
    short = msgspec.structs.replace(base, request={**base.request, "messages": base.request["messages"][:1]})
    with pytest.raises(DeltaError, match="fewer than the 2 items"):
        expand(logged, short)


def make_stream_app(log: TrajectoryLog) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[CONTROL_TOKEN_KEY] = TOKEN
    app[LOG_KEY] = log
    add_routes(app)
    return app


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[SessionManager]:
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    tasks: set[asyncio.Task[Any]] = set()
    yield SessionManager(ProxyConfig(log=str(tmp_path / "log")), log, Metrics(), None,
                         tasks)  # type: ignore[arg-type]
    await log.close()


async def run_session(manager: SessionManager, steps: list[Step], sid: str = "s1") -> None:
    session = await manager.open(session_id=sid)
    for step in steps:
        await manager.record(session, [step])


async def test_every_reader_hands_out_full_steps(
    manager: SessionManager, tmp_path: Path, aiohttp_server: Any
) -> None:
    steps = turns(14)
    await run_session(manager, steps)
    session = manager.sessions["s1"]
    assert [s.prefix for s in steps[:7]] == ["first", "extends", "extends", "extends", "extends",
                                             "rerendered", "extends"]
    assert steps[10].prefix == "extends"  # judged against the last ok call, not the failed step 9
    await manager.add_reward(session, 0.5, "judge", 3)
    await manager.finish(session, reward=1.0)
    expected = [enc(s) for s in steps]  # the steps as made (indexed, linked), rewards included
    assert steps[3].rewards == {"judge": 0.5}
    log = manager.log
    assert isinstance(log, TrajectoryLog)
    records = list(log.records())
    record = records[-1]
    assert isinstance(record, Trajectory) and record.steps == [] and len(record.step_refs) == 14
    logged = [r for r in records if isinstance(r, Step)]
    assert sum(s.delta is not None for s in logged) == 11  # all but the first, the re-rendered and the failed

    # the log's own reader
    follow = [t async for _, t in log.follow(until_idle=0)]
    assert [enc(s) for s in follow[0].steps] == expected
    whole = msgspec.structs.replace(record, steps=steps, step_refs=[])  # the record as schema 3 wrote it
    assert enc(follow[0]) == enc(whole)
    # the Step records, in full (a reward given later is in the RewardAdded record, not in them)
    assert [enc(s) for s in steps_of(records)] == [enc(msgspec.structs.replace(s, rewards={})) for s in steps]
    assert [enc(s) for s in LogReader(str(tmp_path / "log")).trajectories().__next__().steps] == expected

    # the streams and the client
    server = await aiohttp_server(make_stream_app(log))
    async with SteptapClient(str(server.make_url("")).rstrip("/"), TOKEN) as client:
        got = [d.trajectory async for d in client.trajectories("c", follow=False)]
        assert [enc(s) for s in got[0].steps] == expected and client.skipped.get("c", 0) == 0
        nd = [d.trajectory async for d in client.trajectories("d", follow=False, format="ndjson")]
        assert msgspec.json.encode(nd[0].steps[2]) == msgspec.json.encode(steps[2])
        async with client._http().get(str(server.make_url("/trajectories")),
                                      params={"follow": "0", "format": "msgpack"},
                                      headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            body = await resp.read()
    # the msgpack stream carries the logged (delta) steps: each new token once, not the whole context per step
    assert len(body) < 2 * sum(len(enc(s)) for s in logged) < sum(len(e) for e in expected)

    # the learner's rows and export
    a = build_batch([got[0]], version=0)
    b = build_batch([whole], version=0)
    # NaN: repr
    assert a.sequences == b.sequences and repr(a.samples) == repr(b.samples) and a.counts == b.counts
    assert repr(list(step_rows(got[0]))) == repr(list(step_rows(whole)))  # NaN logprobs: by repr


async def test_a_session_is_rebuilt_from_delta_steps(manager: SessionManager, tmp_path: Path) -> None:
    steps = turns(8)
    await run_session(manager, steps[:6])
    held = manager.bytes_held
    await manager.log.close()  # type: ignore[attr-defined]
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    again = SessionManager(manager.config, log, Metrics(), None, set())
    assert await again.rebuild() == 1
    session = again.sessions["s1"]
    assert session.trajectory.steps[2].delta is not None  # held in the log's form
    assert abs(again.bytes_held - held) < 300
    for step in steps[6:]:  # goes on extending the last call, which the rebuild restored in full
        await again.record(session, [step])
    assert steps[7].prefix == "extends" and session.trajectory.steps[7].delta is not None
    await again.finish(session)
    [(_, traj)] = [x async for x in log.follow(until_idle=0)]
    assert [enc(s) for s in traj.steps] == [enc(s) for s in steps]
    await log.close()
    manager.log = await TrajectoryLog.open(str(tmp_path / "log"))  # for the fixture's close


async def test_logged_and_held_bytes_grow_linearly(manager: SessionManager) -> None:
    """40 turns over a context growing 150 ids a turn: each step costs what it adds, the session holds as
    much, and the Trajectory record a few bytes a step (schema 3 logged the whole prompt with every step,
    twice)."""
    steps = [s for s in turns(40) if s.status == "ok"]
    session = await manager.open(session_id="long")
    sizes = []
    for step in steps:
        before = manager.log.disk_bytes  # type: ignore[attr-defined]
        await manager.record(session, [step])
        sizes.append(manager.log.disk_bytes - before)  # type: ignore[attr-defined]
    held = manager.bytes_held
    before = manager.log.disk_bytes  # type: ignore[attr-defined]
    await manager.finish(session)
    traj_bytes = manager.log.disk_bytes - before  # type: ignore[attr-defined]
    assert sizes[-1] < 1.2 * sizes[6]  # the 39th turn costs what the 7th did
    full = sum(len(enc(s)) for s in steps)
    assert sum(sizes) < full / 10
    assert held < 2 * sum(sizes) and traj_bytes < 100 * len(steps)


def edited_turns(n: int, first: int = 3000, per_turn: int = 150, reply: int = 12) -> list[Step]:
    """``n`` calls of an agent that ends every request with an internal-context message (OpenClaw): each
    call moves it after the new turns, so no prompt extends the one before, though each starts with most of
    it."""
    steps: list[Step] = []
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}]
    internal = {"role": "user", "content": "<context>runtime notes</context>"}
    ids = [(7 * i) % 150_000 for i in range(first)]
    for t in range(n):
        response = [(t * 31 + k) % 150_000 for k in range(reply)]
        steps.append(Step(
            model="m", served_model="m", endpoint="chat.completions",
            request={"model": "m", "messages": [*history, internal], "tools": TOOLS},
            sampling=Sampling(temperature=1.0), prompt_token_ids=ids + [9, 9, 9], response_token_ids=response,
            response_logprobs=[-0.5] * reply, finish_reason="stop", response={"role": "assistant"},
            started_at=2000.0 + t, latency_s=0.5))
        history = [*history, {"role": "assistant", "content": f"reply {t}"},
                   {"role": "tool", "content": f"out {t} " * 40}]
        ids = ids + response + [(t * 13 + k) % 150_000 for k in range(per_turn)]
    return steps


async def test_an_edited_history_is_logged_as_what_it_adds(manager: SessionManager, tmp_path: Path) -> None:
    """A main-line call that does not extend the one before but starts with most of its prompt (schema 8) is
    logged as a ``prefix`` delta of it: the ids after the shared start, the messages after the first one that
    changed. Every reader hands out the steps as made; a session of such calls grows linearly."""
    steps = edited_turns(12)
    await run_session(manager, steps)
    assert {s.prefix for s in steps[1:]} == {"history_edited"} and {s.call_class for s in steps} == {"main"}
    logged = [s for s in manager.sessions["s1"].trajectory.steps]
    assert logged[0].delta is None
    for made, form in zip(steps[1:], logged[1:], strict=True):
        d = form.delta
        assert d is not None and d.kind == "prefix" and d.base == made.index - 1
        assert d.shared == len(made.prompt_token_ids) - 150 - 12 - 3  # all but the new ids and the moved ones
        assert form.prompt_token_ids == made.prompt_token_ids[d.shared:]
        assert form.request["messages"] == made.request["messages"][-3:]  # from where the moved one was
    sizes = [len(enc(f)) for f in logged[1:]]
    assert sizes[-1] < 1.2 * sizes[0] and sum(sizes) < sum(len(enc(s)) for s in steps[1:]) / 10
    await manager.finish(session := manager.sessions["s1"])
    assert session.trajectory.status == "finished"
    records = list(manager.log.records())  # type: ignore[attr-defined]
    expected = [enc(s) for s in steps]
    assert [enc(s) for s in steps_of(records)] == expected
    assert [enc(s) for s in LogReader(str(tmp_path / "log")).trajectories().__next__().steps] == expected
    # a token prompt that is the step's own ids (known_prompt): its shared start is the ids', not encoded
    a, b = (msgspec.structs.replace(x, request={"model": "m", "prompt": x.prompt_token_ids})
            for x in steps[:2])
    b.index = 1
    form = compress_prefix(b, a)
    assert form is not None and form.delta is not None
    assert form.delta.tails == {"prompt": form.delta.shared}
    assert form.request["prompt"] == form.prompt_token_ids
    assert enc(expand(form, a)) == enc(b)
    # a base that is not the call before (a damaged log): a clear error
    with pytest.raises(DeltaError, match="shares"):
        expand(logged[5], msgspec.structs.replace(steps[4], prompt_token_ids=steps[4].prompt_token_ids[:100]))


async def test_the_latest_call_held_in_full_counts_against_the_session(tmp_path: Path) -> None:
    """The session holds its latest call in full beside its delta form (the next call is judged against it):
    those bytes count, so ``max_session_bytes`` bounds the memory of a session whose context is long and whose
    new tokens are few; counted with an upper bound, not by encoding 120k ids a call."""
    steps = [s for s in turns(12) if s.status == "ok"][5:]  # from turn 5's re-render on: every step extends
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    manager = SessionManager(ProxyConfig(log=str(tmp_path / "log")), log, Metrics(), None, set())
    session = await manager.open(session_id="s")
    opened = session.bytes
    for step in steps:
        await manager.record(session, [step])
    logged = sum(len(enc(s)) for s in session.trajectory.steps)
    full_last = len(enc(steps[-1]))
    assert session.trajectory.steps[-1].delta is not None and full_last > 2 * logged / len(steps)
    held = session.bytes - opened
    assert logged + full_last <= held <= logged + 1.2 * full_last + 300 * len(steps)
    assert manager.bytes_held == session.bytes
    await manager.finish(session)
    assert manager.bytes_held == 0
    await log.close()
    # A limit that the logged forms fit and the full latest call does not: refused.
    limit = opened + logged + full_last // 2
    log = await TrajectoryLog.open(str(tmp_path / "log2"))
    cfg = ProxyConfig(log=str(tmp_path / "log2"), max_session_bytes=limit)
    manager = SessionManager(cfg, log, Metrics(), None, set())
    session = await manager.open(session_id="s")
    fresh = [s for s in turns(12) if s.status == "ok"][5:]
    with pytest.raises(SessionFull):
        for step in fresh:
            await manager.record(session, [step])
    await log.close()


async def test_a_missing_step_skips_its_trajectory_not_the_reader(tmp_path: Path) -> None:
    """A Trajectory whose referenced step is not there (damage) is skipped and counted by every reader."""
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    start, _ = await log.append_at(Step(trajectory_id="a", index=0))
    bad = Trajectory(id="a", status="finished", step_refs=[StepRef(at="1:9")])
    await log.append(bad)
    await log.append(Trajectory(id="b", status="finished", step_refs=[StepRef(at=start)]))
    got = [t async for _, t in log.follow(until_idle=0)]
    assert [t.id for t in got] == ["b"] and log.stats.undecodable_records == 1
    await log.close()
    reader = LogReader(str(tmp_path / "log"))
    assert [t.id for t in reader.trajectories()] == ["b"] and reader.stats.undecodable == 1
    with pytest.raises(DeltaError):
        resolve(bad, [])
    assert json.loads(msgspec.json.encode(got[0]))["step_refs"] == []


V3_FIXTURE = Path(__file__).parent.parent / "fixtures" / "log-v3"


async def test_the_committed_v3_log_still_decodes(tmp_path: Path) -> None:
    """A log written by schema 3 (``tests/fixtures/write_log_v3.py``: whole steps, Trajectory records that
    embed them): every reader reads it, and a session it left open goes on in delta form after a restart."""
    import shutil
    import sys

    sys.path.insert(0, str(V3_FIXTURE.parent))
    from write_log_v3 import step  # the steps the fixture was written with

    shutil.copytree(V3_FIXTURE, tmp_path / "log")
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    got = {t.id: t async for _, t in log.follow(until_idle=0)}
    assert log.stats.undecodable_records == 0 and set(got) == {"v3-done"} | {i for i in got
                                                                             if i.startswith("anon-")}
    done = got["v3-done"]
    assert (
        done.schema_version == 3
        and done.rewards == {"reward": 1.0}
        and done.steps[1].rewards == {"judge": 0.5}
    )
    made = [step(t) for t in range(3)]
    assert [s.prompt_token_ids for s in done.steps] == [s.prompt_token_ids for s in made]
    assert [s.request for s in done.steps] == [s.request for s in made]
    assert [t.id for t in LogReader(str(tmp_path / "log")).trajectories()] == list(got)
    assert len(list(steps_of(log.records()))) == 3 + 2 + 1

    manager = SessionManager(ProxyConfig(log=str(tmp_path / "log")), log, Metrics(), None, set())
    assert await manager.rebuild() == 1
    session = manager.sessions["v3-open"]
    new = step(2)
    await manager.record(session, [new])
    assert new.prefix == "extends" and session.trajectory.steps[-1].delta is not None  # a v3 base, a v4 delta
    await manager.finish(session)
    last = [t async for _, t in log.follow(until_idle=0)][-1]
    assert last.id == "v3-open" and [s.prompt_token_ids for s in last.steps] == [s.prompt_token_ids
                                                                                 for s in made]
    assert [s.request for s in last.steps] == [s.request for s in made]
    await log.close()


async def test_compaction_keeps_the_steps_an_unacknowledged_trajectory_refers_to(tmp_path: Path) -> None:
    from steptap.middleware.records import SessionOpened

    log = await TrajectoryLog.open(str(tmp_path / "log"), segment_bytes=4096)
    await log.append(SessionOpened(trajectory_id="a"))
    starts = [(await log.append_at(Step(trajectory_id="a", index=i, prompt_token_ids=list(range(1500)))))[0]
              for i in range(3)]
    await log.append(Step(trajectory_id="other", prompt_token_ids=list(range(1500))))
    acked = await log.append(Step(trajectory_id="other", prompt_token_ids=list(range(1500))))
    await log.append(Trajectory(id="a", status="finished", step_refs=[StepRef(at=s) for s in starts]))
    assert int(acked.split(":")[0]) > int(starts[-1].split(":")[0])  # the ack lies after every step of "a"
    deleted = await log.compact(acked)  # "a" is not acknowledged: its steps stay
    assert not set(deleted) & {int(s.split(":")[0]) for s in starts}
    [(end, traj)] = [x async for x in log.follow(until_idle=0)]
    assert traj.id == "a" and len(traj.steps) == 3
    assert await log.compact(end)  # acknowledged: now they may go
    await log.close()
