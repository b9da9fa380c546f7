"""Images through the proxy on the real vision vLLM (a tiny Qwen2-VL, ``steptap tiny-model --vision``): a
three-turn agent shows a new image each turn plus the old ones, through chat completions, Responses and
Messages. Each step names its images in prompt order, its prompt ids are vLLM's own for the same
conversation (its image placeholders expanded: one image token per 28x28 block), transformers recomputes its
logprobs from the recorded ids and the stored bytes (tests/vision.py's oracle), the logged request holds
references instead of the base64, and the log's image directory holds each distinct image once. The chat and
Responses agents send their third image as a URL the proxy fetches from a local image host."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from conftest import Backend, Proxy, http_json
from vision import png, vision_logprobs

from steptap.middleware.client import SteptapClient, SyncSteptapClient
from steptap.middleware.delta import full_steps
from steptap.middleware.log.images import IMAGES_DIR
from steptap.middleware.log.offline import LogReader
from steptap.middleware.records import Step, Trajectory, digest_of_ref, image_digest
from steptap.middleware.sessions.control import SESSIONS_KEY

pytestmark = pytest.mark.vllm

# Sides are multiples of 28 (patch 14, merge 2): no resize, and 1 image token per 28x28 block
SIZES = [(56, 56), (84, 56), (56, 112)]
IMAGES = [png(i + 1, size) for i, size in enumerate(SIZES)]
DIGESTS = [image_digest(b) for b in IMAGES]
TOKENS = [(w // 28) * (h // 28) for w, h in SIZES]  # image tokens each expands to


def image_token(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["image_token_id"])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def chat_turn(srcs: list[str], k: int) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": f"turn {k}: what is new?"},
                                        *({"type": "image_url", "image_url": {"url": s}} for s in srcs)]}


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, json=body) as resp:
        data = await resp.json(content_type=None)
        assert resp.status == 200, data
        return data  # type: ignore[no-any-return]


# Each agent returns, per turn, the conversation it sent as the chat messages it stands for (what vLLM is
# asked directly for its prompt ids)
async def _chat_agent(http: aiohttp.ClientSession, base: str, model: str, srcs: list[str]) -> list[list]:
    """Turn k shows image k; the history replays the earlier turns' images (the prompt shows 0..k)."""
    messages: list[dict[str, Any]] = []
    convos = []
    for k in range(3):
        messages.append(chat_turn([srcs[k]], k))
        body = {"model": model, "messages": messages, "max_tokens": 3, "temperature": 0}
        convos.append(list(messages))
        if k == 2:  # the last turn streamed: its step is captured from the SSE relay
            async with http.post(f"{base}/v1/chat/completions", json={**body, "stream": True}) as resp:
                events = (await resp.read()).decode()
                assert resp.status == 200 and events.rstrip().endswith("data: [DONE]"), events
            break
        reply = await _post(http, f"{base}/v1/chat/completions", body)
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""})
    return convos


async def _responses_agent(http: aiohttp.ClientSession, base: str, model: str, srcs: list[str]) -> list[list]:
    items: list[dict[str, Any]] = []
    convo: list[dict[str, Any]] = []
    convos = []
    for k in range(3):
        items.append({"role": "user", "content": [
            {"type": "input_text", "text": f"turn {k}: what is new?"},
            {"type": "input_image", "image_url": srcs[k]}]})
        convo.append(chat_turn([srcs[k]], k))
        reply = await _post(http, f"{base}/v1/responses", {"model": model, "input": items,
                                                           "max_output_tokens": 3, "temperature": 0})
        convos.append(list(convo))
        text = "".join(c.get("text", "") for o in reply["output"] if o["type"] == "message"
                       for c in o["content"])
        items.append({"role": "assistant", "content": [{"type": "output_text", "text": text}]})
        convo.append({"role": "assistant", "content": text})
    return convos


async def _messages_agent(http: aiohttp.ClientSession, base: str, model: str, srcs: list[str]) -> list[list]:
    turns: list[dict[str, Any]] = []
    convo: list[dict[str, Any]] = []
    convos = []
    for k in range(3):
        data = b64(IMAGES[k])
        turns.append({"role": "user", "content": [
            {"type": "text", "text": f"turn {k}: what is new?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]})
        convo.append(chat_turn([f"data:image/png;base64,{data}"], k))
        reply = await _post(http, f"{base}/v1/messages", {"model": model, "messages": turns, "max_tokens": 3,
                                                          "temperature": 0})
        convos.append(list(convo))
        text = "".join(b.get("text", "") for b in reply["content"] if b["type"] == "text") or "-"
        turns.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
        convo.append({"role": "assistant", "content": text})
    return convos


@pytest.mark.parametrize("agent", [_chat_agent, _responses_agent, _messages_agent])
async def test_three_turns_of_images_are_recorded_once_each_with_vllms_prompt_ids(
        agent: Any, make_proxy: Any, vision_vllm: Backend, http: aiohttp.ClientSession,
        aiohttp_server: Any) -> None:
    async def image(request: web.Request) -> web.Response:  # a real image host for the URL case
        return web.Response(body=IMAGES[2], content_type="image/png")

    host = web.Application()
    host.router.add_get("/shot.png", image)
    server = await aiohttp_server(host)
    url = str(server.make_url("/shot.png")).replace("localhost", "127.0.0.1")
    proxy: Proxy = await make_proxy(vision_vllm.url, image_urls=["127.0.0.1"])
    # chat and Responses fetch the third image from its URL; Messages sends all three as base64
    srcs = [f"data:image/png;base64,{b64(IMAGES[0])}", f"data:image/png;base64,{b64(IMAGES[1])}", url]
    base = f"{proxy.url}/s/vis-{agent.__name__.strip('_')}"
    convos = await agent(http, base, vision_vllm.served_model, srcs)

    log = proxy.app[SESSIONS_KEY].log  # type: ignore[attr-defined]
    steps = full_steps(r for r in log.records() if isinstance(r, Step))  # delta steps expanded
    assert [s.status for s in steps] == ["ok"] * 3, [s.error for s in steps]
    pad = image_token(vision_vllm.model_dir)
    for k, step in enumerate(steps):
        shown = list(range(k + 1))  # every turn replays the earlier turns' images
        assert [i.sha256 for i in step.images] == [DIGESTS[i] for i in shown]
        assert [(i.width, i.height, i.mime, i.size) for i in step.images] == [
            (*SIZES[i], "image/png", len(IMAGES[i])) for i in shown]
        assert step.prompt_token_ids.count(pad) == sum(TOKENS[i] for i in shown)
        logged = json.dumps(step.request)
        assert not any(b64(b) in logged for b in IMAGES) and url not in logged
        refs = [digest_of_ref(m) for m in logged.split('"') if m.startswith("steptap-image:")]
        assert refs and set(refs) <= set(DIGESTS)
        # vLLM's own prompt ids for the same conversation, sent straight to it with the same bytes
        direct = [{**m, "content": [
            {**p, "image_url": {"url": f"data:image/png;base64,{b64(IMAGES[2])}"}}
            if p.get("type") == "image_url" and p["image_url"]["url"] == url else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in convos[k]]
        ids = http_json(f"{vision_vllm.url}/v1/chat/completions", {
            "model": vision_vllm.served_model, "messages": direct, "max_tokens": 1,
            "return_token_ids": True})["prompt_token_ids"]
        assert step.prompt_token_ids == ids
        # the learner's view: transformers on the recorded ids and the stored bytes gives vLLM's logprobs
        shown_bytes = [(proxy.log_dir / IMAGES_DIR / i.sha256).read_bytes() for i in step.images]
        oracle = vision_logprobs(vision_vllm.model_dir, step.prompt_token_ids, step.response_token_ids,
                                 shown_bytes)
        assert step.response_logprobs == pytest.approx(oracle, abs=1e-4)
    # an anonymous call showing the first image again: named in its one record, not stored twice
    await _post(http, f"{proxy.url}/v1/chat/completions", {
        "model": vision_vllm.served_model, "messages": [chat_turn([srcs[0]], 0)], "max_tokens": 1})
    anonymous = [r for r in log.records() if isinstance(r, Trajectory) and r.anonymous]
    assert [[i.sha256 for i in s.images] for t in anonymous for s in t.steps] == [[DIGESTS[0]]]
    stored = {p.name: p.read_bytes() for p in (proxy.log_dir / IMAGES_DIR).iterdir()}
    assert stored == dict(zip(DIGESTS, IMAGES, strict=True))  # each distinct image once
    # readers resolve them: the proxy's route, both clients (the learner's resolve), the offline reader
    async with http.get(f"{proxy.url}/images/{DIGESTS[2]}", headers=proxy.control) as resp:
        assert resp.status == 200 and await resp.read() == IMAGES[2]
    async with SteptapClient(proxy.url, proxy.token) as client:
        assert await client.image(DIGESTS[0]) == IMAGES[0] and await client.image("0" * 64) is None
    resolve = SyncSteptapClient(proxy.url, proxy.token).image
    assert await asyncio.to_thread(resolve, DIGESTS[1]) == IMAGES[1]
    assert LogReader(str(proxy.log_dir)).image(DIGESTS[2]) == IMAGES[2]
    if agent is _chat_agent:  # `steptap export --proxy --images-dir`: rows name them, the folder holds them
        async with http.post(f"{proxy.url}/sessions/auto:vis-chat_agent/finish", json={"reward": 1.0},
                             headers=proxy.control) as resp:
            assert resp.status == 200, await resp.text()
        out, folder = proxy.log_dir.parent / "out", proxy.log_dir.parent / "images"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "steptap.middleware.cli", "export", "--proxy", proxy.url, "--out", str(out),
            "--images-dir", str(folder), env={**os.environ, "STEPTAP_CONTROL_TOKEN": proxy.token},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 300)
        assert proc.returncode == 0, stderr.decode()[-3000:]
        summary = json.loads(stdout.decode().strip().splitlines()[-1])
        assert summary["images"] == 3 and summary["images_missing"] == 0
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == dict(zip(DIGESTS, IMAGES, strict=True))
        rows = sorted((r for r in pq.read_table(out).to_pylist()
                       if r["trajectory_id"] == "auto:vis-chat_agent"), key=lambda r: r["step_index"])
        assert [[i["sha256"] for i in json.loads(r["images"])] for r in rows] == [
            DIGESTS[: k + 1] for k in range(3)]


async def test_a_computer_use_screenshot_in_a_tool_result_is_recorded(
        make_proxy: Any, vision_vllm: Backend, http: aiohttp.ClientSession) -> None:
    """Anthropic computer use: the screenshot comes back in a ``tool_result``; vLLM sees it (its pads in the
    prompt ids), the step names it, the oracle agrees."""
    proxy: Proxy = await make_proxy(vision_vllm.url)
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(IMAGES[1])}}
    await _post(http, f"{proxy.url}/s/computer/v1/messages", {
        "model": vision_vllm.served_model, "max_tokens": 3, "temperature": 0, "messages": [
            {"role": "user", "content": "click the button"},
            {"role": "assistant",
             "content": [{"type": "tool_use", "id": "c1", "name": "computer", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                          "content": [{"type": "text", "text": "done"}, shot]}]}]})
    log = proxy.app[SESSIONS_KEY].log  # type: ignore[attr-defined]
    [step] = full_steps(r for r in log.records() if isinstance(r, Step))
    assert step.status == "ok" and [i.sha256 for i in step.images] == [DIGESTS[1]]
    assert step.prompt_token_ids.count(image_token(vision_vllm.model_dir)) == TOKENS[1]
    assert b64(IMAGES[1]) not in json.dumps(step.request)
    oracle = vision_logprobs(vision_vllm.model_dir, step.prompt_token_ids, step.response_token_ids,
                             [IMAGES[1]])
    assert step.response_logprobs == pytest.approx(oracle, abs=1e-4)
