"""Google's Gemini API (``POST /v1beta/models/MODEL:generateContent`` and ``:streamGenerateContent?alt=sse``)
over chat completions, the reply side: a chat reply (or its SSE chunks) as a ``GenerateContentResponse`` (or
its SSE events), the models list in Gemini's shape, and Gemini's error body
(``{"error": {"code", "message", "status"}}``).

A reply's reasoning is a thought part (``{"text", "thought": true}``) when the body asked for thoughts
(``thinkingConfig.includeThoughts``), and its handle (``translation.reasoning_handle``) rides in
``thoughtSignature`` whether or not it did, where Google's API puts a signature: on the first function call
part, else on the reply's last part. The request side: ``gemini_request.py``.
"""

from __future__ import annotations

import json
from typing import Any

from steptap.middleware.proxy.gemini_contents import COUNT, GENERATE, STREAM, get
from steptap.middleware.proxy.translation import call_arguments, new_id, reasoning_handle, reasoning_of

ENDPOINT = "gemini"
METHODS = (GENERATE, STREAM, COUNT)
# HTTP status -> Google's canonical error status (what its SDKs and Gemini CLI read)
_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
           409: "ABORTED", 413: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
           499: "CANCELLED", 501: "UNIMPLEMENTED", 502: "UNAVAILABLE", 503: "UNAVAILABLE",
           504: "DEADLINE_EXCEEDED"}
_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}


def finish_reason(choice: dict[str, Any]) -> str:
    return _FINISH.get(str(choice.get("finish_reason")), "OTHER")
_SSE_END = b"\r\n\r\n"


def error_object(status: int, message: str) -> dict[str, Any]:
    kind = _STATUS.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")
    return {"error": {"code": status, "message": message, "status": kind}}


def error_body(status: int, message: str) -> bytes:
    return json.dumps(error_object(status, message)).encode()


def is_gemini_client(headers: Any, query: Any) -> bool:
    """Google's SDKs send ``x-goog-api-client`` and their key as ``x-goog-api-key`` (or ``?key=``)."""
    return "x-goog-api-key" in headers or "x-goog-api-client" in headers or "key" in query


def model_entry(m: dict[str, Any]) -> dict[str, Any]:
    """One of vLLM's models as a Gemini ``Model``."""
    limit = m.get("max_model_len") if isinstance(m.get("max_model_len"), int) else None
    entry: dict[str, Any] = {"name": f"models/{m.get('id')}", "baseModelId": m.get("id"), "version": "1",
                             "displayName": m.get("id"), "supportedGenerationMethods": list(METHODS)}
    if limit is not None:
        entry.update(inputTokenLimit=limit, outputTokenLimit=limit)
    return entry


def models_body(openai_models: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``GET /v1/models`` list in Gemini's shape (``{"models": [Model]}``)."""
    return {"models": [model_entry(m) for m in openai_models.get("data") or () if isinstance(m, dict)]}


def _call_part(call: dict[str, Any]) -> dict[str, Any]:
    name, args = call_arguments(call)
    out: dict[str, Any] = {"name": name, "args": args}
    if call.get("id"):
        out["id"] = call["id"]
    return {"functionCall": out}


def _usage(prompt: int, output: int) -> dict[str, int]:
    return {"promptTokenCount": prompt, "candidatesTokenCount": output, "totalTokenCount": prompt + output}


class Shape:
    def __init__(self, body: dict[str, Any], model: str) -> None:
        self.id = new_id("gen")
        self.model = model
        config = get(body, "generationConfig")
        thinking = get(config, "thinkingConfig") if isinstance(config, dict) else None
        self.thoughts = isinstance(thinking, dict) and get(thinking, "includeThoughts") is True
        self.session_id: str | None = None  # set once the session is known (the signature names it)

    def signature(self) -> str:
        return reasoning_handle(self.session_id, self.id)

    def last_parts(self, message: dict[str, Any], parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``parts`` (the reply's thoughts and text) with its function calls after them, and the signature
        when it reasoned: on the first call, else on the last part (a part of its own when the text was
        streamed before it)."""
        calls = [_call_part(c) for c in message.get("tool_calls") or ()]
        if reasoning_of(message):
            holder = calls[0] if calls else parts[-1] if parts and not parts[-1].get("thought") else None
            if holder is None:
                holder = {"text": ""}
                parts = [*parts, holder]
            holder["thoughtSignature"] = self.signature()
        return parts + calls

    def candidate(self, choice: dict[str, Any]) -> dict[str, Any]:
        msg = choice.get("message") or {}
        parts: list[dict[str, Any]] = []
        reasoning = reasoning_of(msg)
        if reasoning and self.thoughts:
            parts.append({"text": reasoning, "thought": True})
        if msg.get("content"):
            parts.append({"text": msg["content"]})
        return {"content": {"role": "model", "parts": self.last_parts(msg, parts)},
                "finishReason": finish_reason(choice),
                "index": choice.get("index", 0)}

    def response(self, candidates: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"candidates": candidates}
        if usage is not None:
            out["usageMetadata"] = usage
        out.update(modelVersion=self.model, responseId=self.id)
        return out

    def from_chat(self, reply: dict[str, Any]) -> dict[str, Any]:
        u = reply.get("usage") or {}
        return self.response([self.candidate(c) for c in reply.get("choices") or ()],
                             _usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0)))


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False).encode() + _SSE_END


class EventStream:
    """Chat chunks -> one ``GenerateContentResponse`` event per chunk (thought and text parts as they come,
    by candidate), then a last event with each candidate's function calls (the tool parser releases them
    whole), its signature, ``finishReason`` and the usage."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def feed(self, chunk: dict[str, Any]) -> bytes:
        candidates = []
        for ch in chunk.get("choices") or ():
            delta = ch.get("delta") or {}
            parts = []
            reasoning = reasoning_of(delta) if self.shape.thoughts else None
            if reasoning:
                parts.append({"text": reasoning, "thought": True})
            if delta.get("content"):
                parts.append({"text": delta["content"]})
            if parts:
                candidates.append({"content": {"role": "model", "parts": parts}, "index": ch.get("index", 0)})
        return sse(self.shape.response(candidates, None)) if candidates else b""

    def finish(self, reply: dict[str, Any]) -> bytes:
        candidates = []
        output = 0
        for choice in reply.get("choices") or ():
            msg = choice.get("message") or {}
            output += len(choice.get("token_ids") or ())
            candidates.append({"content": {"role": "model", "parts": self.shape.last_parts(msg, [])},
                               "finishReason": finish_reason(choice),
                               "index": choice.get("index", 0)})
        prompt = len(reply.get("prompt_token_ids") or ())
        return sse(self.shape.response(candidates, _usage(prompt, output)))

    @staticmethod
    def error(status: int, message: str) -> bytes:
        """A failure once streaming: Gemini's error object on a line of its own, not an SSE event (Google's
        JS SDK raises on a read that is an error object; an event would be taken for a reply)."""
        return error_body(status, message) + b"\n"
