"""Typed views of vLLM's chat completion replies and stream chunks, and stripping at the byte level.

The hot path of a chat call: the reply (or each SSE chunk) is decoded once into Structs that hold only what
capture reads (choices' index, message or delta, finish reason, token ids, the sampled tokens' logprobs; the
prompt's token ids; usage); everything else is skipped by the decoder. Token ids and logprobs are kept as
``msgspec.Raw`` first: they are decoded from it for the step, and when the agent did not ask for them, the
value is replaced by ``null`` in vLLM's own bytes instead of re-encoding the whole reply.

Why the byte replacement is exact: a key as JSON writes it (quote, name, quote, colon) can only be a key,
since a quote inside a string is escaped (``\\"``). The body is first checked to hold each stripped key
exactly as often as the typed view found it; each occurrence is then one of the values the view holds,
replaced in place. The other bytes are vLLM's own; the dict path re-encoded them, which gives the same bytes
for vLLM's compact JSON (strings escape alike) except for floats, and when the agent asked for neither token
ids nor logprobs no float is left (``tests/unit/test_replies.py`` compares both paths over recorded and real
replies; when the agent asked for logprobs the floats are now vLLM's own text, ``1e-07`` where a re-encode
wrote ``1e-7``).

Any shape this module does not expect (a decode error, a count that does not match, a chunk without choices)
makes ``None`` come back, and the caller takes the dict path of ``capture.py``.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import msgspec

from steptap.middleware.proxy.capture import CHAT, COMPLETIONS, Asked, make_step, message_response
from steptap.middleware.records import Step

_ABSENT = msgspec.Raw()  # a field the body did not have
_UNSET: Any = msgspec.UNSET
_NULL = b"null"
_IDS = b'_ids":'  # ends both "prompt_token_ids": and "token_ids":
_LOGPROBS = b'"logprobs":'

_Ids = list[int] | None | msgspec.UnsetType


class _Logprob(msgspec.Struct):
    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_Logprob] | None = None


class _Message(msgspec.Struct):
    role: Any = "assistant"
    content: Any = None
    tool_calls: Any = None
    reasoning_content: Any = msgspec.UNSET  # read before ``reasoning`` when present (even as null)
    reasoning: Any = None


class _Choice(msgspec.Struct):
    index: int = 0
    message: _Message | None = None
    logprobs: msgspec.Raw = _ABSENT  # raw: its bytes are replaced when stripped; decoded for the step
    finish_reason: str | None = None
    stop_reason: Any = None  # a stop string, a stop token id, or None (TITO: proxy/tito.py next_state)
    token_ids: _Ids = _UNSET


class ReplyView(msgspec.Struct):
    choices: list[_Choice]
    prompt_token_ids: _Ids = _UNSET


class _TextLogprobs(msgspec.Struct):
    token_logprobs: list[float | None] | None = None


class _TextChoice(msgspec.Struct):
    index: int = 0
    text: Any = None
    logprobs: msgspec.Raw = _ABSENT
    finish_reason: str | None = None
    stop_reason: Any = None
    token_ids: _Ids = _UNSET
    # Raw: for a token-id prompt vLLM echoes the ids the request holds (120k ids at 120k tokens), so they are
    # never decoded; only their count is checked (``_prompt_of``).
    prompt_token_ids: msgspec.Raw = _ABSENT


class CompletionView(msgspec.Struct):
    """A ``/v1/completions`` reply: the prompt ids are per choice."""

    choices: list[_TextChoice]


_reply_decoder = msgspec.json.Decoder(ReplyView)
_completion_decoder = msgspec.json.Decoder(CompletionView)
_logprobs_decoder = msgspec.json.Decoder(_Logprobs | None)
_text_logprobs_decoder = msgspec.json.Decoder(_TextLogprobs | None)
_ids_decoder = msgspec.json.Decoder(list[int] | None)


def _ids(value: _Ids) -> list[int] | None:
    return None if isinstance(value, msgspec.UnsetType) else value


def _logprobs(raw: msgspec.Raw) -> list[float] | None:
    lp = _logprobs_decoder.decode(raw) if len(raw) else None
    if lp is None or lp.content is None:
        return None
    return list(map(_logprob, lp.content))  # in C: no bytecode a token


_logprob = attrgetter("logprob")


def _text_logprobs(raw: msgspec.Raw) -> list[float] | None:
    lp = _text_logprobs_decoder.decode(raw) if len(raw) else None
    if lp is None or lp.token_logprobs is None:
        return None
    values = lp.token_logprobs
    if None not in values:  # one C scan; a None (no logprob: an echoed prompt's first token) is rare
        return values  # type: ignore[return-value]
    return [float("nan") if v is None else v for v in values]


def reply_view(data: bytes) -> ReplyView | None:
    """The typed view of a chat completion body, or None (take the dict path)."""
    try:
        return _reply_decoder.decode(data)
    except msgspec.DecodeError:  # ValidationError included
        return None


def completion_view(data: bytes) -> CompletionView | None:
    """The typed view of a ``/v1/completions`` body, or None (take the dict path)."""
    try:
        return _completion_decoder.decode(data)
    except msgspec.DecodeError:
        return None


def known_prompt(request: dict[str, Any]) -> list[int] | None:
    """A completions request's prompt when it is one list of token ids (the edge check typed every item as
    a string, an id or a list of ids, and vLLM refuses a mixed list, so the first item tells), else None."""
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return prompt
    return None


def _prompt_of(raw: msgspec.Raw, known: list[int] | None) -> list[int] | None:
    """A choice's prompt ids: the request's own list when vLLM's echo holds as many ids (a token prompt
    reaches the engine as sent), else the echo decoded."""
    if not len(raw):
        return None
    if known is not None:
        echo = bytes(raw)
        if echo.startswith(b"[") and echo.count(b",") + 1 == len(known):
            return known
    ids: list[int] | None = _ids_decoder.decode(raw)
    return ids


def steps_from_completion(view: CompletionView, known: list[int] | None, **common: Any) -> list[Step] | None:
    """What ``capture.steps_from_reply`` gives for a completions reply, or None (take the dict path).
    ``known``: the request's token-id prompt (``known_prompt``)."""
    steps = []
    try:
        for ch in view.choices:
            steps.append(make_step(
                COMPLETIONS, ch.index, _prompt_of(ch.prompt_token_ids, known), _ids(ch.token_ids),
                _text_logprobs(ch.logprobs), ch.finish_reason, {"text": ch.text}, common,
            ))
    except msgspec.DecodeError:
        return None
    steps.sort(key=lambda s: s.choice)
    return steps


def steps_from_view(view: ReplyView, echo: list[int] | None = None, **common: Any) -> list[Step] | None:
    """What ``capture.steps_from_reply`` gives for the same reply, or None (take the dict path). ``echo``: the
    prompt ids when they were taken out of the body before the view was decoded (``prompts.take_echo``)."""
    prompt = _ids(view.prompt_token_ids) if echo is None else echo
    steps = []
    try:
        for ch in view.choices:
            msg = ch.message or _Message()
            reasoning = msg.reasoning if msg.reasoning_content is _UNSET else msg.reasoning_content
            steps.append(make_step(
                CHAT, ch.index, prompt, _ids(ch.token_ids), _logprobs(ch.logprobs), ch.finish_reason,
                message_response(msg.role, msg.content, msg.tool_calls, reasoning), common,
            ))
    except msgspec.DecodeError:
        return None
    steps.sort(key=lambda s: s.choice)
    return steps


def _starts(data: bytes, key: bytes, expected: int) -> list[int] | None:
    """Where the value after each occurrence of ``key`` starts, when ``data`` holds it ``expected`` times."""
    found = []
    at = data.find(key)
    while at >= 0:
        found.append(at + len(key))
        if len(found) > expected:
            return None
        at = data.find(key, at + len(key))
    return found if len(found) == expected else None


def strip_reply_bytes(data: bytes, view: ReplyView | CompletionView, asked: Asked) -> bytes | None:
    """``data`` with what the agent did not ask for set to null (as ``capture.strip_reply`` and a re-encode
    would give), or None when the bytes are not the expected shape."""
    choices = view.choices
    cuts: list[tuple[int, int]] = []  # value spans that become null
    if not asked.token_ids:
        # Every "..._ids": key in the body is one of these (the count says so); each value is null or an
        # array of ints, which ends at its first "]".
        if isinstance(view, ReplyView):
            want = (view.prompt_token_ids is not _UNSET) + sum(ch.token_ids is not _UNSET for ch in choices)
        else:
            want = sum((ch.token_ids is not _UNSET) + (len(ch.prompt_token_ids) > 0) for ch in view.choices)
        starts = _starts(data, _IDS, want)
        if starts is None:
            return None
        for start in starts:
            if data.startswith(b"[", start):
                cuts.append((start, data.index(b"]", start) + 1))
            elif not data.startswith(_NULL, start):
                return None
    if not asked.logprobs:
        present = [ch.logprobs for ch in choices if len(ch.logprobs)]
        starts = _starts(data, _LOGPROBS, len(present))  # in body order, as the choices are
        if starts is None:
            return None
        for start, raw in zip(starts, present, strict=True):
            value = bytes(raw)
            if not data.startswith(value, start):
                return None
            if value != _NULL:
                cuts.append((start, start + len(value)))
    if not cuts:
        return data
    cuts.sort()
    parts: list[bytes] = []
    pos = 0
    for start, end in cuts:
        parts += (data[pos:start], _NULL)
        pos = end
    parts.append(data[pos:])
    return b"".join(parts)
