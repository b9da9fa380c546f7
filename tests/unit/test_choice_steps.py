"""A call with ``n > 1`` records its request once (schema 5): each choice after the first is logged as a
delta of the first (``Delta.kind == "choice"``), and every reader still hands out each choice in full, equal
(msgpack byte for byte) to the step as capture made it: the log (follow), ``steps_of``, the offline reader,
the NDJSON and msgpack streams through the client, a rebuilt session, the learner's rows and export. A real
log, a real session manager and the real stream routes; the steps are built by capture from a reply shaped as
vLLM's (no vLLM needed for the log's shape; tests/integration/test_choice_steps.py runs the real one)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_delta_steps import TOKEN, make_stream_app

from steptap.adapters.export_parquet import step_rows
from steptap.learner.rows import build_batch
from steptap.middleware.client import SteptapClient
from steptap.middleware.config import ProxyConfig
from steptap.middleware.delta import expand, steps_of
from steptap.middleware.exceptions import RecordTooLarge
from steptap.middleware.log.offline import LogReader
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import Metrics
from steptap.middleware.proxy.capture import CHAT, steps_from_reply
from steptap.middleware.records import Sampling, Step, Trajectory, msgpack_encoder
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.manager import SessionManager

enc = msgpack_encoder.encode
N = 8
BIG = "a long tool result " * 12_000  # ~230 kB of request


def call_steps(turn: int, prompt: list[int], messages: list[dict[str, Any]], n: int = N) -> list[Step]:
    """The steps of one chat call with ``n`` choices, built by capture from a reply shaped as vLLM's (one
    request and one prompt list shared by the choices, as ``relay`` passes them)."""
    body = {"model": "m", "messages": messages, "n": n, "temperature": 1.0, "max_tokens": 16}
    choices = []
    for c in range(n):
        ids = [(turn * 97 + c * 13 + k) % 150_000 for k in range(6 + c)]
        choices.append({
            "index": c, "finish_reason": "stop", "token_ids": ids,
            "message": {"role": "assistant", "content": f"turn {turn} choice {c}"},
            "logprobs": {"content": [{"logprob": math.nan if k == 0 else -0.1 * k} for k in range(len(ids))]},
        })
    reply = {"choices": choices, "prompt_token_ids": prompt}
    return steps_from_reply(reply, CHAT, request=body, sampling=Sampling(temperature=1.0, max_tokens=16),
                            model="m", served_model="m", started_at=1000.0 + turn, latency_s=0.5)


def session_calls() -> list[list[Step]]:
    """Three calls: an n=8 call on a big request, the next turn extending its choice 3, and another n=8 call
    extending that one."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "agent"},
                                      {"role": "user", "content": BIG}]
    prompt = [(7 * i) % 150_000 for i in range(3000)]
    first = call_steps(0, prompt, messages)
    pick = first[3]
    messages2 = [*messages, {"role": "assistant", "content": "turn 0 choice 3"},
                 {"role": "tool", "content": "ok"}]
    prompt2 = prompt + pick.response_token_ids + [5, 6, 7]
    second = call_steps(1, prompt2, messages2, n=1)
    messages3 = [*messages2, {"role": "assistant", "content": "turn 1 choice 0"},
                 {"role": "tool", "content": "2"}]
    third = call_steps(2, prompt2 + second[0].response_token_ids + [8, 9], messages3)
    return [first, second, third]


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[SessionManager]:
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    yield SessionManager(ProxyConfig(log=str(tmp_path / "log")), log, Metrics(), None, set())
    await log.close()


async def test_an_n8_call_logs_and_holds_its_request_once(manager: SessionManager) -> None:
    """Before: each of the 8 steps held the whole request, and the log took ~8x the call's request."""
    steps = call_steps(0, list(range(3000)), [{"role": "user", "content": BIG}])
    one = len(enc(steps[0]))
    assert one > 200_000 and all(s.request is steps[0].request for s in steps)
    session = await manager.open(session_id="n8")
    opened, before = session.bytes, manager.log.disk_bytes  # type: ignore[attr-defined]
    async with manager.call(session, steps=N, size=len(msgspec.json.encode(steps[0].request))):
        await manager.record(session, steps)
    logged = manager.log.disk_bytes - before  # type: ignore[attr-defined]
    assert one < logged < one + 2_000 * N  # the request and prompt once, each choice's own tokens
    assert session.bytes - opened < one + 3_000 * N and manager.bytes_held == session.bytes
    forms = session.trajectory.steps
    assert forms[0].delta is None and all(f.delta is not None and f.delta.kind == "choice" and
                                          f.delta.base == 0 and f.request == {} and f.prompt_token_ids == []
                                          for f in forms[1:])
    assert [enc(expand(f, steps[0])) for f in forms[1:]] == [enc(s) for s in steps[1:]]

    # An anonymous call: its one Trajectory record holds the request once as well
    anon = await manager.resolve(Identity(source="anonymous"))
    anon_steps = call_steps(0, list(range(3000)), [{"role": "user", "content": BIG}])
    before = manager.log.disk_bytes  # type: ignore[attr-defined]
    async with manager.call(anon, steps=N, size=one):
        await manager.record(anon, anon_steps)
    assert one < manager.log.disk_bytes - before < one + 2_000 * N  # type: ignore[attr-defined]
    [anon_logged] = [r for r in manager.log.records() if isinstance(r, Trajectory)  # type: ignore[attr-defined]
                     and r.anonymous]
    assert [enc(s) for s in steps_of([anon_logged])] == [enc(s) for s in anon_steps]


async def test_the_session_limit_counts_the_request_once(tmp_path: Path) -> None:
    """A session with room for the request once (not 8 times) takes the n=8 call; an anonymous call whose
    steps would pass max_record_bytes is refused before its record is logged."""
    steps = call_steps(0, list(range(3000)), [{"role": "user", "content": BIG}])
    one = len(enc(steps[0]))
    log = await TrajectoryLog.open(str(tmp_path / "log"), max_record_bytes=3 * one)
    cfg = ProxyConfig(log=str(tmp_path / "log"), max_session_bytes=2 * one, max_record_bytes=3 * one)
    manager = SessionManager(cfg, log, Metrics(), None, set())
    session = await manager.open(session_id="s")
    async with manager.call(session, steps=N, size=one):
        await manager.record(session, steps)
    assert len(session.trajectory.steps) == N
    anon = await manager.resolve(Identity(source="anonymous"))
    wide = call_steps(0, list(range(3000)), [{"role": "user", "content": "x" * (one // 2)}], n=N)
    for s in wide:  # each choice's own text: nothing to share
        s.response["content"] = "y" * (one // 2)
    before = log.disk_bytes
    with pytest.raises(RecordTooLarge):
        async with manager.call(anon, steps=N, size=one // 2):
            await manager.record(anon, wide)
    assert log.disk_bytes == before
    await log.close()


async def test_every_reader_hands_out_every_choice_in_full(
    manager: SessionManager, tmp_path: Path, aiohttp_server: Any
) -> None:
    calls = session_calls()
    session = await manager.open(session_id="s1")
    for steps in calls:
        await manager.record(session, steps)
    steps = [s for c in calls for s in c]
    assert calls[1][0].prefix == "extends" and calls[2][0].prefix == "extends"
    forms = session.trajectory.steps
    assert [f.delta.kind if f.delta else None for f in forms] == (
        [None] + ["choice"] * (N - 1) + ["extends"] + ["extends"] + ["choice"] * (N - 1))
    await manager.add_reward(session, 0.5, "judge", 5)

    # a rebuilt session holds the same steps and counts the same bytes (within the slack of its records)
    held = manager.bytes_held
    log = manager.log
    assert isinstance(log, TrajectoryLog)
    await log.close()
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    manager = SessionManager(manager.config, log, Metrics(), None, set())
    assert await manager.rebuild() == 1
    session = manager.sessions["s1"]
    assert [enc(f) for f in session.trajectory.steps] == [enc(f) for f in forms]
    assert abs(manager.bytes_held - held) < 2_000 and sorted(session.full) == list(range(N + 1, 2 * N + 1))
    await manager.finish(session, reward=1.0)
    expected = [enc(s) for s in steps]
    assert steps[5].rewards == {"judge": 0.5}

    follow = [t async for _, t in log.follow(until_idle=0)]
    assert [enc(s) for s in follow[0].steps] == expected
    records = list(log.records())
    assert [enc(s) for s in steps_of(records)] == [enc(msgspec.structs.replace(s, rewards={})) for s in steps]
    assert [enc(s) for s in next(LogReader(str(tmp_path / "log")).trajectories()).steps] == expected

    server = await aiohttp_server(make_stream_app(log))
    async with SteptapClient(str(server.make_url("")).rstrip("/"), TOKEN) as client:
        got = [d.trajectory async for d in client.trajectories("c", follow=False)]
        assert [enc(s) for s in got[0].steps] == expected and client.skipped.get("c", 0) == 0
        nd = [d.trajectory async for d in client.trajectories("d", follow=False, format="ndjson")]
        assert [msgspec.json.encode(s) for s in nd[0].steps] == [msgspec.json.encode(s) for s in steps]
        async with client._http().get(str(server.make_url("/trajectories")),
                                      params={"follow": "0", "format": "msgpack"},
                                      headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            body = await resp.read()
    # the msgpack stream carries the logged steps: the big request once, not once per choice
    logged = [r for r in records if isinstance(r, Step)]
    assert len(body) < 1.2 * sum(len(enc(s)) for s in logged) < sum(len(e) for e in expected) / 5

    whole = msgspec.structs.replace(follow[0], steps=steps, step_refs=[])
    a, b = build_batch([got[0]], version=0), build_batch([whole], version=0)
    assert a.sequences == b.sequences and repr(a.samples) == repr(b.samples) and a.counts == b.counts
    assert repr(list(step_rows(got[0]))) == repr(list(step_rows(whole)))
    rows = list(step_rows(got[0]))
    assert len(rows) == 2 * N + 1 and all(BIG in repr(r) for r in rows)  # every choice has the request
    await log.close()


async def test_a_side_call_with_choices_is_rebuilt(tmp_path: Path) -> None:
    """A side call's first choice is no base of the main line, yet its other choices refer to it: the
    rebuild (``Expander``) holds each trajectory's latest first choice for them."""
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    cfg = ProxyConfig(log=str(tmp_path / "log"), side_models=["small"])
    manager = SessionManager(cfg, log, Metrics(), None, set())
    session = await manager.open(session_id="s")
    main = call_steps(0, list(range(50)), [{"role": "user", "content": "go"}], n=1)
    side = call_steps(1, list(range(500, 560)), [{"role": "user", "content": "title?"}], n=3)
    for s in side:
        s.model = "small"
    await manager.record(session, main)
    await manager.record(session, side)
    assert [s.call_class for s in side] == ["side"] * 3
    kinds = [f.delta.kind if f.delta else None for f in session.trajectory.steps]
    assert kinds == [None, None, "choice", "choice"]
    await log.close()
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    again = SessionManager(cfg, log, Metrics(), None, set())
    assert await again.rebuild() == 1
    await again.finish(again.sessions["s"])
    [(_, traj)] = [x async for x in log.follow(until_idle=0)]
    assert [enc(s) for s in traj.steps] == [enc(s) for s in main + side]
    await log.close()


def test_a_choice_whose_first_is_not_before_it_is_an_error() -> None:
    """A choice whose first choice is missing (a damaged log): an error, never a wrong step."""
    from steptap.middleware.delta import DeltaError, Expander, compress_choice

    steps = call_steps(0, [1, 2, 3], [{"role": "user", "content": "x"}], n=2)
    for i, s in enumerate(steps):
        s.index, s.trajectory_id = i, "t"
    form = compress_choice(steps[1], steps[0])
    with pytest.raises(DeltaError):
        Expander().full(form)
    expander = Expander()
    assert enc(expander.full(steps[0])) == enc(steps[0]) and enc(expander.full(form)) == enc(steps[1])
