"""Pure capture functions: a streamed reply reassembles to the same steps as the non-streamed one, stripping
removes only what the agent did not ask for, and incomplete replies give failed steps, never silent ones."""

from __future__ import annotations

import copy
from typing import Any

import msgspec

from steptap.middleware.config import ProxyConfig
from steptap.middleware.proxy.accumulator import ChatStream, CompletionStream
from steptap.middleware.proxy.capture import (
    CHAT,
    COMPLETIONS,
    Asked,
    sampling_of,
    steps_from_reply,
    strip_chunk,
    strip_reply,
)
from steptap.middleware.proxy.relay import patch_request as _patch


def lp(*values: float) -> dict[str, Any]:
    return {"content": [{"token": "t", "logprob": v, "bytes": None, "top_logprobs": []} for v in values]}


CALL = {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
PLAIN = {
    "id": "x",
    "model": "m",
    "prompt_token_ids": [1, 2, 3],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi there", "reasoning": "think"},
            "logprobs": lp(-0.1, -0.2, -0.3),
            "finish_reason": "stop",
            "token_ids": [10, 11, 12],
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": None, "tool_calls": [CALL]},
            "logprobs": lp(-1.0, -2.0),
            "finish_reason": "tool_calls",
            "token_ids": [20, 21],
        },
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
}


def chunk(
    index: int,
    delta: dict[str, Any],
    ids: list[int] | None,
    lps: list[float] | None,
    finish: str | None = None,
    **top: Any,
) -> dict[str, Any]:
    return {
        "id": "x",
        "model": "m",
        **top,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if lps is None else lp(*lps),
                "finish_reason": finish,
                "token_ids": ids,
            }
        ],
    }


STREAM = [
    chunk(0, {"role": "assistant", "content": ""}, None, None, prompt_token_ids=[1, 2, 3]),
    chunk(1, {"role": "assistant", "content": ""}, None, None),
    chunk(0, {"reasoning": "think"}, [10], [-0.1]),
    chunk(1, {}, [20], [-1.0]),  # the tool parser held this token back: only ids and logprobs
    chunk(0, {"content": "Hi"}, [11], [-0.2]),
    chunk(
        1,
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a"'},
                }
            ]
        },
        [21],
        [-2.0],
    ),
    chunk(1, {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, [], [], "tool_calls"),
    chunk(0, {"content": " there"}, [12], [-0.3], "stop"),
    {"id": "x", "model": "m", "choices": [], "usage": PLAIN["usage"]},
]


def test_streamed_chunks_give_the_same_steps_as_the_plain_reply() -> None:
    acc = ChatStream()
    for c in STREAM:
        acc.feed(c)
    plain = steps_from_reply(PLAIN, CHAT, request={"messages": []})
    streamed = steps_from_reply(acc.reply(), CHAT, request={"messages": []})
    assert msgspec.to_builtins(plain) == msgspec.to_builtins(streamed)
    first, second = plain
    assert first.response == {"role": "assistant", "content": "Hi there", "reasoning_content": "think"}
    assert second.response["tool_calls"] == [CALL] and second.choice == 1
    assert first.response_logprobs == [-0.1, -0.2, -0.3] and first.usage.total_tokens == 6
    assert all(s.status == "ok" for s in plain)


def test_long_streams_accumulate_in_place() -> None:
    # One token per chunk, as vLLM streams: rebuilding the accumulated lists per chunk made 8k tokens cost
    # ~0.5 s (quadratic). What makes it linear is exactly true and checkable without a clock: the lists that
    # hold the ids, logprobs and text pieces are extended in place, never rebuilt.
    n = 8000
    acc = ChatStream()
    acc.feed(chunk(0, {"role": "assistant", "content": ""}, None, None, prompt_token_ids=[1]))
    acc.feed(chunk(0, {"content": "x"}, [0], [-0.5]))
    first = acc.choices[0]
    held = (first.token_ids, first.logprobs, first.content)
    for i in range(1, n):
        acc.feed(chunk(0, {"content": "x"}, [i], [-0.5]))
    assert acc.choices[0] is first
    assert (first.token_ids, first.logprobs, first.content) == held
    assert all(a is b for a, b in zip((first.token_ids, first.logprobs, first.content), held, strict=False))
    (step,) = steps_from_reply(acc.reply(), CHAT, request={"messages": []})
    assert step.response_token_ids == list(range(n)) and len(step.response_logprobs) == n


def test_completion_stream_reassembles() -> None:
    plain = {
        "choices": [
            {
                "index": 0,
                "text": "ab",
                "prompt_token_ids": [1, 2],
                "token_ids": [3, 4],
                "logprobs": {"token_logprobs": [-0.5, -0.25]},
                "finish_reason": "length",
            }
        ]
    }
    acc = CompletionStream()
    acc.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "a",
                    "prompt_token_ids": [1, 2],
                    "token_ids": [3],
                    "logprobs": {"token_logprobs": [-0.5]},
                    "finish_reason": None,
                }
            ]
        }
    )
    acc.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "b",
                    "token_ids": [4],
                    "logprobs": {"token_logprobs": [-0.25]},
                    "finish_reason": "length",
                }
            ]
        }
    )
    a, b = steps_from_reply(plain, COMPLETIONS), steps_from_reply(acc.reply(), COMPLETIONS)
    assert msgspec.to_builtins(a) == msgspec.to_builtins(b)
    assert a[0].response == {"text": "ab"} and a[0].prompt_token_ids == [1, 2]


def test_missing_ids_or_misaligned_logprobs_give_failed_steps() -> None:
    reply = copy.deepcopy(PLAIN)
    reply["prompt_token_ids"] = None
    assert {s.status for s in steps_from_reply(reply, CHAT)} == {"failed"}
    reply = copy.deepcopy(PLAIN)
    reply["choices"][0]["logprobs"] = lp(-0.1)
    first, second = steps_from_reply(reply, CHAT)
    assert (
        first.status == "failed"
        and "1 logprobs for 3 tokens" in first.error.message
        and second.status == "ok"
    )


def test_strip_keeps_what_was_asked_and_nulls_the_rest() -> None:
    reply = copy.deepcopy(PLAIN)
    strip_reply(reply, Asked(token_ids=False, logprobs=False), CHAT)
    assert reply["prompt_token_ids"] is None
    assert all(c["token_ids"] is None and c["logprobs"] is None for c in reply["choices"])
    assert (
        reply["choices"][0]["message"] == PLAIN["choices"][0]["message"] and reply["usage"] == PLAIN["usage"]
    )
    reply = copy.deepcopy(PLAIN)
    strip_reply(reply, Asked(token_ids=True, logprobs=False), CHAT)
    assert reply["prompt_token_ids"] == [1, 2, 3] and reply["choices"][0]["logprobs"] is None
    reply = copy.deepcopy(PLAIN)
    strip_reply(reply, Asked(token_ids=False, logprobs=True), CHAT)
    assert (
        reply["choices"][0]["token_ids"] is None
        and reply["choices"][0]["logprobs"] == PLAIN["choices"][0]["logprobs"]
    )


def test_chunks_only_carrying_ids_are_dropped_unless_asked() -> None:
    nothing = Asked(False, False)
    held = copy.deepcopy(STREAM[3])
    assert not strip_chunk(held, nothing, CHAT)
    assert strip_chunk(copy.deepcopy(STREAM[3]), Asked(True, False), CHAT)
    assert strip_chunk(copy.deepcopy(STREAM[4]), nothing, CHAT)
    final = chunk(0, {}, [2], [-0.1], "stop")
    assert strip_chunk(final, nothing, CHAT) and final["choices"][0]["token_ids"] is None
    assert strip_chunk(copy.deepcopy(STREAM[-1]), nothing, CHAT)  # the usage chunk


def test_patch_adds_our_keys_and_keeps_unknown_fields() -> None:
    cfg = ProxyConfig(backend="http://x")
    body = {
        "model": "gpt-4o",
        "messages": [],
        "vendor_field": {"x": [1]},
        "logprobs": False,
        "temperature": 0.3,
    }
    out, asked = _patch(body, CHAT, "tiny", cfg, {})
    assert out["vendor_field"] == {"x": [1]} and out["return_token_ids"] is True and out["logprobs"] is True
    assert out["model"] == "tiny" and body["model"] == "gpt-4o" and "return_token_ids" not in body
    assert asked == Asked(False, False)
    out, asked = _patch({"prompt": "x", "logprobs": 2}, COMPLETIONS, "tiny", cfg, {})
    assert out["logprobs"] == 2 and asked == Asked(False, True) and "model" not in out
    out, _ = _patch({"prompt": "x"}, COMPLETIONS, "tiny", cfg, {})
    assert out["logprobs"] == 0
    forced = ProxyConfig(backend="http://x", force_sampling={"temperature": 1.0, "top_p": 1.0})
    out, _ = _patch(body, CHAT, "tiny", forced, forced.force_sampling)
    assert out["temperature"] == 1.0 and out["top_p"] == 1.0
    s = sampling_of(out, True)
    assert (s.temperature, s.top_p, s.top_k, s.forced) == (1.0, 1.0, -1, True)
    s = sampling_of({"temperature": 0, "top_k": 5, "max_completion_tokens": 9}, False)
    assert (s.temperature, s.top_k, s.max_tokens, s.forced) == (0.0, 5, 9, False)
