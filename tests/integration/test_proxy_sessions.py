"""Sessions through the proxy, on the real server: identity by path, key and header, anonymous calls,
a multi-turn conversation with its prefix continuity, edited histories counted by cause, the official openai
client, concurrent calls on one session, and durability (every answered step is in the log)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy

from steptap.middleware.backend.pool import POOL_KEY
from steptap.middleware.delta import (
    full_steps,  # the session holds delta steps
    steps_of,
)
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.records import Step, Trajectory
from steptap.middleware.sessions.control import SESSIONS_KEY

pytestmark = pytest.mark.vllm


async def open_session(http: aiohttp.ClientSession, proxy: Proxy, **body: Any) -> dict[str, Any]:
    async with http.post(f"{proxy.url}/sessions", json=body, headers=proxy.control) as resp:
        assert resp.status == 201, await resp.text()
        return await resp.json()


async def get_session(http: aiohttp.ClientSession, proxy: Proxy, sid: str) -> dict[str, Any]:
    async with http.get(f"{proxy.url}/sessions/{sid}", headers=proxy.control) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def counter(proxy: Proxy, name: str, *labels: str) -> float:
    metric = getattr(proxy.app[METRICS_KEY], name)  # type: ignore[index]
    return metric.value(*labels)  # a Tally (metrics.py)


async def test_openai_client_three_turns_and_an_edited_history(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    import openai

    info = await open_session(http, proxy, group_id="g1", metadata={"task": "chat"})
    assert info["base_url"] == f"{proxy.url}/s/{info['id']}/v1" and info["api_key"].startswith("stk-")
    client = openai.AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    replies = []
    for turn, text in enumerate(["Hello there.", "Tell me more.", "And then?"]):
        messages.append({"role": "user", "content": text})
        if turn == 1:  # the middle turn streams: the SDK's stream path works unchanged too
            stream = await client.chat.completions.create(
                model=vllm_server.served_model, messages=messages, max_tokens=8, temperature=0, stream=True
            )
            content = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        else:
            reply = await client.chat.completions.create(
                model=vllm_server.served_model, messages=messages, max_tokens=8, temperature=0
            )
            content = reply.choices[0].message.content or ""
            assert not hasattr(reply,
                               "prompt_token_ids") or reply.prompt_token_ids is None  # type: ignore[attr-defined]
        replies.append(content)
        messages.append({"role": "assistant", "content": content})
    traj = await get_session(http, proxy, info["id"])
    steps = traj["steps"]
    assert [s["index"] for s in steps] == [0, 1, 2]
    assert [s["response"]["content"] for s in steps] == replies
    assert [s["request"]["messages"][-1]["content"] for s in steps] == [
        "Hello there.",
        "Tell me more.",
        "And then?",
    ]
    assert traj["group_id"] == "g1" and traj["metadata"] == {"task": "chat"} and traj["status"] == "running"
    assert steps[0]["prefix"] == "first"
    for prev, step in zip(steps, steps[1:], strict=False):
        # extends exactly when the ids continue token for token; otherwise the same messages re-rendered
        continues = step["prompt_token_ids"][
            : len(prev["prompt_token_ids"]) + len(prev["response_token_ids"])
        ] == (prev["prompt_token_ids"] + prev["response_token_ids"])
        assert step["prefix"] == ("extends" if continues else "rerendered")
        assert len(step["prompt_token_ids"]) > len(prev["prompt_token_ids"])
    print("prefix causes:", [s["prefix"] for s in steps])

    # Edit an earlier message: a break counted as history_edited
    edited = [dict(m) for m in messages]
    edited[1]["content"] = "Goodbye."
    edited.append({"role": "user", "content": "Again."})
    await client.chat.completions.create(
        model=vllm_server.served_model, messages=edited, max_tokens=4, temperature=0
    )
    # Drop history: truncated
    await client.chat.completions.create(
        model=vllm_server.served_model, messages=[messages[0], messages[-2]], max_tokens=4, temperature=0
    )
    await client.close()
    steps = (await get_session(http, proxy, info["id"]))["steps"]
    assert [s["prefix"] for s in steps[3:]] == ["history_edited", "truncated"]
    assert counter(proxy, "prefix", "history_edited") == 1 and counter(proxy, "prefix", "truncated") == 1
    async with http.get(f"{proxy.url}/metrics") as resp:
        text = await resp.text()
    assert 'steptap_prefix_steps_total{cause="history_edited"} 1.0' in text
    assert 'steptap_steps_total{anonymous="false",status="ok"} 5.0' in text


async def test_identity_by_key_header_and_anonymous(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    info = await open_session(http, proxy)
    body = {
        "model": vllm_server.served_model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    url = f"{proxy.url}/v1/chat/completions"
    key = {"Authorization": f"Bearer {info['api_key']}"}
    async with http.post(url, json=body, headers=key) as resp:
        assert resp.status == 200
    async with http.post(url, json=body, headers={"X-Steptap-Session": info["id"], **key}) as resp:
        assert resp.status == 200
    for key in (None, "EMPTY", "sk-abc"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        async with http.post(url, json=body, headers=headers) as resp:
            assert resp.status == 200
    async with http.post(url, json=body, headers={"Authorization": "Bearer stk-unknown"}) as resp:
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    assert len((await get_session(http, proxy, info["id"]))["steps"]) == 2
    assert counter(proxy, "sessions_opened", "true") == 3
    assert counter(proxy, "steps", "ok", "true") == 3
    await asyncio.sleep(0.2)  # anonymous sessions close in the background
    assert counter(proxy, "trajectories", "finished") == 3
    # each anonymous call is a one-step finished trajectory in the log
    records = list(proxy.app[SESSIONS_KEY].log.records())  # type: ignore[index]
    anon = [r for r in records if isinstance(r, Trajectory) and r.anonymous]
    assert len(anon) == 3 and all(len(t.steps) == 1 and t.status == "finished" for t in anon)
    # ... and its only record (schema v3): no Step record besides it; every step of the log found once
    assert not [r for r in records if isinstance(r, Step) and r.trajectory_id.startswith("anon-")]
    assert all(not t.steps_logged and t.steps[0].trajectory_id == t.id for t in anon)
    assert sorted(s.trajectory_id for s in steps_of(records)) == sorted(
        [info["id"]] * 2 + [t.id for t in anon])
    # one-step sessions hold no replica affinity (the pool's bounded map is for sessions that come back)
    pool = proxy.app[POOL_KEY]  # type: ignore[index]
    assert info["id"] in pool._sticky and not [sid for sid in pool._sticky if sid.startswith("anon-")]


async def test_concurrent_calls_on_one_session_get_consecutive_indexes(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    url = f"{proxy.url}/s/par/v1/chat/completions"

    async def one(i: int) -> str:
        body = {
            "model": vllm_server.served_model,
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 4,
            "temperature": 0,
            "stream": i % 2 == 0,
        }
        async with http.post(url, json=body) as resp:
            assert resp.status == 200
            return await resp.text()

    await asyncio.gather(*(one(i) for i in range(8)))
    steps = full_steps(proxy.app[SESSIONS_KEY].sessions["auto:par"].trajectory.steps)  # type: ignore[index]
    assert [s.index for s in steps] == list(range(8))
    assert sorted(s.request["messages"][0]["content"] for s in steps) == sorted(
        f"question {i}" for i in range(8)
    )
    # every answered step is durable in the log, in index order
    logged = [
        r
        for r in proxy.app[SESSIONS_KEY].log.records()  # type: ignore[index]
        if isinstance(r, Step) and r.trajectory_id == "auto:par"
    ]
    assert [s.index for s in logged] == list(range(8))
    assert [s.response_token_ids for s in logged] == [s.response_token_ids for s in steps]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_step_is_on_disk_when_its_reply_completes(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession, stream: bool
) -> None:
    log = proxy.app[SESSIONS_KEY].log  # type: ignore[index]
    for i in range(3):
        body = {
            "model": vllm_server.served_model,
            "messages": [{"role": "user", "content": f"q{i}"}],
            "max_tokens": 3,
            "stream": stream,
        }
        async with http.post(f"{proxy.url}/s/dur-{stream}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()  # the last byte ([DONE] when streamed) has arrived
        # read back from the segment files, not from memory
        on_disk = [r for r in log.records() if isinstance(r, Step)
                   and r.trajectory_id == f"auto:dur-{stream}"]
        assert [s.index for s in on_disk] == list(range(i + 1))
        assert on_disk[-1].request["messages"][0]["content"] == f"q{i}" and on_disk[-1].status == "ok"
