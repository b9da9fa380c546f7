"""Google's Gemini API, the conversation: a body's ``systemInstruction`` and ``contents`` as chat messages
(``messages_of``), and what every part of the request side shares (``Translation``, ``get``).

Gemini's JSON takes each field in lowerCamelCase or snake_case (proto JSON: ``systemInstruction`` or
``system_instruction``), so every field is read under either name (``get``); the agent's own data (function
arguments, schemas' property names) is never renamed. The body's other fields: ``gemini_request.py``; the
reply side and the errors: ``gemini.py``.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from steptap.middleware.errors import ApiError
from steptap.middleware.proxy.translation import HANDLE_KEY, MAX_NOTES, data_url
from steptap.middleware.proxy.translation import bad as _bad

# What Gemini CLI puts on a replayed function call that carries no signature (Google's API skips its check on
# it): no reasoning handle, as if absent.
SYNTHETIC_SIGNATURE = "skip_thought_signature_validator"
GENERATE, STREAM, COUNT = "generateContent", "streamGenerateContent", "countTokens"  # the path's methods
_SNAKE = re.compile(r"(?<!^)(?=[A-Z])")


def split_call(call: str) -> tuple[str, str]:
    """``tiny:streamGenerateContent`` -> (the model, the method); a 404 without a method."""
    model, sep, method = call.rpartition(":")
    if not sep or not model or not method:
        raise ApiError(404, f"no method in {call[:100]!r}: POST /v1beta/models/MODEL:generateContent",
                       "not_found")
    return model.removeprefix("models/"), method


@functools.lru_cache(maxsize=256)  # only ever given this package's field names
def snake(name: str) -> str:
    """``systemInstruction`` -> ``system_instruction``."""
    return _SNAKE.sub("_", name).lower()


def get(value: dict[str, Any], name: str) -> Any:
    """A field under its lowerCamelCase name or its snake_case one."""
    if name in value:
        return value[name]
    return value.get(snake(name))


def spellings(*names: str) -> frozenset[str]:
    """``names`` under both spellings."""
    return frozenset({*names, *(snake(n) for n in names)})


def unknown(value: dict[str, Any], names: frozenset[str] | tuple[str, ...]) -> list[str]:
    """The keys of ``value`` not among ``names`` (a ``spellings`` set, or names taken under both)."""
    both = names if isinstance(names, frozenset) else spellings(*names)
    return [k for k in value if k not in both]


_PART_KEYS = spellings("text", "inlineData", "fileData", "functionCall", "functionResponse", "executableCode",
                       "codeExecutionResult", "thought", "thoughtSignature", "videoMetadata")


class Translation:
    """A Gemini body translated: the chat body and what was dropped (``(field, metric label, reason)``)."""

    def __init__(self) -> None:
        self.chat: dict[str, Any] = {}
        self.notes: list[tuple[str, str, str]] = []
        self._calls = 0  # function calls without an id get ``call_<n>``, stable from turn to turn
        self._pending: dict[str, list[str]] = {}  # function name -> ids of its calls awaiting a response

    def note(self, field: str, label: str, reason: str) -> None:
        if len(self.notes) < MAX_NOTES:
            self.notes.append((field[:128], label, reason))
        elif len(self.notes) == MAX_NOTES:
            self.notes.append(("...", "other", "more fields dropped (not listed)"))

    def call_id(self, name: str, given: Any) -> str:
        cid = given if isinstance(given, str) and given else f"call_{self._calls}"
        self._calls += 1
        self._pending.setdefault(name, []).append(cid)
        return cid

    def response_id(self, name: str, given: Any) -> str:
        """A function response's call: its own id, else the oldest pending call of that name."""
        waiting = self._pending.get(name) or []
        if isinstance(given, str) and given:
            if given in waiting:
                waiting.remove(given)
            return given
        if waiting:
            return waiting.pop(0)
        self._calls += 1
        return f"call_{self._calls - 1}"


def obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad("must be an object", where)
    return value


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    parts = get(obj(content, where), "parts")
    if not isinstance(parts, list):
        raise _bad("'parts' must be a list", f"{where}.parts")
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            raise _bad("a part must be an object", f"{where}.parts[{i}]")
    return parts


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``inlineData`` image (or an http(s) ``fileData`` image) as a chat image part (proxy/vision.py)."""
    inline = get(part, "inlineData")
    if inline is not None:
        mime, data = get(obj(inline, f"{where}.inlineData"), "mimeType"), inline.get("data")
        if not isinstance(mime, str) or not isinstance(data, str):
            raise _bad("inlineData needs a string 'mimeType' and base64 'data'", f"{where}.inlineData")
        url = data_url(mime, data)
    else:
        fd = obj(get(part, "fileData"), f"{where}.fileData")
        mime, url = get(fd, "mimeType"), get(fd, "fileUri")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise _bad("fileData is served only for an image at an http(s) 'fileUri' (the Files API is not "
                       "served: send the image as inlineData)", f"{where}.fileData")
    if not isinstance(mime, str) or not mime.startswith("image/"):
        raise _bad(f"only images are served as media, not {str(mime)[:64]!r}", where)
    return {"type": "image_url", "image_url": {"url": url}}


def _extra_keys(part: dict[str, Any], where: str, tr: Translation) -> None:
    for key in unknown(part, _PART_KEYS):
        tr.note(f"{where}.{key}", "parts:other", "not honoured by this proxy")


def _response_text(response: dict[str, Any]) -> str:
    """A function response as the tool message's text: its ``output`` when that is all it holds (Google's
    convention for a function's output), else the whole object as JSON."""
    if set(response) == {"output"} and isinstance(response["output"], str):
        return response["output"]
    return json.dumps(response, ensure_ascii=False)


def _user(parts: list[dict[str, Any]], where: str, tr: Translation) -> list[dict[str, Any]]:
    """A user turn: its function responses become tool messages (in order), its text and images one user
    message after them."""
    out: list[dict[str, Any]] = []
    pieces: list[dict[str, Any]] = []
    for i, part in enumerate(parts):
        at = f"{where}.parts[{i}]"
        _extra_keys(part, at, tr)
        if isinstance(part.get("text"), str) and not part.get("thought"):
            pieces.append({"type": "text", "text": part["text"]})
        elif get(part, "inlineData") is not None or get(part, "fileData") is not None:
            pieces.append(_image(part, at))
        elif get(part, "functionResponse") is not None:
            out.append(_tool_message(get(part, "functionResponse"), f"{at}.functionResponse", tr))
        elif part.get("thought") or any(get(part, k) is not None for k in ("executableCode",
                                                                             "codeExecutionResult")):
            tr.note(at, "parts:hosted", "thoughts in a user turn and hosted code execution are dropped")
        else:
            raise _bad("a user part needs text, inlineData, fileData or functionResponse", at)
    if pieces or not out:
        if any(p["type"] == "image_url" for p in pieces):
            out.append({"role": "user", "content": pieces})
        else:
            out.append({"role": "user", "content": "".join(p["text"] for p in pieces)})
    return out


def _tool_message(fr: Any, where: str, tr: Translation) -> dict[str, Any]:
    fr = obj(fr, where)
    name, response = fr.get("name"), fr.get("response", {})
    if not isinstance(name, str) or not name:
        raise _bad("a functionResponse needs a string 'name'", where)
    text = _response_text(obj(response, f"{where}.response"))
    content: str | list[dict[str, Any]] = text
    media = fr.get("parts")
    if media:  # a multimodal function response: its images after its text
        if not isinstance(media, list):
            raise _bad("'parts' must be a list", f"{where}.parts")
        content = [{"type": "text", "text": text}]
        for j, p in enumerate(media):
            content.append(_image(obj(p, f"{where}.parts[{j}]"), f"{where}.parts[{j}]"))
    return {"role": "tool", "tool_call_id": tr.response_id(name, fr.get("id")), "content": content}


def _model(parts: list[dict[str, Any]], where: str, tr: Translation) -> dict[str, Any]:
    """A model turn: text parts as the content, thought parts as its reasoning (rendered where the template
    renders reasoning), function calls as tool calls, and the first signature as the reasoning handle
    (translation.reasoning_handle: spliced back in a TITO session when it names this session's step)."""
    text: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    signature: Any = None
    for i, part in enumerate(parts):
        at = f"{where}.parts[{i}]"
        _extra_keys(part, at, tr)
        sig = get(part, "thoughtSignature")
        if signature is None and isinstance(sig, str) and sig and sig != SYNTHETIC_SIGNATURE:
            signature = sig
        fc = get(part, "functionCall")
        if isinstance(part.get("text"), str):
            (thoughts if part.get("thought") else text).append(part["text"])
        elif fc is not None:
            fc = obj(fc, f"{at}.functionCall")
            name, args = fc.get("name"), fc.get("args", {})
            if not isinstance(name, str) or not name:
                raise _bad("a functionCall needs a string 'name'", f"{at}.functionCall")
            args = obj(args if args is not None else {}, f"{at}.functionCall.args")
            calls.append({"id": tr.call_id(name, fc.get("id")), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif any(get(part, k) is not None for k in ("executableCode", "codeExecutionResult")):
            tr.note(at, "parts:hosted", "hosted code execution parts are dropped")
        else:
            raise _bad("a model part needs text or functionCall", at)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if thoughts:
        msg["reasoning"] = "".join(thoughts)
    if signature is not None:
        msg[HANDLE_KEY] = signature
    if calls:
        msg["tool_calls"] = calls
    return msg


def _system(value: Any) -> str:
    if isinstance(value, str):
        return value
    texts = []
    for i, part in enumerate(_parts(value, "systemInstruction")):
        if not isinstance(part.get("text"), str):
            raise _bad("a system instruction holds text parts only", f"systemInstruction.parts[{i}]")
        texts.append(part["text"])
    return "\n".join(texts)


def messages_of(body: dict[str, Any], tr: Translation) -> list[dict[str, Any]]:
    contents = get(body, "contents")
    if not isinstance(contents, list) or not contents:
        raise _bad("'contents' must be a non-empty list", "contents")
    out: list[dict[str, Any]] = []
    system = get(body, "systemInstruction")
    if system is not None:
        out.append({"role": "system", "content": _system(system)})
    for i, content in enumerate(contents):
        where = f"contents[{i}]"
        parts = _parts(content, where)
        role = content.get("role", "user")
        if role not in ("user", "model", "function"):
            raise _bad("a content's role must be 'user' or 'model'", f"{where}.role")
        if not parts:
            tr.note(where, "contents:empty", "a content without parts is dropped")
        elif role == "model":
            out.append(_model(parts, where, tr))
        else:  # "function": the older API's role for function responses
            out += _user(parts, where, tr)
    return out
