"""Anthropic's Messages API, the request side: a Messages body as the chat body it is served as (``to_chat``),
and what of it is accepted but not honoured (``dropped``: noted on the step, counted by bounded label).
The reply side and the errors: ``proxy/messages.py``.
"""

from __future__ import annotations

import json
from typing import Any

from steptap.middleware.proxy.translation import (
    HANDLE_KEY,
    MAX_NOTES,
    carry_over,
    data_url,
    text_of,
)
from steptap.middleware.proxy.translation import bad as _bad

_SAME = ("temperature", "top_p", "top_k", "min_p", "seed", "structured_outputs", "repetition_penalty")


def _text(content: Any, where: str) -> str:
    return text_of(content, where, ("text",), "blocks")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of blocks", where)
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise _bad("a content block must be an object", f"{where}[{i}]")
    return content


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results become tool messages (in order), its text one user message after them;
    with images, that message's content is its text and image parts in order (proxy/vision.py reads them)."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_source(block.get("source"),
                                                                                  f"{where}[{i}].source")}})
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            result = _tool_result(block.get("content", ""), f"{where}[{i}].content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise _bad(f"unsupported user block {kind!r} (text, image and tool_result are served)",
                       f"{where}[{i}]")
    if parts or not out:
        if any(p["type"] == "image_url" for p in parts):
            out.append({"role": "user", "content": parts})
        else:
            out.append({"role": "user", "content": "".join(p["text"] for p in parts)})
    return out


def _tool_result(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A tool result's content: its text, or (with image blocks: a computer-use screenshot) its text and
    image parts in order."""
    if not isinstance(content, list) or not any(isinstance(b, dict) and b.get("type") == "image"
                                                for b in content):
        return _text(content, where)
    return [{"type": "image_url", "image_url": {"url": _image_source(b.get("source"), f"{where}[{i}]")}}
            if b.get("type") == "image" else {"type": "text", "text": _text([b], f"{where}[{i}]")}
            for i, b in enumerate(content)]


def _image_source(source: Any, where: str) -> str:
    """An image block's source as the chat part's URL: base64 as a data URL, a URL as it is."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return data_url(source["media_type"], source["data"])
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise _bad("an image block's source must be {type: base64, media_type, data} or {type: url, url}", where)


def _assistant(content: Any, where: str) -> dict[str, Any]:
    text: list[str] = []
    thinking: list[str] = []
    signature: Any = None
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str):
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise _bad("tool_use input must be an object", f"{where}[{i}].input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(args)}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            # replayed reasoning: vLLM hands it to the template as the message's reasoning (rendered where the
            # template renders reasoning, dropped where it does not); the signature, when the proxy made it,
            # names the step it came from (translation.reasoning_handle), for a token-in-token-out splice
            thinking.append(block["thinking"])
            if signature is None:
                signature = block.get("signature")
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        else:
            raise _bad(f"unsupported assistant block {kind!r}", f"{where}[{i}]")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if thinking:
        msg["reasoning"] = "".join(thinking)
    if isinstance(signature, str) and signature:
        msg[HANDLE_KEY] = signature
    if calls:
        msg["tool_calls"] = calls
    return msg


def _system(content: Any, where: str) -> str | list[dict[str, Any]]:
    """System text: a string as is, blocks as text parts (vLLM joins them and drops Claude Code's billing
    header line, which changes per call and would defeat the prefix cache)."""
    if isinstance(content, str):
        return content
    _text(content, where)  # text blocks only
    return [{"type": "text", "text": block["text"]} for block in content]


# Top-level keys a Messages call may carry that change nothing the proxy can honour on a local model:
# accepted, dropped, and named in the step's notes (and steptap_dropped_fields) so a session view shows what
# was ignored. ``metadata`` (a user id) and ``cache_control`` (prompt caching is vLLM's own, automatic) are
# honoured by doing nothing.
_HONOURED = {"model", "messages", "system", "max_tokens", "stop_sequences", "tools", "tool_choice", "stream",
             "metadata", "cache_control", "output_format", *_SAME}


# Dropped fields Anthropic documents, counted under their own name; any other key under "other": a metric's
# labels are bounded whatever an agent sends (each distinct label is a series the proxy keeps)
_KNOWN_DROPS = {"thinking", "context_management", "service_tier", "mcp_servers", "container",
                "output_config.effort", "tool_choice"}
# Server tools (run by Anthropic's servers) and Anthropic-defined client tools: a ``type`` and no schema the
# model could be shown. Versioned names (``web_search_20250305``) are counted by family.
_TOOL_FAMILIES = {"web_search", "web_fetch", "code_execution", "bash", "text_editor", "computer", "memory"}


def _typed(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("type") not in (None, "custom")


def _tool_label(kind: Any) -> str:
    family = kind.rsplit("_", 1)[0] if isinstance(kind, str) else ""
    return f"tools:{family if family in _TOOL_FAMILIES else 'other'}"


def dropped(body: dict[str, Any]) -> list[tuple[str, str]]:
    """What a Messages body asks for that is accepted but not honoured, as (the field, its metric label), at
    most ``MAX_NOTES`` (then one that stands for the rest): top-level keys (``thinking`` is honoured when it
    only disables thinking; ``output_config``'s settings one by one, its ``format`` honoured), and typed tools
    (a server tool such as web search: the backend cannot run it, so the model is not offered it; with it a
    ``tool_choice`` that names it or leaves nothing to choose)."""
    out = []
    tools = body.get("tools")  # first: they change what the model is shown (the notes are capped)
    if isinstance(tools, list):
        out += [(f"tools[{i}] (type {str(t['type'])[:64]!r})", _tool_label(t["type"]))
                for i, t in enumerate(tools) if _typed(t)]
        if _choice_gone(body.get("tool_choice"), tools):
            out.append(("tool_choice", "tool_choice"))
    for key in body:
        if key in _HONOURED:
            continue
        if key == "thinking" and isinstance(body[key], dict) and body[key].get("type") == "disabled":
            continue
        if key == "output_config" and isinstance(body[key], dict):  # its format is honoured, not the rest
            out += [(f"{key}.{name}", f"{key}.{name}") for name in body[key] if name != "format"]
            continue
        out.append((key if len(key) <= 64 else key[:64] + "...", key))  # a note is stored with the step
    named = [(field, label if label in _KNOWN_DROPS or label.startswith("tools:") else "other")
             for field, label in out]
    return named if len(named) <= MAX_NOTES else [*named[:MAX_NOTES], ("...", "other")]


def _choice_gone(choice: Any, tools: list[Any]) -> bool:
    """Whether ``tool_choice`` names a dropped typed tool, or is left with no tool at all (vLLM refuses a
    tool choice without tools)."""
    if not isinstance(choice, dict) or not any(_typed(t) for t in tools):
        return False
    names = {t.get("name") for t in tools if isinstance(t, dict) and not _typed(t)}
    return choice.get("name") not in names if choice.get("type") == "tool" else not names


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that refuses (or drops) a system message after the first: each such message becomes the
    start of the next user turn (a user turn of its own when none follows)."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for i, msg in enumerate(messages):
        if msg["role"] == "system" and i > 0:
            c = msg["content"]
            pending.append(c if isinstance(c, str) else "\n".join(p["text"] for p in c))
            continue
        if pending and msg["role"] == "user":
            c = msg["content"]
            msg = {**msg, "content": "\n\n".join([*pending, c]) if isinstance(c, str)
                   else [{"type": "text", "text": "\n\n".join(pending) + "\n\n"}, *c]}
            pending = []
        out.append(msg)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def has_mid_system(chat: dict[str, Any]) -> bool:
    return any(m["role"] == "system" for m in chat["messages"][1:])


def to_chat(body: dict[str, Any], count_only: bool = False) -> dict[str, Any]:
    """The chat body of a Messages body. ``count_only``: a ``count_tokens`` body (it has no
    ``max_tokens``)."""
    max_tokens = 1 if count_only else body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _bad("'max_tokens' is required and must be a positive integer", "max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list", "messages")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _system(system, "system")})
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
            raise _bad("each message needs role 'user', 'assistant' or 'system'", where)
        if msg["role"] == "user":
            messages += _user(msg.get("content"), f"{where}.content")
        elif msg["role"] == "system":  # Claude Code's mid-conversation system messages
            messages.append({"role": "system", "content": _system(msg.get("content"), f"{where}.content")})
        else:
            messages.append(_assistant(msg.get("content"), f"{where}.content"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens}
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("'stop_sequences' must be a list of strings", "stop_sequences")
        chat["stop"] = stop
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        offered = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise _bad("a tool needs a name", f"tools[{i}]")
            if _typed(tool):
                continue  # not offered (``dropped`` notes it)
            fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
            if tool.get("description"):
                fn["description"] = tool["description"]
            offered.append({"type": "function", "function": fn})
        if offered:
            chat["tools"] = offered
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(tools, list) and _choice_gone(choice, tools)):
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "auto" or kind == "none":
            chat["tool_choice"] = kind
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "tool" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise _bad("'tool_choice' must be {type: auto|any|none|tool}", "tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else body.get("output_format")  # (deprecated)
    if fmt is not None:  # structured outputs (Claude Code's title calls): vLLM's JSON-schema grammar
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"),
                                                                                           dict)):
            raise _bad("'output_config.format' must be {type: 'json_schema', schema: {...}}",
                       "output_config.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": fmt["schema"]}}
    return carry_over(chat, body, _SAME)
