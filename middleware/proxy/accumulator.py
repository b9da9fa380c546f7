"""The capture accumulator: a streamed reply's chunks reduced to the shape of the whole reply vLLM would
have sent (``ChatStream`` / ``CompletionStream``), so a stream's steps come from the same
``capture.steps_from_reply`` as a plain reply's and are identical. Pure: fed by the stream relay (sse.py),
read when the stream ends or is cut (what arrived, as a failed step's partial reply)."""

from __future__ import annotations

from typing import Any

from steptap.middleware.proxy.capture import CHAT
from steptap.middleware.proxy.translation import reasoning_of


class _ChatChoice:
    __slots__ = (
        "content",
        "finish_reason",
        "logprobs",
        "reasoning",
        "role",
        "stop_reason",
        "token_ids",
        "tool_calls",
    )

    def __init__(self) -> None:
        self.role = "assistant"
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.token_ids: list[int] | None = None
        self.logprobs: list[dict[str, Any]] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None


class _Stream:
    """What every stream's chunks carry besides their choices: the reply's id, model and usage."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None
        self.id: str | None = None

    def _header(self, chunk: dict[str, Any]) -> None:
        if self.id is None:
            self.id, self.model = chunk.get("id"), chunk.get("model")
        if chunk.get("usage"):
            self.usage = chunk["usage"]


class ChatStream(_Stream):
    """Accumulates chat SSE chunks (token ids and logprobs per chunk, content/tool-call deltas)."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt_token_ids: list[int] | None = None
        self.choices: dict[int, _ChatChoice] = {}

    def token_counts(self) -> dict[int, int]:
        """Response tokens relayed so far, per choice (where a weight swap splits each: weights/spans.py)."""
        return {i: len(acc.token_ids or ()) for i, acc in self.choices.items()}

    def feed(self, chunk: dict[str, Any]) -> None:
        self._header(chunk)
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        for ch in chunk.get("choices") or ():
            index = ch.get("index", 0)
            acc = self.choices.get(index)
            if acc is None:
                acc = self.choices[index] = _ChatChoice()
            delta = ch.get("delta")
            if delta:
                if delta.get("role"):
                    acc.role = delta["role"]
                if delta.get("content"):
                    acc.content.append(delta["content"])
                if "reasoning_content" in delta or "reasoning" in delta:  # called only then: once a chunk
                    reasoning = reasoning_of(delta)
                    if reasoning:
                        acc.reasoning.append(reasoning)
                if delta.get("tool_calls"):
                    _feed_tools(acc, delta["tool_calls"])
            # extend in place: rebuilding the list per chunk is quadratic in the response length
            if ch.get("token_ids") is not None:
                if acc.token_ids is None:
                    acc.token_ids = []
                acc.token_ids.extend(ch["token_ids"])
            lp = ch.get("logprobs")
            if lp and lp.get("content") is not None:
                if acc.logprobs is None:
                    acc.logprobs = []
                acc.logprobs.extend(lp["content"])
            if ch.get("finish_reason") is not None:
                acc.finish_reason = ch["finish_reason"]
                acc.stop_reason = ch.get("stop_reason")

    def reply(self) -> dict[str, Any]:
        choices = []
        for index, acc in sorted(self.choices.items()):
            message: dict[str, Any] = {
                "role": acc.role,
                "content": "".join(acc.content) if acc.content else None,
            }
            if acc.tool_calls:
                message["tool_calls"] = [acc.tool_calls[i] for i in sorted(acc.tool_calls)]
            if acc.reasoning:
                message["reasoning"] = "".join(acc.reasoning)
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": None if acc.logprobs is None else {"content": acc.logprobs},
                    "finish_reason": acc.finish_reason,
                    "stop_reason": acc.stop_reason,
                    "token_ids": acc.token_ids,
                }
            )
        return {
            "id": self.id,
            "model": self.model,
            "choices": choices,
            "usage": self.usage,
            "prompt_token_ids": self.prompt_token_ids,
        }


def _feed_tools(acc: _ChatChoice, tool_calls: list[dict[str, Any]]) -> None:
    for tc in tool_calls:
        cur = acc.tool_calls.setdefault(
            tc.get("index", 0),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if tc.get("id"):
            cur["id"] = tc["id"]
        if tc.get("type"):
            cur["type"] = tc["type"]
        fn = tc.get("function") or {}
        if fn.get("name"):
            cur["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            cur["function"]["arguments"] += fn["arguments"]


class CompletionStream(_Stream):
    """Accumulates /v1/completions SSE chunks (prompt ids per choice arrive in its first chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.choices: dict[int, dict[str, Any]] = {}

    def token_counts(self) -> dict[int, int]:
        """Response tokens relayed so far, per choice (where a weight swap splits each: weights/spans.py)."""
        return {i: len(acc["token_ids"] or ()) for i, acc in self.choices.items()}

    def feed(self, chunk: dict[str, Any]) -> None:
        self._header(chunk)
        for ch in chunk.get("choices") or ():
            acc = self.choices.setdefault(
                ch.get("index", 0),
                {
                    "index": ch.get("index", 0),
                    "text": "",
                    "token_ids": None,
                    "prompt_token_ids": None,
                    "logprobs": None,
                    "finish_reason": None,
                },
            )
            acc["text"] += ch.get("text") or ""
            if ch.get("prompt_token_ids") is not None:
                acc["prompt_token_ids"] = ch["prompt_token_ids"]
            if ch.get("token_ids") is not None:
                if acc["token_ids"] is None:
                    acc["token_ids"] = []
                acc["token_ids"].extend(ch["token_ids"])
            lp = ch.get("logprobs")
            if lp and lp.get("token_logprobs") is not None:
                if acc["logprobs"] is None:
                    acc["logprobs"] = {"token_logprobs": []}
                acc["logprobs"]["token_logprobs"] += lp["token_logprobs"]
            if ch.get("finish_reason") is not None:
                acc["finish_reason"] = ch["finish_reason"]

    def reply(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model,
            "usage": self.usage,
            "choices": [self.choices[i] for i in sorted(self.choices)],
        }


def new_stream(endpoint: str) -> ChatStream | CompletionStream:
    return ChatStream() if endpoint == CHAT else CompletionStream()
