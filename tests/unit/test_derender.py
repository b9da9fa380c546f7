"""What a TITO turn sends vLLM's derender route (``proxy/derender.py``): the chat request cut to what derender
reads, streamed chunks merged, the end token left out."""

from __future__ import annotations

from typing import Any

from steptap.middleware.proxy import derender


def _call(i: int) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": f'{{"a": {i}}}'}}


def test_chat_request_keeps_the_options_and_the_history_tool_calls_only() -> None:
    chat = {"model": "m", "tools": [{"type": "function", "function": {"name": "add"}}], "tool_choice": "auto",
            "chat_template_kwargs": {"enable_thinking": False}, "skip_special_tokens": False,
            "messages": [{"role": "system", "content": "s" * 1000},
                         {"role": "user", "content": "u" * 1000},
                         {"role": "assistant", "content": "thinking", "tool_calls": [_call(1), _call(2)]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "3"},
                         {"role": "assistant", "content": "no call"},
                         {"role": "assistant", "tool_calls": [_call(3)]},
                         {"role": "user", "content": "more"}]}
    cut = derender.chat_request(chat)
    options = {k: v for k, v in chat.items() if k != "messages"}
    assert {k: v for k, v in cut.items() if k != "messages"} == options
    # vLLM counts the history's tool calls over the assistant messages (Kimi-K2-style ids number them)
    assert sum(len(m.get("tool_calls") or ()) for m in cut["messages"] if m["role"] == "assistant") == 3
    assert [c["id"] for m in cut["messages"] for c in m["tool_calls"]] == ["call_1", "call_2", "call_3"]
    assert all(m["content"] is None for m in cut["messages"])
    assert chat["messages"][2]["content"] == "thinking"  # the agent's body is not changed
    assert derender.chat_request({**chat, "messages": []})["messages"] == []
    assert derender.chat_request({"model": "m"}) == {"model": "m"}
    # for vLLM's chat route on ids: the last message too (its role, without a generation prompt), once
    routed = derender.chat_request(chat, last=True)["messages"]
    assert routed[:-1] == cut["messages"] and routed[-1] is chat["messages"][-1]
    ends_on_a_call = {**chat, "messages": chat["messages"][:-1]}
    assert derender.chat_request(ends_on_a_call, last=True)["messages"] == cut["messages"]
    assert derender.chat_request({**chat, "messages": []}, last=True)["messages"] == []


def _chunk(ids: list[int], finish: str | None = None, versions: Any = None) -> dict[str, Any]:
    return {"request_id": "r", "usage": None, "choices": [
        {"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": None,
         "weight_versions": versions,
         "logprobs": {"content": [{"token_id": t, "logprob": -t / 10} for t in ids]}}]}


def test_merge_joins_ids_and_logprobs_in_order_and_keeps_the_last_chunks_ending() -> None:
    one = _chunk([5])
    assert derender.merge([one]) is one
    versions = [{"version": "default", "start": 0, "end": 4}]
    merged = derender.merge([_chunk([5]), _chunk([6, 7]), _chunk([8], "stop", versions)])
    (choice,) = merged["choices"]
    assert choice["token_ids"] == [5, 6, 7, 8]
    assert [x["token_id"] for x in choice["logprobs"]["content"]] == [5, 6, 7, 8]
    assert [x["logprob"] for x in choice["logprobs"]["content"]] == [-0.5, -0.6, -0.7, -0.8]
    assert (choice["finish_reason"], choice["weight_versions"]) == ("stop", versions)
    plain = [{"choices": [{"index": 0, "token_ids": [1], "finish_reason": None}]},
             {"choices": [{"index": 0, "token_ids": [2], "finish_reason": "length"}]}]
    merged = derender.merge(plain)
    assert merged["choices"][0] == {"index": 0, "token_ids": [1, 2], "finish_reason": "length"}


def test_without_eos_leaves_out_the_token_that_ended_a_stopped_choice_only() -> None:
    stopped = derender.without_eos(_chunk([5, 6, 2], "stop"))["choices"][0]
    assert stopped["token_ids"] == [5, 6] and len(stopped["logprobs"]["content"]) == 2
    cut = derender.without_eos(_chunk([5, 6, 7], "length"))["choices"][0]
    assert cut["token_ids"] == [5, 6, 7]
    by_string = _chunk([5, 6], "stop")
    by_string["choices"][0]["stop_reason"] = "END"
    assert derender.without_eos(by_string)["choices"][0]["token_ids"] == [5, 6]


def test_the_chat_route_takes_the_ids_only_where_vllm_would_not_render_instead() -> None:
    # vLLM ignores kv_transfer_params.prompt_token_ids (and renders) when echo is set or a message holds
    # non-text content: such streamed turns keep generate + derender, so the ids are never silently dropped
    text = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "u"}]},
            {"role": "assistant", "content": None, "tool_calls": [_call(1)]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"text": "3"}]}]
    assert derender.takes_ids({"messages": text})
    assert not derender.takes_ids({"messages": text, "echo": True})
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    assert not derender.takes_ids({"messages": [*text, {"role": "user", "content": [image]}]})
    # a text part with a media key, or a part of an unknown type, counts as non-text (vLLM's own rule)
    assert not derender.takes_ids({"messages": [{"role": "user", "content": [{"type": "text", "text": "u",
                                                                              "image_url": "x"}]}]})
    assert not derender.takes_ids({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})
    assert not derender.takes_ids({"messages": [{"role": "user", "content": ["not a part"]}]})
