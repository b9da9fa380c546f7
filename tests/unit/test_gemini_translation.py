"""The Gemini API's translation both ways (no server): a generateContent body as a chat body, a chat reply and
its chunks as Gemini's reply and SSE events, and bad bodies as 400s naming the field. The bodies are shaped
as Gemini CLI 0.61 sends them (a function call's CLI-made id, its synthetic thought signature, thought parts
dropped from the history it replays)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from steptap.middleware.errors import ApiError
from steptap.middleware.proxy import gemini
from steptap.middleware.proxy.gemini_contents import SYNTHETIC_SIGNATURE, split_call
from steptap.middleware.proxy.gemini_request import json_schema, translate
from steptap.middleware.proxy.protocols import Gemini
from steptap.middleware.proxy.translation import parse_handle
from steptap.middleware.sessions.prefix import _norm

CALL = {"id": "chatcmpl-tool-1", "type": "function",
        "function": {"name": "run_shell_command", "arguments": '{"command": "echo hi > note.txt"}'}}
REPLY = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Writing it.",
                                              "reasoning": "The user wants a file.", "tool_calls": [CALL]},
                      "finish_reason": "tool_calls", "token_ids": [5, 6, 7]}],
         "usage": {"prompt_tokens": 10, "completion_tokens": 3}, "prompt_token_ids": list(range(10))}
TOOLS = [{"functionDeclarations": [
    {"name": "run_shell_command", "description": "Runs a command.",
     "parametersJsonSchema": {"type": "object", "properties": {"command": {"type": "string"}}}},
    {"name": "read_file", "parameters": {"type": "OBJECT", "properties": {
        "file_path": {"type": "STRING"}, "limit": {"type": "INTEGER", "nullable": True}},
        "required": ["file_path"]}}]}, {"googleSearch": {}}]


def cli_body(contents: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"contents": contents, "systemInstruction": {"parts": [{"text": "You are Gemini CLI."}]},
            "tools": TOOLS, "generationConfig": {"temperature": 1, "topP": 0.95, "topK": 64,
                                                 "thinkingConfig": {"includeThoughts": True}}, **extra}


def test_a_cli_conversation_becomes_chat_messages_and_tools() -> None:
    tr = translate(cli_body([
        {"role": "user", "parts": [{"text": "<session_context>...</session_context>"}, {"text": "write it"}]},
        {"role": "model", "parts": [{"functionCall": {"id": "run_shell_command_17_0",
                                                      "name": "run_shell_command",
                                                      "args": {"command": "echo hi > note.txt"}},
                                     "thoughtSignature": SYNTHETIC_SIGNATURE}]},
        {"role": "user", "parts": [{"functionResponse": {"id": "run_shell_command_17_0",
                                                         "name": "run_shell_command",
                                                         "response": {"output": "Output: (empty)"}}}]},
        {"role": "model", "parts": [{"functionCall": {"name": "read_file",
                                                      "args": {"file_path": "note.txt"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "read_file",
                                                         "response": {"output": "hi\n", "lines": 1}}}]},
    ]), "tiny", stream=True)
    chat = tr.chat
    assert chat["messages"] == [
        {"role": "system", "content": "You are Gemini CLI."},
        {"role": "user", "content": "<session_context>...</session_context>write it"},
        # the synthetic signature is no handle: nothing for take_handles
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "run_shell_command_17_0", "type": "function",
            "function": {"name": "run_shell_command", "arguments": '{"command": "echo hi > note.txt"}'}}]},
        {"role": "tool", "tool_call_id": "run_shell_command_17_0", "content": "Output: (empty)"},
        # a call without an id gets one by its place; its response (no id) is paired by name
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "read_file", "arguments": '{"file_path": "note.txt"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"output": "hi\\n", "lines": 1}'},
    ]
    assert [t["function"]["name"] for t in chat["tools"]] == ["run_shell_command", "read_file"]
    assert chat["tools"][1]["function"]["parameters"] == {"type": "object", "properties": {
        "file_path": {"type": "string"}, "limit": {"type": ["integer", "null"]}}, "required": ["file_path"]}
    assert (chat["temperature"], chat["top_p"], chat["top_k"], chat["model"]) == (1, 0.95, 64, "tiny")
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "max_tokens" not in chat  # Gemini's is optional: vLLM's default
    assert [(f, label) for f, label, _ in tr.notes] == [("tools[1].googleSearch", "tools:googleSearch")]


def test_thoughts_and_a_signature_are_reasoning_and_its_handle_snake_case_too() -> None:
    proto = Gemini({"contents": [
        {"parts": [{"text": "hi"}]},
        {"role": "model", "parts": [{"text": "They greet me.", "thought": True},
                                    {"text": "Hello.", "thought_signature": "steptap:gen_1:s1"}]},
        {"role": "user", "parts": [{"text": "again"}]}],
        "system_instruction": "Be brief.", "generation_config": {"max_output_tokens": 7,
                                                                 "stop_sequences": ["END"]}}, "tiny")
    assert proto.chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello.", "reasoning": "They greet me."},
        {"role": "user", "content": "again"}]
    assert proto.handles == {0: "steptap:gen_1:s1"}  # taken out: vLLM never sees the key
    assert proto.chat["max_tokens"] == 7 and proto.chat["stop"] == ["END"] and not proto.notes


def test_a_reply_is_candidates_with_thoughts_calls_and_the_signature_on_the_first_call() -> None:
    proto = Gemini({"contents": [{"parts": [{"text": "x"}]}],
                    "generationConfig": {"thinkingConfig": {"includeThoughts": True}}}, "tiny")
    proto.prepare("s1")
    reply = json.loads(proto.reply(REPLY))
    [cand] = reply["candidates"]
    thought, text, call = cand["content"]["parts"]
    assert thought == {"text": "The user wants a file.", "thought": True}
    assert text == {"text": "Writing it."}
    assert call["functionCall"] == {"id": "chatcmpl-tool-1", "name": "run_shell_command",
                                    "args": {"command": "echo hi > note.txt"}}
    assert parse_handle(call["thoughtSignature"]) == (proto.shape.id, "s1") == (reply["responseId"], "s1")
    assert cand["finishReason"] == "STOP" and cand["content"]["role"] == "model"
    assert reply["usageMetadata"] == {"promptTokenCount": 10, "candidatesTokenCount": 3,
                                      "totalTokenCount": 13}
    # without includeThoughts the reasoning is not shown, but its handle still rides on the call
    plain = Gemini({"contents": [{"parts": [{"text": "x"}]}]}, "tiny")
    parts = json.loads(plain.reply(REPLY))["candidates"][0]["content"]["parts"]
    assert [list(p) for p in parts] == [["text"], ["functionCall", "thoughtSignature"]]


def test_a_streamed_reply_replayed_as_the_cli_keeps_it_is_the_step_s_message() -> None:
    """The events as Gemini CLI assembles them (thought parts dropped from its history, the signature kept on
    the first call), sent back next turn, are the assistant message the step recorded: a TITO session
    extends, its handle naming the step."""
    proto = Gemini({"contents": [{"parts": [{"text": "x"}]}],
                    "generationConfig": {"thinkingConfig": {"includeThoughts": True}}}, "tiny", stream=True)
    proto.prepare("s1")
    raw = proto.feed({"choices": [{"index": 0, "delta": {"reasoning": "The user wants a file."}}]})
    raw += proto.feed({"choices": [{"index": 0, "delta": {"content": "Writing"}}]})
    raw += proto.feed({"choices": [{"index": 0, "delta": {"content": " it."}}]})
    raw += proto.feed({"choices": [], "usage": {}})  # the usage chunk: no event
    raw += proto.finish(REPLY)
    assert raw.count(b"\r\n\r\n") == 4 and all(e.startswith(b"data: ") for e in raw.split(b"\r\n\r\n")[:-1])
    events = [json.loads(e[6:]) for e in raw.split(b"\r\n\r\n") if e]
    assert [e["candidates"][0].get("finishReason") for e in events] == [None, None, None, "STOP"]
    assert events[-1]["usageMetadata"] == {"promptTokenCount": 10, "candidatesTokenCount": 3,
                                           "totalTokenCount": 13}
    kept = [p for e in events for p in e["candidates"][0]["content"]["parts"] if not p.get("thought")]
    replay = Gemini({"contents": [{"parts": [{"text": "x"}]}, {"role": "model", "parts": kept}]}, "tiny")
    assistant = replay.chat["messages"][-1]
    assert _norm(assistant) == _norm(REPLY["choices"][0]["message"])
    assert replay.handles == {0: f"steptap:{proto.shape.id}:s1"}


def test_a_text_reply_with_reasoning_carries_its_signature_on_its_last_part() -> None:
    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi.", "reasoning": "r"},
                          "finish_reason": "length"}], "prompt_token_ids": [1]}
    proto = Gemini({"contents": [{"parts": [{"text": "x"}]}]}, "tiny", stream=True)
    [event] = [json.loads(e[6:]) for e in proto.finish(reply).split(b"\r\n\r\n") if e]
    signature = proto.shape.signature()
    assert event["candidates"][0]["content"]["parts"] == [{"text": "", "thoughtSignature": signature}]
    assert event["candidates"][0]["finishReason"] == "MAX_TOKENS"
    body = json.loads(proto.reply(reply))
    assert body["candidates"][0]["content"]["parts"] == [{"text": "Hi.", "thoughtSignature": signature}]


def test_tool_config_generation_config_and_the_notes() -> None:
    tr = translate(cli_body([{"parts": [{"text": "x"}]}], toolConfig={"functionCallingConfig": {
        "mode": "ANY", "allowedFunctionNames": ["read_file"]}}, safetySettings=[{"category": "X"}], extra=1),
        "tiny")
    assert tr.chat["tool_choice"] == {"type": "function", "function": {"name": "read_file"}}
    for mode, choice in (("NONE", "none"), ("AUTO", "auto"), ("ANY", "required")):
        body = cli_body([{"parts": [{"text": "x"}]}], toolConfig={"functionCallingConfig": {"mode": mode}})
        assert translate(body, "tiny").chat["tool_choice"] == choice
    assert [label for _, label, _ in tr.notes] == ["tools:googleSearch", "safetySettings", "other"]
    tr = translate({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {
        "candidateCount": 2, "seed": 3, "presencePenalty": 0.5, "responseMimeType": "application/json",
        "responseSchema": {"type": "OBJECT", "properties": {"a": {"type": "STRING"}}},
        "responseLogprobs": True, "thinkingConfig": {"thinkingBudget": 0}}}, "tiny")
    assert (tr.chat["n"], tr.chat["seed"], tr.chat["presence_penalty"]) == (2, 3, 0.5)
    assert tr.chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "output", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    assert sorted(label for _, label, _ in tr.notes) == ["generationConfig.responseLogprobs",
                                                         "thinkingConfig.thinkingBudget"]


def test_images_and_a_count_tokens_request() -> None:
    image = {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}}
    proto = Gemini({"generateContentRequest": {"model": "models/tiny", "contents": [
        {"role": "user", "parts": [{"text": "what is it?"}, image]}]}}, "tiny", count_only=True)
    assert proto.chat["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
    assert proto.chat["max_tokens"] == 1 and "stream" not in proto.chat


@pytest.mark.parametrize(("body", "where"), [
    ({}, "contents"), ({"contents": []}, "contents"),
    ({"contents": [{"role": "system", "parts": []}]}, "role"),
    ({"contents": [{"parts": "hi"}]}, "contents[0].parts"),
    ({"contents": [{"parts": [{"inlineData": {"mimeType": "audio/wav", "data": "AA=="}}]}]}, "parts[0]"),
    ({"contents": [{"parts": [{"fileData": {"mimeType": "image/png", "fileUri": "files/abc"}}]}]},
     "fileData"),
    ({"contents": [{"parts": [{"videoMetadata": {}}]}]}, "parts[0]"),
    ({"contents": [{"role": "model", "parts": [{"functionCall": {"args": {}}}]}]}, "functionCall"),
    ({"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": []}}]}]}, "args"),
    ({"contents": [{"parts": [{"functionResponse": {"name": "f", "response": "ok"}}]}]}, "response"),
    ({"contents": [{"parts": [{"text": "x"}]}],
      "tools": [{"functionDeclarations": [{"name": "f"}, {"name": "f"}]}]}, "tools"),
    ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"temperature": "hot"}},
     "temperature"),
    ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"maxOutputTokens": 0}},
     "maxOutputTokens"),
    ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"topK": 1.5}}, "topK"),
    ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"responseMimeType": "text/x.enum"}},
     "responseMimeType"),
    ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"responseModalities": ["AUDIO"]}},
     "responseModalities"),
    ({"contents": [{"parts": [{"text": "x"}]}], "toolConfig": {"functionCallingConfig": {"mode": "SOME"}}},
     "mode"),
    ({"contents": [{"parts": [{"text": "x"}]}], "cachedContent": "cachedContents/1"}, "cachedContent"),
])
def test_bad_bodies_are_400s_naming_the_field(body: dict[str, Any], where: str) -> None:
    with pytest.raises(ApiError) as err:
        translate(body, "tiny")
    assert err.value.status == 400 and where in err.value.message, err.value.message


def test_paths_errors_and_the_models_list() -> None:
    assert split_call("models/tiny:streamGenerateContent") == ("tiny", "streamGenerateContent")
    assert split_call("gemini-2.5-pro:countTokens") == ("gemini-2.5-pro", "countTokens")
    with pytest.raises(ApiError) as err:
        split_call("tiny")
    assert err.value.status == 404
    assert json.loads(gemini.error_body(429, "slow down")) == {
        "error": {"code": 429, "message": "slow down", "status": "RESOURCE_EXHAUSTED"}}
    assert json.loads(gemini.EventStream.error(502, "cut")) == gemini.error_object(502, "cut")
    listed = gemini.models_body({"data": [{"id": "tiny", "max_model_len": 2048}]})
    assert listed == {"models": [{"name": "models/tiny", "baseModelId": "tiny", "version": "1",
                                  "displayName": "tiny", "inputTokenLimit": 2048, "outputTokenLimit": 2048,
                                  "supportedGenerationMethods": ["generateContent", "streamGenerateContent",
                                                                 "countTokens"]}]}
    assert gemini.is_gemini_client({"x-goog-api-key": "k"}, {}) and gemini.is_gemini_client({}, {"key": "k"})
    assert not gemini.is_gemini_client({"Authorization": "Bearer k"}, {})
    assert json_schema({"type": "ARRAY", "items": {"type": "NUMBER"}, "max_items": 3}) == {
        "type": "array", "items": {"type": "number"}, "maxItems": 3}


def test_the_session_key_as_google_s_sdks_send_it() -> None:
    from types import SimpleNamespace

    from steptap.middleware.sessions.identity import Identity, identify

    def req(headers: dict[str, str], query: dict[str, str], path_id: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(match_info={"agent_session": path_id} if path_id else {}, headers=headers,
                               query=query)

    assert identify(req({"x-goog-api-key": "stk-a"}, {})) == Identity("key", key="stk-a")
    assert identify(req({}, {"key": "stk-b"}, "s1")) == Identity("path", session_id="s1", key="stk-b")
    assert identify(req({"x-goog-api-key": "AIza-not-ours"}, {})) == Identity("anonymous")
