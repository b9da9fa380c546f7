"""The pure translations behind /v1/responses and /v1/messages, and TITO's append-only decision (no
server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steptap.middleware.errors import ApiError
from steptap.middleware.proxy import messages, messages_request, responses, tito, tito_plan
from steptap.middleware.proxy.responses_request import to_chat as responses_to_chat
from steptap.middleware.proxy.translation import MAX_NOTES, call_arguments, take_handles
from steptap.middleware.records import Step

FIXTURES = Path(__file__).parent.parent / "fixtures"

CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
CHAT_REPLY = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Let me add.", "tool_calls": [CALL]},
                 "finish_reason": "tool_calls", "stop_reason": None, "token_ids": [5, 6, 7]}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 3}, "prompt_token_ids": list(range(10)),
}


def test_responses_input_items_become_chat_messages() -> None:
    chat = responses_to_chat({"model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
    ], "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
                              "tool_choice": "auto"},
        [])
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [CALL]},  # the call joins its message
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    assert chat["max_tokens"] == 9 and chat["tool_choice"] == "auto"
    assert chat["tools"] == [{"type": "function", "function": {"name": "add",
                                                               "parameters": {"type": "object"}}}]


def test_a_response_sent_back_as_input_is_the_same_chat_message() -> None:
    shape = responses.Shape({"model": "m", "input": "x"}, "m")
    response, assistant = shape.from_chat(CHAT_REPLY)
    assert [item["type"] for item in response["output"]] == ["message", "function_call"]
    assert assistant == {"role": "assistant", "content": "Let me add.", "tool_calls": [CALL]}
    again = responses.input_messages([{**item, "role": "assistant"} if item["type"] == "message" else item
                                      for item in response["output"]])
    assert again == [assistant]
    assert response["usage"]["input_tokens"] == 10 and response["usage"]["output_tokens"] == 3


def test_responses_stream_events_are_ordered_and_complete() -> None:
    events = responses.EventStream(responses.Shape({"model": "m", "input": "x"}, "m"))
    raw = events.start() + events.feed({"choices": [{"index": 0, "delta": {"content": "Let me add."}}]})
    tail, response, _ = events.finish(CHAT_REPLY)
    parsed = [json.loads(block.split(b"\ndata: ", 1)[1]) for block in (raw + tail).split(b"\n\n") if block]
    assert [e["type"] for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    assert parsed[-1]["response"]["output"][1]["arguments"] == '{"a": 2, "b": 3}'


@pytest.mark.parametrize("body", [
    {"model": "m"}, {"input": 3}, {"input": [{"type": "item_reference", "id": "x"}]},
    {"input": "x", "tools": [{"type": "function"}]}, {"input": "x", "max_output_tokens": 0},
    {"input": "x", "background": True}, {"input": "x", "conversation": "conv_1"},
    {"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
    {"input": "x", "tools": [{"type": "function", "name": "ns.f"},
                             {"type": "namespace", "name": "ns",
                              "tools": [{"type": "function", "name": "f"}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
])
def test_responses_bodies_it_cannot_serve_are_400(body: dict) -> None:
    with pytest.raises(ApiError) as err:
        responses_to_chat(body, [])
    assert err.value.status == 400


def test_response_store_is_per_session_and_bounded() -> None:
    store = responses.ResponseStore(max_entries=2)
    store.put("s1", "r1", [{"role": "user", "content": "a"}])
    assert store.history("s1", "r1") == [{"role": "user", "content": "a"}]
    with pytest.raises(ApiError):
        store.history("s2", "r1")  # another session's response
    store.put("s1", "r2", [])
    store.put("s1", "r3", [])
    with pytest.raises(ApiError):
        store.history("s1", "r1")  # evicted, least recently used first


def test_anthropic_blocks_become_chat_messages() -> None:
    chat = messages_request.to_chat({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "S"}],
                             "stop_sequences": ["END"], "tool_choice": {"type": "any"},
                             "tools": [{"name": "add", "input_schema": {"type": "object"}}], "messages": [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me add."},
                                          {"type": "tool_use", "id": "call_1", "name": "add",
                                           "input": {"a": 2, "b": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "5"},
                                     {"type": "text", "text": "go on"}]},
    ]})
    assert chat["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "S"}]}, {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}, {"role": "user", "content": "go on"},
    ]
    assert chat["stop"] == ["END"] and chat["tool_choice"] == "required" and chat["max_tokens"] == 5


def test_anthropic_reply_and_stop_reasons() -> None:
    shape = messages.Shape({"stop_sequences": ["END"]}, "m")
    reply = shape.from_chat(CHAT_REPLY)
    assert reply["content"] == [{"type": "text", "text": "Let me add."},
                                {"type": "tool_use", "id": "call_1", "name": "add",
                                 "input": {"a": 2, "b": 3}}]
    assert reply["stop_reason"] == "tool_use"
    stopped = {"choices": [{"message": {"content": "x"}, "finish_reason": "stop", "stop_reason": "END"}]}
    assert shape.from_chat(stopped)["stop_reason"] == "stop_sequence"
    assert shape.from_chat(stopped)["stop_sequence"] == "END"
    cut = {"choices": [{"message": {"content": "x"}, "finish_reason": "length"}]}
    assert shape.from_chat(cut)["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "x"}]}, {"max_tokens": 5, "messages": []},
    {"max_tokens": 5, "messages": [{"role": "developer", "content": "x"}]},
    {"max_tokens": 5, "messages": [{"role": "system", "content": [{"type": "image", "source": {}}]}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"},
])
def test_anthropic_bodies_it_cannot_serve_are_400(body: dict) -> None:
    with pytest.raises(ApiError) as err:
        messages_request.to_chat(body)
    assert err.value.status == 400
    assert json.loads(messages.error_body(400, "m")) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "m"}}


TITLE_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"],
                "additionalProperties": False}


def test_structured_output_formats_become_vllms_json_schema_grammar() -> None:
    """Claude Code's title calls ask for JSON (``output_config.format``, as its binary builds them; the older
    ``output_format``): a grammar on a local model too, not dropped."""
    base = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "<session>fix it"}]}
    want = {"type": "json_schema", "json_schema": {"name": "output", "schema": TITLE_SCHEMA}}
    for extra in ({"output_config": {"format": {"type": "json_schema", "schema": TITLE_SCHEMA}}},
                  {"output_format": {"type": "json_schema", "schema": TITLE_SCHEMA}}):
        body = {**base, **extra}
        assert messages_request.to_chat(body)["response_format"] == want
        assert messages_request.dropped(body) == []
    fmt = {"type": "json_schema", "schema": TITLE_SCHEMA}
    both = {**base, "output_config": {"effort": "low", "format": fmt}}
    assert messages_request.to_chat(both)["response_format"] == want
    assert messages_request.dropped(both) == [("output_config.effort", "output_config.effort")]
    for bad in ({"type": "json_schema"}, {"type": "text"}, "json"):
        with pytest.raises(ApiError) as err:
            messages_request.to_chat({**base, "output_config": {"format": bad}})
        assert "output_config.format" in err.value.message


def test_claude_code_first_call_translates() -> None:
    """Claude Code 2.1.197's first call (captured, texts shortened): system blocks with its billing header and
    cache_control, a system message after the first user message, adaptive thinking, context_management and
    output_config. It used to be a 400 at messages[1]."""
    body = json.loads((FIXTURES / "claude_code_messages.json").read_text())
    chat = messages_request.to_chat(body)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "system"]
    system = chat["messages"][0]["content"]
    assert [p["type"] for p in system] == ["text"] * len(body["system"])  # parts: vLLM drops the billing line
    assert system[0]["text"].startswith("x-anthropic-billing-header")
    assert "cache_control" not in json.dumps(chat)
    assert messages_request.has_mid_system(chat)
    assert [f for f, _ in messages_request.dropped(body)] == [
        "thinking", "context_management", "output_config.effort"]
    assert "response_format" not in chat
    assert chat["max_tokens"] == body["max_tokens"] and chat["stream"] is True
    assert [t["function"]["name"] for t in chat["tools"]] == [t["name"] for t in body["tools"]]
    # count_tokens bodies carry no max_tokens
    count = messages_request.to_chat({k: v for k, v in body.items() if k != "max_tokens"}, count_only=True)
    assert count["messages"] == chat["messages"]


def test_server_tools_are_dropped_and_noted_and_every_label_is_bounded() -> None:
    """A server tool (Claude Code's web search sub-call offers ``web_search_20250305``) is not offered to the
    model and is noted, never a 400; a ``tool_choice`` naming it goes with it. Unknown keys are noted by name
    but counted as "other": an agent cannot grow the metric's label set (each label is a series kept)."""
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}
    read = {"name": "Read", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "search it"}],
            "tools": [search], "tool_choice": {"type": "tool", "name": "web_search"}}
    chat = messages_request.to_chat(body)
    assert "tools" not in chat and "tool_choice" not in chat
    assert messages_request.dropped(body) == [("tools[0] (type 'web_search_20250305')", "tools:web_search"),
                                      ("tool_choice", "tool_choice")]
    auto = {**body, "tool_choice": {"type": "auto"}}  # no tool left to choose among: vLLM would refuse it
    assert "tool_choice" not in messages_request.to_chat(auto)
    assert ("tool_choice", "tool_choice") in messages_request.dropped(auto)
    mixed = {**body, "tools": [read, search, {"type": "bash_20250124", "name": "bash"},
                               {"type": "zz_custom_thing", "name": "z"}], "tool_choice": {"type": "any"}}
    chat = messages_request.to_chat(mixed)
    assert [t["function"]["name"] for t in chat["tools"]] == ["Read"] and chat["tool_choice"] == "required"
    labels = [label for _, label in messages_request.dropped(mixed)]
    assert labels == ["tools:web_search", "tools:bash", "tools:other"]
    many = {"max_tokens": 1, **{f"unknown_{i}": i for i in range(1000)}}
    drops = messages_request.dropped(many)
    assert len(drops) == MAX_NOTES + 1 and drops[0] == ("unknown_0", "other")
    assert drops[-1] == ("...", "other")
    assert {label for _, label in drops} == {"other"}


def test_thinking_blocks_replay_as_reasoning() -> None:
    chat = messages_request.to_chat({"max_tokens": 5, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "let me ", "signature": "sig1"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "thinking", "thinking": "think", "signature": "sig2"},
            {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": [{"type": "text", "text": "more",
                                      "cache_control": {"type": "ephemeral"}}]}]})
    # the first signature goes beside the chat body (a handle, if the proxy made it: tito.py judges it)
    assert take_handles(chat["messages"]) == {0: "sig1"}
    assert chat["messages"][1] == {"role": "assistant", "content": "a", "reasoning": "let me think"}
    assert messages_request.dropped({"thinking": {"type": "disabled"}, "metadata": {}, "max_tokens": 1}) == []
    enabled = {"thinking": {"type": "enabled", "budget_tokens": 10}}
    assert messages_request.dropped(enabled) == [("thinking", "thinking")]


def test_fold_system_into_the_next_user_turn() -> None:
    folded = messages_request.fold_system([
        {"role": "system", "content": "top"}, {"role": "user", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "s1"}, {"type": "text", "text": "s2"}]},
        {"role": "assistant", "content": "x"}, {"role": "user", "content": "b"},
        {"role": "system", "content": "last"}])
    assert folded == [{"role": "system", "content": "top"}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "x"}, {"role": "user", "content": "s1\ns2\n\nb"},
                      {"role": "user", "content": "last"}]


def test_models_in_anthropic_shape() -> None:
    body = messages.models_body({"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0}]})
    assert body == {"data": [{"type": "model", "id": "tiny", "display_name": "tiny",
                              "created_at": "1970-01-01T00:00:00Z"}],
                    "has_more": False, "first_id": "tiny", "last_id": "tiny"}
    assert messages.is_anthropic_client({"anthropic-version": "2023-06-01"})
    assert not messages.is_anthropic_client({"authorization": "Bearer x"})


def _state(chat: dict, finish: str = "stop") -> tito_plan.State | None:
    step = Step(prompt_token_ids=[1, 2], response_token_ids=[3, 4], finish_reason=finish,
                response={"role": "assistant", "content": "hi"})
    return tito_plan.next_state(chat, step)


def test_tito_extends_only_append_only_histories() -> None:
    first = {"messages": [{"role": "user", "content": "a"}]}
    state = _state(first)
    history = [*first["messages"], {"role": "assistant", "content": "hi"}]
    assert tito_plan.plan(None, first).cause == "first"
    go = tito_plan.plan(state, {"messages": [*history, {"role": "user", "content": "b"}]})
    assert go.cause == "tokens" and go.new == [{"role": "user", "content": "b"}]
    assert tito_plan.plan(state, {"messages": [{"role": "user", "content": "A"}, history[1],
                                          {"role": "user", "content": "b"}]}).cause == "history_edited"
    assert tito_plan.plan(state, {"messages": history}).cause == "no_new_messages"
    assert tito_plan.plan(state, {"messages": [*history, {"role": "user", "content": "b"}],
                             "tools": [{"type": "function"}]}).cause == "tools_changed"
    cut = _state(first, finish="length")
    assert tito_plan.plan(cut, {"messages": [*history, {"role": "user",
                                                   "content": "b"}]}).cause == "reply_unfinished"


def test_prefix_of_a_previous_response_id_call_follows_the_chain() -> None:
    from steptap.middleware.sessions.prefix import classify

    prev = Step(endpoint="responses", prompt_token_ids=[1, 2], response_token_ids=[3],
                request={"input": "a", "instructions": "I"},
                response={"role": "assistant", "response_id": "r1"})

    def step(prev_id: str, instructions: str = "I") -> Step:
        return Step(endpoint="responses", prompt_token_ids=[1, 2, 9], response_token_ids=[4],
                    request={"input": "b", "previous_response_id": prev_id, "instructions": instructions})

    assert classify(prev, step("r1")) == "rerendered"  # ids re-rendered, history intact
    assert classify(prev, step("r0")) == "history_edited"  # branched from an older response
    assert classify(prev, step("r1", "J")) == "history_edited"  # other instructions
    extends = Step(endpoint="responses", prompt_token_ids=[1, 2, 3, 9],
                   request={"previous_response_id": "r1"})
    assert classify(prev, extends) == "extends"


def test_anthropic_reply_reasoning_is_a_signed_thinking_block_plain_and_streamed() -> None:
    shape = messages.Shape({}, "m")
    shape.session_id = "s:1"
    reply = {"choices": [{"message": {"content": "a", "reasoning": "plan"}, "finish_reason": "stop",
                          "token_ids": [1, 2]}]}
    handle = f"steptap:{shape.id}:s:1"
    assert shape.from_chat(reply)["content"] == [{"type": "thinking", "thinking": "plan",
                                                  "signature": handle},
                                                 {"type": "text", "text": "a"}]
    events = messages.EventStream(shape)
    raw = b"".join(events.feed({"choices": [{"index": 0, "delta": d}]})
                   for d in ({"reasoning": "pl"}, {"reasoning": "an"},
                             {"content": "a"})) + events.finish(reply)
    parsed = [json.loads(b.split(b"\ndata: ", 1)[1]) for b in raw.split(b"\n\n") if b]
    blocks = [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in parsed[1:-2]]
    assert blocks == [("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
                      ("content_block_delta", 0, "thinking_delta"),
                      ("content_block_delta", 0, "signature_delta"),
                      ("content_block_stop", 0, None), ("content_block_start", 1, None),
                      ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None)]
    assert parsed[4]["delta"]["signature"] == handle
    # thinking turned off: no block (the replay then has no reasoning to vouch for the logged tokens)
    off = messages.Shape({"thinking": {"type": "disabled"}}, "m")
    assert [b["type"] for b in off.from_chat(reply)["content"]] == ["text"]


def test_tito_splices_a_reasoning_reply_only_when_the_replay_vouches_for_it() -> None:
    first = {"messages": [{"role": "user", "content": "a"}]}
    step = Step(prompt_token_ids=[1, 2], response_token_ids=[3, 4], finish_reason="stop",
                response={"role": "assistant", "content": "hi", "reasoning": "plan", "response_id": "msg_1"})
    state = tito_plan.next_state(first, step)
    handle = "steptap:msg_1:s1"

    def cause(reply: dict, handles: dict | None = None, session: str = "s1") -> str:
        chat = {"messages": [*first["messages"], reply, {"role": "user", "content": "b"}]}
        return tito_plan.plan(state, chat, handles, session).cause

    hi = {"role": "assistant", "content": "hi"}
    assert cause(hi, {0: handle}) == "tokens"  # the handle alone (Codex sends no text)
    assert cause({**hi, "reasoning": "plan"}) == "tokens"  # the text as logged (chat, previous_response_id)
    assert cause({**hi, "reasoning": "plan"}, {0: handle}) == "tokens"
    assert cause({**hi, "reasoning": "edited"}, {0: handle}) == "reasoning_edited"
    assert cause(hi, {0: "steptap:msg_2:s1"}) == "handle_unknown"  # a forged or stale handle
    assert cause(hi, {0: handle}, session="s2") == "handle_unknown"  # another session's
    assert cause(hi, {0: "EqQBCkYIBxgCKkD-anthropic"}) == "handle_foreign"
    assert cause(hi) == "reasoning_dropped"
    # a reply without reasoning needs nothing; reasoning added to it is an edit
    plain = tito_plan.next_state(first, Step(prompt_token_ids=[1, 2], response_token_ids=[3, 4],
                                        finish_reason="stop",
                                        response={"role": "assistant", "content": "hi"}))
    chat = {"messages": [*first["messages"], hi, {"role": "user", "content": "b"}]}
    assert tito_plan.plan(plain, chat).cause == "tokens"
    chat["messages"][1] = {**hi, "reasoning": "x"}
    assert tito_plan.plan(plain, chat).cause == "reasoning_edited"
    # once a reply of the sequence reasoned, its markers stay in every later prompt (a streamed turn then goes
    # through derender, sent only what the turn added: vLLM's parsers would read that end of reasoning)
    assert state is not None and plain is not None and state.reasoned and not plain.reasoned
    later = tito_plan.next_state(chat, Step(prompt_token_ids=[1, 2, 3, 4, 5], response_token_ids=[6],
                                       finish_reason="stop", response=hi), None, state)
    assert later is not None and later.reasoned
    assert not tito_plan.next_state(chat, Step(prompt_token_ids=[1], response_token_ids=[6],
                                               finish_reason="stop", response=hi), None, plain).reasoned


def test_tito_new_ids_follow_the_assistant_turn_however_the_template_renders_it() -> None:
    end = 9
    # ChatML: [user x][assistant y] then "\n"; a template that re-renders the assistant turn once a user turn
    # follows (Qwen3's, dropping its reasoning) still ends it at the same count of end tokens
    base = [1, 5, end, 7, 1, 6, 40, 41, 6, end, 7]
    full = [1, 5, end, 7, 1, 6, 6, end, 7, 1, 5, 50, end, 7, 1, 6]
    assert tito._after_base(base, full, end) == ([7], [1, 5, 50, end, 7, 1, 6])
    assert tito._after_base(base, [1, 5, end, 7, 1, 6, 6, 8, 1, 5], end) is None  # the tail does not follow
    assert tito._after_base(base, [1, 5, end, 7], end) is None  # fewer turns


@pytest.mark.parametrize(("arguments", "expected"), [
    ('{"a": 2}', {"a": 2}),
    ("", {}),
    ('{"a": 2', {"_raw": '{"a": 2'}),  # the model wrote invalid JSON: kept, visibly
    ("[1, 2]", {"_value": [1, 2]}),  # valid JSON, not an object
])
def test_tool_call_arguments_become_an_object_whatever_was_written(arguments: str, expected: object) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": arguments}}
    assert call_arguments(call) == ("add", expected)
    use = messages._tool_use(call)
    assert (use["type"], use["id"], use["name"], use["input"]) == ("tool_use", "c", "add", expected)
