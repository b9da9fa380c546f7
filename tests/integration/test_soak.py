"""Soak: 1,000 sessions open at once, several steps each, through one proxy. Volume comes from the replay
upstream (bench/replay_upstream.py: recorded vLLM replies, instant), a sample goes through the real vLLM
server. Every step and trajectory is accounted for in the delivered stream, and the proxy's own gauges
(sessions open, steps and bytes held, calls in flight), sampled all along, stay within their configured caps.
RSS is printed, not asserted."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy, ndjson_trajectories

from steptap.middleware.sessions.control import SESSIONS_KEY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from recorded import DEFAULT_FIXTURE, load  # noqa: E402
from replay_upstream import create_app as replay_app  # noqa: E402

pytestmark = pytest.mark.vllm

SESSIONS, STEPS = 1000, 3
CAPS = dict(max_open_sessions=SESSIONS, max_session_steps=STEPS, max_session_bytes=256 * 1024,
            max_concurrent_calls=256)
CLIENT_CONNECTIONS = 200  # below max_concurrent_calls: every call is admitted, so counts are exact


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _delivered(http: aiohttp.ClientSession, proxy: Proxy) -> dict[str, dict[str, Any]]:
    async with http.get(
        f"{proxy.url}/trajectories", params={"consumer": "soak", "follow": "0"}, headers=proxy.control
    ) as resp:
        assert resp.status == 200
        return {t["id"]: t for t in ndjson_trajectories(await resp.read())}


async def _run_sessions(
    proxy: Proxy, model: str, body: dict[str, Any], sessions: int, steps: int
) -> tuple[dict[str, int], list[tuple[int, str]]]:
    """Open ``sessions`` sessions, then drive them all at once: ``steps`` calls each (plain and streamed), a
    step reward, one call past the step cap (409), and finish. Returns the steps answered per session and
    every unexpected (status, text)."""
    answered: dict[str, int] = {}
    bad: list[tuple[int, str]] = []
    conn = aiohttp.TCPConnector(limit=CLIENT_CONNECTIONS)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as http:
        infos = []
        for _ in range(sessions):
            async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
                assert resp.status == 201
                infos.append(await resp.json())
        manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
        assert len(manager.sessions) == sessions

        async def one(info: dict[str, Any]) -> None:
            headers = {"Authorization": f"Bearer {info['api_key']}"}
            url = f"{info['base_url']}/chat/completions"
            for i in range(steps + 1):
                stream = i % 2 == 1
                async with http.post(url, json={**body, "model": model, "stream": stream},
                                     headers=headers) as r:
                    text = await r.text()
                    expected = 200 if i < steps else 409  # the call past the cap is refused
                    if r.status != expected or (r.status == 200 and stream and "data: [DONE]" not in text):
                        bad.append((r.status, text[:200]))
                    elif r.status == 200:
                        answered[info["id"]] = answered.get(info["id"], 0) + 1
            for path, payload in (("rewards", {"value": 1.0, "step": "last"}), ("finish", {"reward": 0.5})):
                async with http.post(f"{proxy.url}/sessions/{info['id']}/{path}", json=payload,
                                     headers=proxy.control) as r:
                    if r.status != 200:
                        bad.append((r.status, (await r.text())[:200]))

        await asyncio.gather(*(one(info) for info in infos))
    return answered, bad


async def test_a_thousand_concurrent_sessions_are_all_accounted_for_within_caps(
    make_proxy: Any, aiohttp_server: Any, vllm_server: Backend, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    fixture = load(DEFAULT_FIXTURE)
    replay = await aiohttp_server(replay_app(fixture))
    proxy = await make_proxy(str(replay.make_url("")).rstrip("/"), **CAPS)
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    peaks = {"sessions": 0, "steps": 0, "bytes": 0, "calls": 0}
    stop = asyncio.Event()

    async def sample() -> None:  # the gauges, as /metrics would show them, every few ms
        while not stop.is_set():
            peaks["sessions"] = max(peaks["sessions"], len(manager.sessions))
            peaks["steps"] = max(peaks["steps"], manager.steps_held)
            peaks["bytes"] = max(peaks["bytes"], manager.bytes_held)
            peaks["calls"] = max(peaks["calls"], manager.calls_inflight)
            await asyncio.sleep(0.005)

    rss0 = _rss_mib()
    sampler = asyncio.ensure_future(sample())
    answered, bad = await _run_sessions(proxy, fixture.served_model, fixture.agent_request, SESSIONS, STEPS)
    stop.set()
    await sampler
    assert bad == []
    assert len(answered) == SESSIONS and set(answered.values()) == {STEPS}
    got = await _delivered(http, proxy)
    assert set(got) == set(answered)  # every trajectory delivered, once
    for sid, traj in got.items():
        assert [s["index"] for s in traj["steps"]] == list(range(STEPS)), sid
        assert traj["status"] == "finished" and traj["rewards"] == {"reward": 0.5}
        assert traj["steps"][-1]["rewards"] == {"reward": 1.0}
    assert peaks["sessions"] <= CAPS["max_open_sessions"]
    assert peaks["steps"] <= peaks["sessions"] * CAPS["max_session_steps"]
    assert 0 < peaks["bytes"] <= peaks["sessions"] * CAPS["max_session_bytes"]
    assert 0 < peaks["calls"] <= CLIENT_CONNECTIONS <= CAPS["max_concurrent_calls"]
    assert (manager.steps_held, manager.bytes_held, manager.calls_inflight, len(manager.sessions)) == (0, 0,
                                                                                                       0, 0)
    print(f"peaks {peaks}; RSS {rss0:.0f} -> {_rss_mib():.0f} MiB (test process: client, proxy, upstream)")

    # a sample on the real stack: same accounting
    real = await make_proxy(vllm_server.url, log_dir=tmp_path / "real-log",
                            **{**CAPS, "max_session_steps": 2})
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answered, bad = await _run_sessions(real, vllm_server.served_model, body, 8, 2)
    assert bad == [] and set(answered.values()) == {2} and len(answered) == 8
    got = await _delivered(http, real)
    assert set(got) == set(answered) and all(len(t["steps"]) == 2 for t in got.values())
