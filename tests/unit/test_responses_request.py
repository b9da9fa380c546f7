"""The Responses shapes Codex CLI sends and expects (captured from Codex 0.169.0 through the proxy): namespace
and custom tools flattened for the model and returned as Codex expects, hosted tools and unserved fields
dropped with a note, reasoning items out (with a handle naming the step) and back in. Pure translation, no
server."""

from __future__ import annotations

import json

import pytest

from steptap.middleware.errors import ApiError
from steptap.middleware.proxy import responses
from steptap.middleware.proxy.accumulator import ChatStream
from steptap.middleware.proxy.responses_request import translate

ADD = {"type": "function", "name": "add", "parameters": {"type": "object"}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [
    {"type": "function", "name": "close_agent", "description": "close one", "strict": False,
     "parameters": {"type": "object", "properties": {"target": {"type": "string"}}}}]}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
CODEX_BODY = {
    "model": "m", "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "k", "client_metadata": {"x-codex-installation-id": "i"},
    "tools": [ADD, NAMESPACE, PATCH, {"type": "web_search", "external_web_access": False}],
    "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                                    "text": "Be a coder."}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
}


def _names(chat: dict) -> list[str]:
    return [t["function"]["name"] for t in chat["tools"]]


def test_codex_first_body_translates_with_flat_tools_and_notes() -> None:
    tr = translate(CODEX_BODY, [])
    # web_search is not offered
    assert _names(tr.chat) == ["add", "multi_agent_v1.close_agent", "apply_patch"]
    patch = tr.chat["tools"][2]["function"]
    assert patch["parameters"]["properties"] == {"input": {"type": "string"}}
    assert "start: /.+/" in patch["description"]  # the grammar is shown, since it cannot be enforced
    assert tr.chat["messages"][0] == {"role": "system", "content": "Be a coder."}
    assert tr.chat["parallel_tool_calls"] is True and tr.chat["tool_choice"] == "auto"
    assert "prompt_cache_key" not in tr.chat and "client_metadata" not in tr.chat
    labels = {n["field"]: n["label"] for n in tr.notes}
    assert labels == {"tools[3]": "tools:web_search", "reasoning.summary": "reasoning",
                      "tools[2].format": "tools:custom_grammar"}


def test_unknown_and_unhonoured_fields_are_noted_and_bounded() -> None:
    body = {"input": "x", "max_tool_calls": 3, "include": ["message.output_text.logprobs"],
            "truncation": "auto",
            "reasoning": {"effort": "high"}, **{f"new_{i}": 1 for i in range(100)}}
    tr = translate(body, [])
    fields = [n["field"] for n in tr.notes]
    assert fields[:4] == ["max_tool_calls", "new_0", "new_1", "new_2"]
    assert len(tr.notes) == 65 and tr.notes[-1]["field"] == "..."
    assert {n["label"] for n in tr.notes} == {"max_tool_calls", "other"}  # the metric's labels stay bounded
    assert tr.chat["reasoning_effort"] == "high"
    few = translate({"input": "x", "include": ["message.output_text.logprobs"], "truncation": "auto",
                     "text": {"verbosity": "low", "format": {"type": "text"}}}, [])
    assert [n["label"] for n in few.notes] == ["include", "truncation", "text"]


def test_only_hosted_tools_leave_no_tools_and_no_tool_choice() -> None:
    chat = translate({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "auto"}, []).chat
    assert "tools" not in chat and "tool_choice" not in chat
    forced = translate({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"}, [])
    assert "tool_choice" not in forced.chat and "tool_choice" in [n["field"] for n in forced.notes]


def test_namespace_call_returns_with_its_namespace_and_replays_flat() -> None:
    tr = translate(CODEX_BODY, [])
    shape = responses.Shape(CODEX_BODY, "m", tr)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "multi_agent_v1.close_agent", "arguments": '{"target": "a"}'}}
    reply = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [call]},
                          "finish_reason": "tool_calls"}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    response, assistant = shape.from_chat(reply)
    item = response["output"][0]
    assert (item["type"], item["name"], item["namespace"], item["call_id"]) == (
        "function_call", "close_agent", "multi_agent_v1", "call_1")
    assert assistant["tool_calls"] == [call]
    again = translate({**CODEX_BODY, "input": [*CODEX_BODY["input"], item,
                                               {"type": "function_call_output", "call_id": "call_1",
                                                "output": "closed"}]}, []).chat["messages"]
    assert again[-2:] == [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "closed"}]


def test_custom_tool_call_round_trip() -> None:
    tr = translate(CODEX_BODY, [])
    shape = responses.Shape(CODEX_BODY, "m", tr)
    patch = "*** Begin Patch\n*** Add File: a.txt\n+é\n*** End Patch"
    args = json.dumps({"input": patch}, ensure_ascii=False)
    call = {"id": "call_2", "type": "function", "function": {"name": "apply_patch", "arguments": args}}
    reply = {"choices": [{"message": {"role": "assistant", "content": "Patching.", "tool_calls": [call]}}]}
    response, assistant = shape.from_chat(reply)
    item = response["output"][1]
    assert {k: item[k] for k in ("type", "name", "input", "call_id")} == {
        "type": "custom_tool_call", "name": "apply_patch", "input": patch, "call_id": "call_2"}
    messages = translate({**CODEX_BODY, "input": [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Patching."}]},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": patch},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done!"}]}, []).chat["messages"]
    assert messages == [assistant, {"role": "tool", "tool_call_id": "call_2", "content": "Done!"}]
    # a reply the model did not shape as {"input": ...} still reaches the agent, as the raw arguments
    odd = {"choices": [{"message": {"tool_calls": [{**call, "function": {"name": "apply_patch",
                                                                          "arguments": "oops"}}]}}]}
    assert shape.from_chat(odd)[0]["output"][0]["input"] == "oops"


def test_reasoning_becomes_an_item_with_a_stable_handle_and_comes_back_on_replay() -> None:
    shape = responses.Shape(CODEX_BODY, "m", translate(CODEX_BODY, []))
    shape.session_id = "auto:s1"
    reply = {"choices": [{"message": {"role": "assistant", "content": "hi", "reasoning_content": "think"}}]}
    response, assistant = shape.from_chat(reply)
    item = response["output"][0]
    assert item["type"] == "reasoning" and item["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert item["encrypted_content"] == f"steptap:{shape.id}:auto:s1"
    assert responses.parse_handle(item["encrypted_content"]) == (shape.id, "auto:s1")
    assert responses.parse_handle("gAAAA-someone-elses") is None
    # Stored: text, no handle
    assert assistant == {"role": "assistant", "content": "hi", "reasoning": "think"}
    # replayed: the text to the template as the reply's reasoning, the handle beside the chat body (never in
    # it)
    replayed = translate({"input": [item, {"type": "message", "role": "assistant", "content": "hi"}]}, [])
    assert replayed.chat["messages"] == [assistant]
    assert replayed.handles == {0: item["encrypted_content"]}
    # Codex's shape: no text, only the handle; a reasoning item before a user turn belongs to no reply
    bare = {"type": "reasoning", "summary": [], "encrypted_content": item["encrypted_content"]}
    replayed = translate({"input": [{"type": "message", "role": "assistant", "content": "a"}, bare,
                                    {"type": "message", "role": "assistant", "content": "hi"},
                                    bare, {"type": "message", "role": "user", "content": "u"}]}, [])
    assert replayed.chat["messages"] == [{"role": "assistant", "content": "a"},
                                         {"role": "assistant", "content": "hi"},
                                         {"role": "user", "content": "u"}]
    assert replayed.handles == {1: item["encrypted_content"]}
    plain = responses.Shape({"input": "x"}, "m")  # no include: no encrypted_content
    assert "encrypted_content" not in plain.from_chat(reply)[0]["output"][0]


def _events(raw: bytes) -> list[dict]:
    return [json.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.split(b"\n\n") if block]


def test_stream_with_reasoning_text_and_a_custom_call_keeps_output_indexes() -> None:
    shape = responses.Shape(CODEX_BODY, "m", translate(CODEX_BODY, []))
    events = responses.EventStream(shape)
    raw = events.start()
    for delta in ({"reasoning_content": "th"}, {"reasoning_content": "ink"}, {"content": "ok"}):
        raw += events.feed({"choices": [{"index": 0, "delta": delta}]})
    call = {"id": "c", "type": "function", "function": {"name": "apply_patch", "arguments": '{"input": "P"}'}}
    tail, response, _ = events.finish({"choices": [{"message": {"content": "ok", "tool_calls": [call]}}]})
    parsed = _events(raw + tail)
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    done = [e for e in parsed if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["type"]) for e in done] == [
        (0, "reasoning"), (1, "message"), (2, "custom_tool_call")]
    assert done[0]["item"]["content"][0]["text"] == "think" and done[0]["item"]["encrypted_content"]
    assert "response.custom_tool_call_input.done" in [e["type"] for e in parsed]
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "custom_tool_call"]


def test_a_start_token_vllm_leaks_into_a_coalesced_reasoning_delta_is_dropped() -> None:
    """A loaded vLLM coalesces ``<think>`` with the next tokens into one delta, and its streaming parser
    keeps the ``<think>`` in that delta's reasoning (a stand-in chunk: the real one needs a slow reader):
    neither the agent's reasoning item nor the recorded reply carries it."""
    chunks = [{"choices": [{"index": 0, "delta": d}]} for d in (
        {"reasoning_content": "<think>pl"}, {"reasoning_content": "an"}, {"content": "Hi"})]
    events, acc = responses.EventStream(responses.Shape({"input": "x"}, "m")), ChatStream()
    raw = events.start()
    for chunk in chunks:
        raw += events.feed(chunk)
        acc.feed(chunk)
    deltas = [e["delta"] for e in _events(raw) if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "plan"
    assert acc.reply()["choices"][0]["message"]["reasoning"] == "plan"


@pytest.mark.parametrize("item", [
    {"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"},  # no input
    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": 3},
    {"type": "reasoning", "summary": [], "encrypted_content": 5},
])
def test_malformed_codex_items_are_400_naming_the_item(item: dict) -> None:
    with pytest.raises(ApiError) as err:
        translate({"input": [item]}, [])
    assert err.value.status == 400 and "input[0]" in err.value.message


def test_history_from_a_server_that_ran_hosted_tools() -> None:
    """local_shell calls become a local_shell tool call in the history; hosted tools' results are dropped,
    noted."""
    action = {"type": "exec", "command": ["ls"], "timeout_ms": None}
    tr = translate({"input": [
        USER_ITEM := {"type": "message", "role": "user", "content": "list"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "q"}},
        {"type": "local_shell_call", "call_id": "c1", "status": "completed", "action": action},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}]}, [])
    assert tr.chat["messages"] == [
        {"role": "user", "content": USER_ITEM["content"]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "local_shell", "arguments": json.dumps(action)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]
    assert [(n["field"], n["label"]) for n in tr.notes] == [("input[1]", "input:web_search_call")]


def test_a_failure_mid_stream_ends_with_response_failed() -> None:
    events = responses.EventStream(responses.Shape({"input": "x"}, "m"))
    raw = events.start() + events.feed({"choices": [{"index": 0, "delta": {"content": "par"}}]})
    parsed = _events(raw + events.error("backend cut the stream", "backend_cut"))
    assert [e["type"] for e in parsed[-2:]] == ["error", "response.failed"]
    failed = parsed[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "backend_cut", "message": "backend cut the stream"}
