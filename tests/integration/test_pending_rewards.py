"""Late and human rewards (issue 22, Build 3 and 4): a session finished with its reward pending is held off
the stream until the reward arrives or its deadline passes; held trajectories survive a SIGKILL of the proxy;
the learner trains a released one exactly once, a dropped one never; a rating after the stream is recorded as
late and exported with the run's provenance (model, tokenizer and chat template hashes, reward sources).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
from conftest import Backend, Proxy, ndjson_trajectories
from test_control import model_calls, open_session, req
from test_crash_recovery import TOKEN
from test_crash_recovery import Proxy as ServeProcess

from steptap.middleware.model_files import provenance


async def stream_ids(http: aiohttp.ClientSession, url: str, token: str) -> list[dict[str, Any]]:
    """Every trajectory the stream holds now, in order, duplicates kept (the count is what is checked)."""
    async with http.get(f"{url}/trajectories", params={"consumer": "check", "follow": "0"},
                        headers={"Authorization": f"Bearer {token}"}) as resp:
        assert resp.status == 200, await resp.text()
        return ndjson_trajectories(await resp.read())


async def metric(http: aiohttp.ClientSession, url: str, line_start: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    found = [ln for ln in text.splitlines() if ln.startswith(line_start)]
    return float(found[0].rsplit(" ", 1)[1]) if found else 0.0


async def until(check: Any, timeout_s: float = 60.0) -> Any:
    """Poll an async check until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def test_pending_finish_is_validated_held_released_defaulted_dropped_and_late(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    base = f"{proxy.url}/sessions"
    sessions = [await open_session(http, proxy) for _ in range(3)]
    for info in sessions:
        await model_calls(http, proxy, vllm_server, info, 1)
    sid = sessions[0]["id"]
    for bad in ({"deadline_s": 5}, {"on_deadline": 1.0}, {"reward": "pending", "deadline_s": 0},
                {"reward": "pending", "deadline_s": 1e12}, {"reward": "pending", "status": "aborted"},
                {"reward": "pending", "on_deadline": "keep"}, {"reward": "later"},
                b'{"reward": "pending", "on_deadline": NaN}'):
        got, err = await req(http, "POST", f"{base}/{sid}/finish", bad, proxy.control)
        assert got == 400, (bad, err)
    got, done = await req(http, "POST", f"{base}/{sid}/finish", {"reward": "pending", "deadline_s": 600},
                          proxy.control)
    assert got == 200 and done["reward_pending"]["on_deadline"] == "drop"
    assert done["reward_pending"]["deadline_at"] > time.time() + 500
    got, traj = await req(http, "GET", f"{base}/{sid}", None, proxy.control)
    assert got == 200 and "reward_pending" in traj and len(traj["steps"]) == 1
    assert sid not in [t["id"] for t in await stream_ids(http, proxy.url, proxy.token)]  # held back
    got, err = await req(http, "POST", f"{base}/{sid}/finish", {}, proxy.control)
    assert got == 409 and err["error"]["code"] == "session_closed"
    got, err = await req(http, "POST", f"{base}/{sid}/rewards", {"value": 1, "step": 0}, proxy.control)
    assert got == 400  # a pending reward is trajectory-level

    # The rating arrives: the trajectory streams, once, with the reward and where it came from
    got, out = await req(http, "POST", f"{base}/{sid}/rewards", {"value": 0.75, "source": "human"},
                         proxy.control)
    assert got == 200 and out["released"] is True
    streamed = [t for t in await stream_ids(http, proxy.url, proxy.token) if t["id"] == sid]
    assert len(streamed) == 1 and streamed[0]["rewards"] == {"reward": 0.75}
    assert streamed[0]["reward_sources"] == {"reward": "human"} and len(streamed[0]["steps"]) == 1
    # A second rating comes after the stream has it: recorded as late, counted, never streamed again
    got, out = await req(http, "POST", f"{base}/{sid}/rewards", {"value": 0.0}, proxy.control)
    assert got == 200 and out["late"] is True
    assert await metric(http, proxy.url, 'steptap_late_rewards_total{source="http"}') == 1.0
    assert [t["id"] for t in await stream_ids(http, proxy.url, proxy.token)].count(sid) == 1

    # The deadline's default value, and a drop
    defaulted, dropped = sessions[1]["id"], sessions[2]["id"]
    for s, on_deadline in ((defaulted, 0.25), (dropped, "drop")):
        body = {"reward": "pending", "deadline_s": 0.3, "on_deadline": on_deadline}
        got, _ = await req(http, "POST", f"{base}/{s}/finish", body, proxy.control)
        assert got == 200

    async def both_ended() -> bool:
        return (await metric(http, proxy.url, 'steptap_held_ended_total{outcome="dropped"}') == 1.0
                and await metric(http, proxy.url, 'steptap_held_ended_total{outcome="default"}') == 1.0)

    await until(both_ended)
    by_id = {t["id"]: t for t in await stream_ids(http, proxy.url, proxy.token)}
    assert by_id[defaulted]["rewards"] == {"reward": 0.25}
    assert by_id[defaulted]["reward_sources"] == {"reward": "default"}
    assert dropped not in by_id
    assert await metric(http, proxy.url, "steptap_held_trajectories ") == 0.0
    assert await metric(http, proxy.url, "steptap_session_bytes_held ") == 0.0  # what they held, given back


async def test_held_sessions_survive_sigkill_train_once_drop_never_and_export_with_provenance(
    vllm_server: Backend, tiny_model_dir: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    from steptap.adapters import export
    from steptap.learner import daemon
    from steptap.learner.config import config_from_argv

    proxy = ServeProcess(vllm_server.url, tmp_path / "log", tmp_path)
    await proxy.start()
    control = {"Authorization": f"Bearer {TOKEN}"}
    as_proxy = Proxy(url=proxy.url, token=TOKEN, app=None, server=None, log_dir=proxy.logdir)
    try:
        kept = [await open_session(http, as_proxy, group_id="kept", group_size=2) for _ in range(2)]
        gone = [await open_session(http, as_proxy, group_id="gone", group_size=2) for _ in range(2)]
        for info in kept + gone:
            await model_calls(http, as_proxy, vllm_server, info, 1)
        for info in kept:
            got, _ = await req(http, "POST", f"{proxy.url}/sessions/{info['id']}/finish",
                               {"reward": "pending", "deadline_s": 600}, control)
            assert got == 200
        for info in gone:
            got, _ = await req(http, "POST", f"{proxy.url}/sessions/{info['id']}/finish",
                               {"reward": "pending", "deadline_s": 1, "on_deadline": "drop"}, control)
            assert got == 200
        assert await stream_ids(http, proxy.url, TOKEN) == []  # all four held
        proxy.kill()  # SIGKILL: the held set lives only in the log now
        await asyncio.sleep(1.2)  # the drop deadline passes while the proxy is down
        await proxy.start()

        # Rebuilt: the kept ones still held (with their deadline), the expired ones dropped by the sweep
        for info in kept:
            got, traj = await req(http, "GET", f"{proxy.url}/sessions/{info['id']}", None, control)
            assert got == 200 and traj["reward_pending"]["on_deadline"] == "drop", traj
        assert await metric(http, proxy.url, "steptap_session_bytes_held ") > 0  # the held records count
        async def both_dropped() -> bool:
            return await metric(http, proxy.url, 'steptap_held_ended_total{outcome="dropped"}') == 2.0

        await until(both_dropped)
        assert await stream_ids(http, proxy.url, TOKEN) == []
        for info, value in zip(kept, (1.0, 0.0), strict=True):
            got, out = await req(http, "POST", f"{proxy.url}/sessions/{info['id']}/rewards", {"value": value},
                                 control)
            assert got == 200 and out["released"] is True

        metrics = tmp_path / "m.jsonl"
        await daemon._run(config_from_argv([
            "--proxy-url", proxy.url, "--control-token", TOKEN, "--model-dir", str(tiny_model_dir),
            "--batch-groups", "1", "--group-size", "2", "--push-every", "0", "--max-updates", "1",
            "--checkpoint-dir", str(tmp_path / "c"), "--metrics-file", str(metrics), "--no-progress",
            "--num-threads", "1"]))
        (row,) = [json.loads(x) for x in metrics.read_text().splitlines()]
        assert row["reward_mean"] == 0.5 and row["counts"]["trained_steps"] == 2

        # Killed again after the release: nothing is held or released twice
        proxy.kill()
        await proxy.start()
        assert await metric(http, proxy.url, "steptap_held_trajectories ") == 0.0
        assert await metric(http, proxy.url, "steptap_session_bytes_held ") == 0.0  # given back
        ids = [t["id"] for t in await stream_ids(http, proxy.url, TOKEN)]
        assert sorted(ids) == sorted(i["id"] for i in kept)  # each released once, the dropped never
        # A rating on a trajectory the learner trained: recorded, late, exported
        got, out = await req(http, "POST", f"{proxy.url}/sessions/{kept[0]['id']}/rewards",
                             {"value": -1.0, "source": "human"}, control)
        assert got == 200 and out["late"] is True
    finally:
        proxy.stop()

    out = tmp_path / "export"
    argv = ["--log", str(proxy.logdir), "--out", str(out), "--model-dir", str(tiny_model_dir)]
    assert export.main(argv) == 0
    import pyarrow.parquet as pq

    rows = pq.read_table(out).to_pylist()
    prov = provenance(tiny_model_dir)
    assert prov["model_hash"] and prov["tokenizer_hash"] and prov["chat_template_hash"]
    assert json.loads((out / "_provenance.json").read_text()) == prov
    assert {r["trajectory_id"] for r in rows} == {i["id"] for i in kept}
    for r in rows:
        assert (r["model_hash"], r["tokenizer_hash"], r["chat_template_hash"]) == (
            prov["model_hash"], prov["tokenizer_hash"], prov["chat_template_hash"])
        assert json.loads(r["reward_sources"]) == {"reward": "http"} and r["policy_version"] == 0
        late = json.loads(r["late_rewards"])
        if r["trajectory_id"] == kept[0]["id"]:
            assert [(x["value"], x["source"]) for x in late] == [(-1.0, "human")]
        else:
            assert late == []


async def test_a_held_session_outlives_the_closed_bookkeeping(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession, monkeypatch: Any
) -> None:
    """Closed ids and recent trajectories are bounded; a held one is still found, its id still taken."""
    from steptap.middleware.sessions import closing

    monkeypatch.setattr(closing, "RECENT_KEEP", 1)
    proxy = await make_proxy(vllm_server.url, max_closed_sessions=1)
    base = f"{proxy.url}/sessions"
    held = await open_session(http, proxy, id="held-x")
    await model_calls(http, proxy, vllm_server, held, 1)
    got, _ = await req(http, "POST", f"{base}/held-x/finish", {"reward": "pending"}, proxy.control)
    assert got == 200
    for _ in range(2):  # push it out of the recent trajectories and the closed ids
        other = await open_session(http, proxy)
        await req(http, "POST", f"{base}/{other['id']}/finish", {}, proxy.control)
    got, traj = await req(http, "GET", f"{base}/held-x", None, proxy.control)
    assert got == 200 and "reward_pending" in traj and len(traj["step_refs"]) == 1
    got, err = await req(http, "POST", base, {"id": "held-x"}, proxy.control)
    assert got == 409, err
    got, out = await req(http, "POST", f"{base}/held-x/rewards", {"value": 1.0}, proxy.control)
    assert got == 200 and out["released"] is True
    (streamed,) = [t for t in await stream_ids(http, proxy.url, proxy.token) if t["id"] == "held-x"]
    assert streamed["rewards"] == {"reward": 1.0} and len(streamed["steps"]) == 1
