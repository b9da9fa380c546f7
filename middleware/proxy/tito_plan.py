"""Whether a token-in-token-out turn extends the session's previous one, and what the next turn extends.

``plan`` judges a chat body against the previous turn's ``State``: its messages as sent + the reply as
returned, then new messages (``tokens``), else the cause of the fallback to rendering (``proxy/tito.py``'s
docstring names them). ``next_state`` is what the turn leaves for the next one.

An agent resends its whole history every turn, so the messages are msgpack-encoded once a call
(``Plan.packed``, reused by ``next_state``) and compared with the previous turn's bytes: one encode and one
byte compare instead of normalizing every message (an int is not taken for a float or a bool, as ``==``
would). The compare also tells the log's delta that the messages start with the previous step's
(``delta.Kept``), so it does not encode both lists again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from steptap.middleware.proxy.translation import parse_handle, reasoning_of
from steptap.middleware.records import Step, msgpack_encoder, sorted_json_encoder
from steptap.middleware.sessions.prefix import Norms, _message_cause, _norm, normalized

_packer = msgpack_encoder


class State(NamedTuple):
    """What the next turn of a TITO session extends."""

    sent: bytes  # the turn's messages as sent, msgpack items (a next turn starting with them: same bytes)
    reply: Any  # the reply as returned, normalized
    tools: bytes  # the tools, as JSON (a change of tools changes the system prompt: no extension)
    prompt_ids: list[int]
    response_ids: list[int]
    ended: bool  # the reply ended on its own, not by max_tokens
    reasoning: str | None = None  # the reply's reasoning as logged
    response_id: str | None = None  # what a reasoning handle names (a Responses or Messages reply's id)
    cut: str = ""  # the reply ended on a stop string or stop token the agent named: why nothing extends it
    reasoned: bool = False  # a reply of this sequence carried reasoning: its markers are in the next prompts
    messages: list[Any] | None = None  # the turn's messages, the list as sent

    def conversation(self, norms: Norms | None = None) -> list[Any]:
        """The normalized messages + the reply as returned (only for a turn that does not start with the
        same bytes: normalizing a long history is what the byte compare saves)."""
        return normalized(self.messages, norms) + [self.reply] if self.messages is not None else []


class Plan(NamedTuple):
    """A TITO turn: the new messages after the previous turn (empty: fall back, ``cause`` says why)."""

    new: list[dict[str, Any]]
    state: State | None
    cause: str
    packed: tuple[list[Any], bytes] | None = None  # the messages and their msgpack (``next_state`` takes it)
    same: bool = False  # they start with the previous turn's messages, byte for byte


def _tools_key(chat: dict[str, Any]) -> bytes:
    return sorted_json_encoder.encode(chat.get("tools") or [])  # ~80 kB of an agent's tools: 0.04 ms


def plan(state: State | None, chat: dict[str, Any], handles: dict[int, str] | None = None,
         session_id: str | None = None, norms: Norms | None = None) -> Plan:
    """Whether this chat body extends the previous turn, and with which messages. ``handles``: the reasoning
    handles the assistant messages were replayed with (by assistant message); ``session_id``: the
    session's."""
    messages = chat.get("messages")
    packed: tuple[list[Any], bytes] | None = None
    if isinstance(messages, list) and (data := _pack(messages)) is not None:
        packed = (messages, data)
    if state is None:
        return Plan([], None, "first", packed)
    if state.cut:
        return Plan([], state, state.cut, packed)
    if chat.get("stop"):
        # vLLM's derender does not cut the text at a stop string (the chat route does): rendered, the agent
        # gets the reply it would get in normal mode
        return Plan([], state, "stop_strings", packed)
    if not isinstance(messages, list):
        return Plan([], state, "no_messages")
    if (chat.get("n") or 1) != 1:
        return Plan([], state, "n", packed)
    n = len(state.messages or ()) + 1  # the previous turn's messages + its reply
    # msgpack items are self-delimiting: bytes that start with the previous items' are those items
    same = bool(state.sent) and packed is not None and packed[1].startswith(state.sent,
                                                                             _header(len(messages)))
    if not (len(messages) >= n and same and _norm(messages[n - 1]) == state.reply):
        # not the previous messages as sent: judged on the normalized conversation (reasoning, tool-call
        # ids, content parts), as prefix.py does
        conv = normalized(messages, norms)
        old = state.conversation(norms)
        if conv[: len(old)] != old:
            return Plan([], state, _message_cause(old, conv), packed, same)
    cause = ("no_new_messages" if len(messages) == n else "tools_changed" if _tools_key(chat) != state.tools
             else "reply_unfinished" if not state.ended else None)
    if cause is None:
        replayed = messages[n - 1]
        nth = sum(1 for m in messages[:n] if isinstance(m, dict) and m.get("role") == "assistant") - 1
        cause = _reasoning_cause(state, replayed, (handles or {}).get(nth), session_id)
    if cause is not None:
        return Plan([], state, cause, packed, same)
    return Plan(messages[n:], state, "tokens", packed, same)


def _pack(messages: list[Any]) -> bytes | None:
    try:
        return _packer.encode(messages)
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError):
        return None


def _header(n: int) -> int:
    """The bytes of a msgpack array's header before its ``n`` items (fixarray, array 16, array 32)."""
    return 1 if n < 16 else 3 if n < 1 << 16 else 5


def _reasoning_cause(state: State, replayed: Any, handle: str | None, session_id: str | None) -> str | None:
    """Why the replayed reply cannot stand for its logged tokens (None: it can)."""
    text = (reasoning_of(replayed) if isinstance(replayed, dict) else None) or None
    if handle is not None:
        named = parse_handle(handle)
        if named is None:
            return "handle_foreign"
        if state.response_id is None or named != (state.response_id, session_id):
            return "handle_unknown"
    if text is not None and text != state.reasoning:
        return "reasoning_edited"
    if state.reasoning and text is None and handle is None:
        return "reasoning_dropped"
    return None


def next_state(chat: dict[str, Any], step: Step, stop_reason: Any = None, before: State | None = None,
               packed: tuple[list[Any], bytes] | None = None) -> State | None:
    """The state after a turn from ``before`` (None: not extendable); ``stop_reason``: vLLM's (str, int);
    ``packed``: the turn's ``Plan.packed`` (its messages' msgpack, not encoded again)."""
    messages = chat.get("messages")
    if step.status != "ok" or not isinstance(messages, list) or not step.response_token_ids:
        return None
    if stop_reason is not None:
        # cut by a stop string or a stop token the agent named: its last token need not end a turn, and an end
        # token spliced after it would be one the model never sampled; the next turn is rendered
        return State(b"", None, b"", [], [], False, cut="reply_stop_string" if isinstance(stop_reason, str)
                     else "reply_stop_token")
    data = packed[1] if packed is not None and packed[0] is messages else _pack(messages)
    if data is None:
        return None
    ended = step.finish_reason in ("stop", "tool_calls")  # which token ended it: checked against the template
    response_id = step.response.get("response_id")
    # The step's own id lists, not copies (a step is never changed once recorded; the next prompt is a new
    # list): copying 120k ids a turn was linear in the context for nothing
    reasoning = reasoning_of(step.response) or None
    return State(data[_header(len(messages)):], _norm(step.response), _tools_key(chat), step.prompt_token_ids,
                 step.response_token_ids, ended, reasoning, response_id if isinstance(response_id, str) else
                 None, reasoned=reasoning is not None or (before is not None and before.reasoned),
                 messages=messages)
