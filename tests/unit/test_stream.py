"""The stream routes on a real aiohttp server and a real log: formats, cursors, follow with heartbeats, acks
that persist and survive a restart, compaction on ack, and the control token."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from steptap.middleware.auth import CONTROL_TOKEN_KEY
from steptap.middleware.errors import error_middleware
from steptap.middleware.log.stream import LOG_KEY, STREAM_STATE_KEY, StreamMessage, add_routes
from steptap.middleware.log.wal import TrajectoryLog, parse_cursor
from steptap.middleware.metrics import METRICS_KEY, Metrics
from steptap.middleware.records import SessionOpened, Step, Trajectory

TOKEN = "stc-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

MakeClient = Callable[..., Awaitable[TestClient]]


def make_app(log: TrajectoryLog, **kw: Any) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[CONTROL_TOKEN_KEY] = TOKEN
    app[LOG_KEY] = log
    add_routes(app, **kw)
    return app


def traj(i: int, status: str = "finished") -> Trajectory:
    return Trajectory(id=f"t{i}", status=status, rewards={"r": float(i)},
                      steps=[Step(trajectory_id=f"t{i}", response_token_ids=[i, i + 1],
                                  response_logprobs=[-1.0, -2.0])])


@pytest.fixture
async def log(tmp_path: Path) -> AsyncIterator[TrajectoryLog]:
    lg = await TrajectoryLog.open(str(tmp_path / "log"))
    yield lg
    await lg.close()


async def read_ndjson(resp: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (await resp.read()).splitlines() if line.strip()]


async def test_ndjson_stream_from_start_and_from_cursor(log: TrajectoryLog,
                                                        aiohttp_client: MakeClient) -> None:
    cursors = []
    for i in range(5):
        await log.append(SessionOpened(trajectory_id=f"t{i}"))
        cursors.append(await log.append(traj(i)))
    client = await aiohttp_client(make_app(log))
    resp = await client.get("/trajectories", params={"follow": "0"}, headers=AUTH)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/x-ndjson")
    msgs = await read_ndjson(resp)
    assert [(m["cursor"], m["trajectory"]["id"]) for m in msgs[:-1]] == [(c, f"t{i}") for i,
                                                                         c in enumerate(cursors)]
    assert msgs[0]["trajectory"]["steps"][0]["response_token_ids"] == [0, 1]
    assert msgs[-1] == {"cursor": cursors[-1], "end": True}

    resp = await client.get("/trajectories", params={"follow": "0", "cursor": cursors[2]}, headers=AUTH)
    msgs = await read_ndjson(resp)
    assert [m["trajectory"]["id"] for m in msgs if "trajectory" in m] == ["t3", "t4"]


async def test_msgpack_frames(log: TrajectoryLog, aiohttp_client: MakeClient) -> None:
    for i in range(3):
        await log.append(traj(i))
    client = await aiohttp_client(make_app(log))
    resp = await client.get("/trajectories", params={"follow": "0", "format": "msgpack"}, headers=AUTH)
    assert resp.headers["Content-Type"].startswith("application/x-msgpack")
    body, msgs = await resp.read(), []
    dec = msgspec.msgpack.Decoder(StreamMessage)
    while body:
        (n,) = struct.unpack(">I", body[:4])
        msgs.append(dec.decode(body[4:4 + n]))
        body = body[4 + n:]
    assert [m.trajectory.id for m in msgs if m.trajectory] == ["t0", "t1", "t2"]
    assert msgs[1].trajectory == list(log.records())[1]  # the record exactly as logged
    assert msgs[1].trajectory.rewards == {"r": 1.0} and msgs[-1].end


async def test_follow_delivers_new_trajectories_and_heartbeats(log: TrajectoryLog,
                                                               aiohttp_client: MakeClient) -> None:
    client = await aiohttp_client(make_app(log))
    resp = await client.get("/trajectories", params={"heartbeat": "0.1"}, headers=AUTH)
    assert resp.status == 200
    line = json.loads(await asyncio.wait_for(resp.content.readline(), 5))
    assert "heartbeat" in line and "trajectory" not in line  # idle: a heartbeat keeps the connection alive
    await log.append(Step(trajectory_id="x"))  # not a trajectory: not sent
    c = await log.append(traj(9))
    while True:
        line = json.loads(await asyncio.wait_for(resp.content.readline(), 5))
        if "trajectory" in line:
            break
    assert line["trajectory"]["id"] == "t9" and line["cursor"] == c
    resp.close()
    # The server notices the client is gone (its next heartbeat write fails) and drops the stream.
    state = client.app[STREAM_STATE_KEY]
    for _ in range(50):
        if not state.streams:
            break
        await asyncio.sleep(0.05)
    assert not state.streams


async def test_ack_persists_moves_forward_and_survives_restart(
    tmp_path: Path, log: TrajectoryLog, aiohttp_client: MakeClient
) -> None:
    cursors = [await log.append(traj(i)) for i in range(4)]
    client = await aiohttp_client(make_app(log, compact=False))
    resp = await client.post("/trajectories/ack", json={"consumer": "learner", "cursor": cursors[1]},
                             headers=AUTH)
    assert resp.status == 200 and (await resp.json())["cursor"] == cursors[1]
    saved = json.loads((log.dir / "consumers" / "learner.cursor").read_text())
    assert saved["cursor"] == cursors[1]
    # An older cursor does not move it back.
    resp = await client.post("/trajectories/ack", json={"consumer": "learner", "cursor": cursors[0]},
                             headers=AUTH)
    assert (await resp.json())["cursor"] == cursors[1]
    # Without a cursor, the consumer resumes after what it acknowledged.
    msgs = await read_ndjson(await client.get("/trajectories", params={"consumer": "learner", "follow": "0"},
                                              headers=AUTH))
    assert [m["trajectory"]["id"] for m in msgs if "trajectory" in m] == ["t2", "t3"]
    await client.close()
    await log.close()

    # A restart of the proxy: new log object, new app, same directory.
    log2 = await TrajectoryLog.open(str(tmp_path / "log"))
    try:
        client2 = await aiohttp_client(make_app(log2))
        msgs = await read_ndjson(await client2.get("/trajectories",
                                                   params={"consumer": "learner", "follow": "0"},
                                                   headers=AUTH))
        assert [m["trajectory"]["id"] for m in msgs if "trajectory" in m] == ["t2", "t3"]
        msgs = await read_ndjson(await client2.get("/trajectories",
                                                   params={"consumer": "other", "follow": "0"},
                                                   headers=AUTH))
        assert len([m for m in msgs if "trajectory" in m]) == 4  # a new consumer starts at the beginning
    finally:
        await log2.close()


async def test_ack_compacts_what_every_consumer_acknowledged(tmp_path: Path,
                                                             aiohttp_client: MakeClient) -> None:
    log = await TrajectoryLog.open(str(tmp_path / "log"), segment_bytes=1024)
    try:
        cursors = [await log.append(traj(i)) for i in range(20)]
        n = len(list((tmp_path / "log").glob("seg-*.log")))
        assert n >= 4
        client = await aiohttp_client(make_app(log))
        await client.post("/trajectories/ack", json={"consumer": "a", "cursor": cursors[0]}, headers=AUTH)
        resp = await client.post("/trajectories/ack", json={"consumer": "b", "cursor": cursors[-1]},
                                 headers=AUTH)
        assert (await resp.json())["compacted_segments"] == 0  # consumer a still needs them
        resp = await client.post("/trajectories/ack", json={"consumer": "a", "cursor": cursors[-1]},
                                 headers=AUTH)
        assert (await resp.json())["compacted_segments"] == parse_cursor(cursors[-1])[0] - 1
        assert len(list((tmp_path / "log").glob("seg-*.log"))) == 1
        msgs = await read_ndjson(await client.get("/trajectories", params={"consumer": "a", "follow": "0"},
                                                  headers=AUTH))
        assert msgs == [{"cursor": cursors[-1], "end": True}]
    finally:
        await log.close()


@pytest.mark.parametrize("body,code", [
    (b"not json", "invalid_json"),
    (b'{"consumer": "x"}', "invalid_body"),
    (b'{"consumer": "x", "cursor": 5}', "invalid_body"),
    (b'{"consumer": "x", "cursor": "nope"}', "invalid_cursor"),
    (b'{"consumer": "x", "cursor": "99:8"}', "invalid_cursor"),
    (b'{"consumer": "../etc", "cursor": "1:8"}', "invalid_consumer"),
    (b'{"consumer": "x", "cursor": "1:8", "extra": 1}', "invalid_body"),
])
async def test_bad_ack_bodies_are_400(log: TrajectoryLog, aiohttp_client: MakeClient, body: bytes,
                                      code: str) -> None:
    client = await aiohttp_client(make_app(log))
    resp = await client.post("/trajectories/ack", data=body,
                             headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"]
    assert not (log.dir / "consumers").exists()  # nothing was stored


@pytest.mark.parametrize("params", [{"format": "xml"}, {"cursor": "abc"}, {"cursor": "7:8"},
                                    {"cursor": "1:9"},
                                    {"follow": "maybe"},
                                    {"heartbeat": "0"}, {"consumer": "a/b"}])
async def test_bad_stream_parameters_are_400(log: TrajectoryLog, aiohttp_client: MakeClient,
                                             params: dict[str, str]) -> None:
    await log.append(traj(0))
    client = await aiohttp_client(make_app(log))
    resp = await client.get("/trajectories", params=params, headers=AUTH)
    assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_agent_credentials_cannot_read_or_ack(log: TrajectoryLog, aiohttp_client: MakeClient) -> None:
    await log.append(traj(0))
    client = await aiohttp_client(make_app(log))
    for headers, status in (({}, 401), ({"Authorization": "Bearer stk-session-key"}, 403),
                            ({"Authorization": "Bearer wrong"}, 403)):
        resp = await client.get("/trajectories", params={"follow": "0"}, headers=headers)
        assert resp.status == status
        assert (await resp.json())["error"]["type"] in ("authentication_error", "permission_error")
        resp = await client.post("/trajectories/ack", json={"consumer": "x", "cursor": "1:8"},
                                 headers=headers)
        assert resp.status == status
    assert not (log.dir / "consumers").exists()


async def test_stream_lag_metric(log: TrajectoryLog, aiohttp_client: MakeClient) -> None:
    cursors = [await log.append(traj(i)) for i in range(5)]
    app = make_app(log)
    app[METRICS_KEY] = Metrics()
    client = await aiohttp_client(app)
    await client.post("/trajectories/ack", json={"consumer": "learner", "cursor": cursors[1]}, headers=AUTH)
    assert b'steptap_stream_lag_records{consumer="learner"} 3.0' in app[METRICS_KEY].render()
    await client.post("/trajectories/ack", json={"consumer": "learner", "cursor": cursors[4]}, headers=AUTH)
    assert b'steptap_stream_lag_records{consumer="learner"} 0.0' in app[METRICS_KEY].render()


async def test_an_abandoned_consumer_can_be_removed_and_stops_holding_compaction(
    tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    log = await TrajectoryLog.open(str(tmp_path / "log"), segment_bytes=1024)
    try:
        cursors = [await log.append(traj(i)) for i in range(20)]
        app = make_app(log)
        app[METRICS_KEY] = Metrics()
        app[METRICS_KEY].watch_log(log)
        client = await aiohttp_client(app)
        await client.post("/trajectories/ack", json={"consumer": "gone", "cursor": cursors[0]}, headers=AUTH)
        resp = await client.post("/trajectories/ack", json={"consumer": "live", "cursor": cursors[-1]},
                                 headers=AUTH)
        assert (await resp.json())["compacted_segments"] == 0  # "gone" holds every segment
        held = log.disk_bytes
        assert f"steptap_log_disk_bytes {float(held)}".encode() in app[METRICS_KEY].render()
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 403)):
            assert (await client.delete("/trajectories/consumers/gone", headers=headers)).status == status
        resp = await client.delete("/trajectories/consumers/gone", headers=AUTH)
        body = await resp.json()
        assert resp.status == 200 and body["deleted"] is True
        assert body["compacted_segments"] == parse_cursor(cursors[-1])[0] - 1
        assert not (log.dir / "consumers" / "gone.cursor").exists() and log.disk_bytes < held
        assert f"steptap_log_disk_bytes {float(log.disk_bytes)}".encode() in app[METRICS_KEY].render()
        assert b'consumer="gone"' not in app[METRICS_KEY].render()
        resp = await client.delete("/trajectories/consumers/gone", headers=AUTH)
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "consumer_not_found"
        resp = await client.delete("/trajectories/consumers/a%0A", headers=AUTH)  # a trailing newline
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_consumer"
    finally:
        await log.close()


async def test_an_undecodable_trajectory_is_skipped_in_the_ndjson_stream(
    tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    from steptap.middleware.log.segments import frame

    logdir = tmp_path / "log"
    log = await TrajectoryLog.open(str(logdir))
    first = await log.append(traj(0))
    await log.close()
    bad = msgspec.to_builtins(traj(1))
    bad["steps"][0]["model"] = 1  # what a proxy without edge validation wrote
    with open(sorted(logdir.glob("seg-*.log"))[-1], "ab") as f:
        f.write(frame(msgspec.msgpack.encode(bad)))
    log = await TrajectoryLog.open(str(logdir))
    try:
        last = await log.append(traj(2))
        client = await aiohttp_client(make_app(log))
        msgs = await read_ndjson(await client.get("/trajectories", params={"follow": "0"}, headers=AUTH))
        assert [m.get("trajectory", {}).get("id") for m in msgs] == ["t0", None, "t2", None]
        assert msgs[0]["cursor"] == first and msgs[2]["cursor"] == last
        skipped = msgs[1]
        assert "model" in skipped["skipped"] and parse_cursor(first) < parse_cursor(
            skipped["cursor"]
        ) < parse_cursor(last)
        assert msgs[-1]["end"] is True and log.stats.undecodable_records == 1
    finally:
        await log.close()
