"""What the protocols that ride on chat completions (``responses.py``, ``messages.py``, ``gemini.py``) share:
their 400s, their ids, a message's text, a tool call's arguments as an object, the keys passed on unchanged,
the reasoning handle. (What conversation a body holds reaches ``sessions/prefix.py`` as the relay translated
it: ``SessionManager.record``'s ``chat``.)"""

from __future__ import annotations

import json
import secrets
from typing import Any

from steptap.middleware.errors import ApiError


def bad(message: str, where: str | None = None) -> ApiError:
    """A 400 naming the part of the body at fault (the protocol's error shape is applied at its edge)."""
    return ApiError(400, message if where is None else f"{message} (at {where})", "invalid_request")


def text_of(content: Any, where: str, kinds: tuple[str, ...], noun: str) -> str:
    """A message's text: a string, or its text parts (``type`` in ``kinds``) joined; any other part is a 400
    naming it (``noun``: what the protocol calls its parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"content must be a string or a list of {noun}", where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if not isinstance(part, dict) or kind not in kinds:
            raise bad(f"unsupported content part {kind!r} (only text is served)", f"{where}[{i}]")
        if not isinstance(part.get("text"), str):
            raise bad("a text part needs a string 'text'", f"{where}[{i}]")
        parts.append(part["text"])
    return "".join(parts)


def data_url(mime: Any, data: Any) -> str:
    """An image's base64 data (an Anthropic source) as the data URL of the chat part it becomes."""
    return f"data:{mime if isinstance(mime, str) else 'application/octet-stream'};base64,{data}"


def carry_over(chat: dict[str, Any], body: dict[str, Any], same: tuple[str, ...]) -> dict[str, Any]:
    """The chat body's last keys: those the protocol passes on unchanged (``same``), and a stream's usage."""
    for key in same:
        if key in body:
            chat[key] = body[key]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def call_arguments(call: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A chat tool call's function name and arguments as an object, for protocols whose calls carry an object
    (Messages' ``input``, Gemini's ``args``): invalid JSON kept as ``{"_raw": text}`` and a JSON value that
    is not an object as ``{"_value": value}`` (the model wrote it: visible, never dropped)."""
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        args = {"_raw": fn.get("arguments")}
    if not isinstance(args, dict):
        args = {"_value": args}
    return fn.get("name") or "", args


def new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(12)}"


# A body of a thousand unknown keys gets this many notes on its step, and one that stands for the rest
MAX_NOTES = 64
HANDLE_PREFIX = "steptap:"
# The key a translation puts a replayed reasoning's opaque value under in its assistant chat message, taken
# out (``take_handles``) before the chat body goes anywhere.
HANDLE_KEY = "steptap_handle"


def reasoning_handle(session_id: str | None, response_id: str) -> str:
    """The opaque value of reasoning the proxy returned (a Responses reasoning item's ``encrypted_content``, a
    Messages thinking block's ``signature``): ``steptap:<response id>:<session id>`` (the session id may hold
    ``:``; anonymous calls have none). It names the step the reasoning came from: the step whose
    ``response["response_id"]`` is that id, in that session (a token-in-token-out replay splices its
    tokens)."""
    return f"{HANDLE_PREFIX}{response_id}:{session_id or ''}"


def parse_handle(opaque: Any) -> tuple[str, str | None] | None:
    """(response id, session id) of a handle ``reasoning_handle`` made, else None (another server's blob)."""
    if not isinstance(opaque, str) or not opaque.startswith(HANDLE_PREFIX):
        return None
    response_id, sep, session_id = opaque[len(HANDLE_PREFIX):].partition(":")
    return (response_id, session_id or None) if sep and response_id else None


# vLLM's streaming reasoning parsers (vllm/reasoning/basic_parsers.py, 0.32) leave their start token in the
# reasoning of a delta that carries it with more tokens, as a loaded server's coalesced deltas do
_LEAKED_START = "<think>"


def reasoning_of(message: dict[str, Any]) -> Any:
    """The reasoning text of a chat message or delta (vLLM names it ``reasoning_content`` or
    ``reasoning``), without a start token vLLM's stream leaked into it."""
    text = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(text, str) and text.startswith(_LEAKED_START):
        return text[len(_LEAKED_START):] or None
    return text


def take_handles(messages: list[dict[str, Any]]) -> dict[int, str]:
    """The replayed reasoning handles out of the chat messages, by assistant message (0: the first assistant
    message); vLLM never sees the key."""
    out: dict[int, str] = {}
    k = 0
    for msg in messages:
        if msg.get("role") != "assistant":
            continue
        handle = msg.pop(HANDLE_KEY, None)
        if handle is not None:
            out[k] = handle
        k += 1
    return out
