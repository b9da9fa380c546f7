"""Prefix continuity between consecutive steps of a session.

A step ``extends`` the previous one when its prompt ids start with the previous prompt + response ids, token
for token: the two can then be merged into one training sequence. Otherwise the break gets a cause, decided
from the messages (what the agent sent) and the ids (what the template rendered):

- ``first``: no previous step;
- ``rerendered``: the conversation so far is unchanged (previous messages + previous reply come back as the
  start of this request), yet the template rendered other tokens (e.g. the assistant turn re-rendered without
  its reasoning, or tool-call JSON re-serialized);
- ``truncated``: history was dropped (messages removed, or a retry of the previous prompt without the reply);
- ``history_edited``: an earlier message was changed.

Pure functions; the cost is one list compare per step (no tokenization).
"""

from __future__ import annotations

import json
from typing import Any

from steptap.middleware.delta import shared_prefix
from steptap.middleware.records import PrefixCause, Step


def _args(value: Any) -> Any:
    # Tool-call arguments are a JSON string; agents re-serialize them (spacing, key order): compare parsed.
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _norm(msg: Any) -> Any:
    """A message reduced to what identifies it in a conversation (reasoning and tool-call ids are ignored:
    agents commonly drop the first and rewrite the second; both only change the rendering). Text content
    stays a ``str``; anything else (parts with images) is its JSON in a 1-tuple, so the two never meet."""
    if not isinstance(msg, dict):
        return msg
    content = msg.get("content")
    if content == "":
        content = None
    if isinstance(content, list):  # [{"type": "text", "text": ...}] is the same as the joined text
        if all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(p.get("text", "") for p in content) or None
    if content is not None and not isinstance(content, str):
        content = (json.dumps(content, sort_keys=True),)
    calls = tuple(
        (
            (c.get("function") or {}).get("name"),
            json.dumps(_args((c.get("function") or {}).get("arguments")), sort_keys=True),
        )
        for c in msg.get("tool_calls") or ()
        if isinstance(c, dict)
    )
    return (msg.get("role"), content, calls, msg.get("name"))


class Norms:
    """A session's latest message lists and their normalized forms. A call that does not extend the last one
    has its messages judged by the TITO plan, its prefix cause and its class, and the next call judges them
    again as the previous call's: at 400 messages each pass cost milliseconds. A message at the same place
    in a held list, the same object or equal (``==``, at C speed), takes that list's form; only the others
    are normalized."""

    __slots__ = ("_held",)
    KEEP = 2  # lists held while a call is judged: its own and the previous call's

    def __init__(self) -> None:
        self._held: list[tuple[list[Any], list[Any]]] = []  # (a copy of the list, its normalized form)

    def __call__(self, messages: list[Any]) -> list[Any]:
        """``[_norm(m) for m in messages]`` (a new list: callers append to it)."""
        start: list[Any] = []
        for msgs, norm in self._held:  # the longest start shared with a held list, compared at C speed
            k = shared_prefix(messages, msgs)
            if k > len(start):
                start = norm[:k]
        out = start
        fresh = False
        for i in range(len(start), len(messages)):
            m = messages[i]
            for msgs, norm in self._held:
                if i < len(msgs) and (msgs[i] is m or msgs[i] == m):
                    out.append(norm[i])
                    break
            else:
                out.append(_norm(m))
                fresh = True
        if fresh or not any(len(msgs) == len(messages) for msgs, _ in self._held):
            self._held = [(list(messages), out), *self._held[:self.KEEP - 1]]
        return list(out)

    def settle(self) -> None:
        """The call is judged: only its list is held for the next one (the last normalized)."""
        del self._held[1:]


def normalized(messages: list[Any], norms: Norms | None = None) -> list[Any]:
    return norms(messages) if norms is not None else [_norm(m) for m in messages]


def _conversation(step: Step, messages: list[Any] | None, norms: Norms | None = None) -> list[Any] | None:
    """The step's conversation, normalized: ``messages`` (its request in chat form, as the relay translated
    it for Messages and Responses), else a chat request's own messages (None for ``/v1/completions``, or a
    translated step whose translation is not at hand, e.g. rebuilt after a restart)."""
    if messages is None and step.endpoint == "chat.completions":
        messages = step.request.get("messages")
    if not isinstance(messages, list):
        return None
    return normalized(messages, norms)


def first_messages(step: Step, messages: list[Any] | None = None, n: int = 2) -> list[Any]:
    """The first ``n`` normalized messages of ``step``'s conversation (the system prompt and the task,
    mostly); ``messages``: its request in chat form, when translated."""
    if messages is not None:
        messages = messages[:n]
    elif step.endpoint == "chat.completions" and isinstance(step.request.get("messages"), list):
        messages = step.request["messages"][:n]
    return (_conversation(step, messages) or [])[:n]


def messages_of(step: Step, messages: list[Any] | None = None, norms: Norms | None = None) -> list[Any]:
    """``step``'s whole conversation normalized (empty for ``/v1/completions``, or a translated step whose
    translation is not at hand); ``messages``: its request in chat form, when translated."""
    return _conversation(step, messages, norms) or []


Grown = tuple[list[int], list[int], list[int] | None]
"""A prompt id list as the proxy built it: (the list, the list it starts with, the list right after that or
None): ``old + rest`` (proxy/prompts.py) or ``prompt + response + rest`` (proxy/tito.py)."""


def extends(prev: Step, step: Step, grown: Grown | None = None) -> bool:
    """Whether ``step``'s prompt ids start with ``prev``'s prompt + response ids (both in full form).
    ``grown``: how ``step``'s list was built, when the proxy built it from ``prev``'s own lists: those items
    are not compared again (at 120k ids the compare and its slice were linear in the context)."""
    n, r = len(prev.prompt_token_ids), len(prev.response_token_ids)
    ids = step.prompt_token_ids
    if len(ids) < n + r:
        return False
    if grown is not None and grown[0] is ids and grown[1] is prev.prompt_token_ids:
        return grown[2] is prev.response_token_ids or ids[n:n + r] == prev.response_token_ids
    if ids[n:n + r] != prev.response_token_ids or ids[max(0, n - 64):n] != prev.prompt_token_ids[-64:]:
        return False  # most breaks show at the end of the previous prompt: not compared whole
    return ids[:n] == prev.prompt_token_ids


def classify(prev: Step | None, step: Step, old_chat: list[Any] | None = None,
             new_chat: list[Any] | None = None, grown: Grown | None = None,
             norms: Norms | None = None) -> PrefixCause:
    """The prefix cause of ``step`` given the session's previous step; ``old_chat`` / ``new_chat``: their
    requests in chat form, when the relay translated them (Messages, Responses); ``grown``: see
    ``extends``; ``norms``: the session's (``Norms``)."""
    if prev is None:
        return "first"
    if extends(prev, step, grown):
        return "extends"
    before = prev.prompt_token_ids + prev.response_token_ids
    ids = step.prompt_token_ids
    chained = step.request.get("previous_response_id") if step.endpoint == "responses" else None
    if chained is not None:  # the proxy carried the history itself: intact if it chains the previous call
        same = chained == prev.response.get("response_id") and (
            prev.request.get("instructions") == step.request.get("instructions"))
        return "rerendered" if same else "history_edited"
    old = _conversation(prev, old_chat, norms)
    new = _conversation(step, new_chat, norms)
    if old is None or new is None:  # /v1/completions: only the ids to go by
        if len(ids) < len(before) and before[: len(ids)] == ids:
            return "truncated"
        return "history_edited"
    old.append(_norm(prev.response))
    return _message_cause(old, new)


_RANK: dict[str, int] = {"extends": 0, "rerendered": 1, "truncated": 2, "history_edited": 3, "first": 4}


def classify_after(prev_call: list[Step], step: Step, old_chat: list[Any] | None = None,
                   new_chat: list[Any] | None = None, grown: Grown | None = None,
                   norms: Norms | None = None) -> PrefixCause:
    """The cause against the previous call, which may have had several choices (``n > 1``): the agent went on
    from one of them, so the most continuous verdict wins."""
    if not prev_call:
        return "first"
    return min((classify(prev, step, old_chat, new_chat, grown, norms) for prev in prev_call),
               key=_RANK.__getitem__)


def _message_cause(old: list[Any], new: list[Any]) -> PrefixCause:
    if new[: len(old)] == old:
        return "rerendered"
    # Longest prefix of `new` that is a subsequence of `old`; `skipped`: did the match jump over old messages?
    j = 0
    skipped = False
    m = 0
    for msg in new:
        k = j
        while k < len(old) and old[k] != msg:
            k += 1
        if k == len(old):
            break
        skipped = skipped or k > j
        j = k + 1
        m += 1
    rest = new[m:]
    if skipped:
        # messages were dropped; if an old message reappears after a new one, something was also edited
        return "history_edited" if any(msg in old for msg in rest) else "truncated"
    # new[:m] == old[:m]; the next new message, if any, replaced old[m]
    if not rest:
        return "truncated"  # a prefix of the old conversation (e.g. a retry without the reply)
    if m < len(old) and isinstance(rest[0], tuple) and rest[0][0] == old[m][0]:
        return "history_edited"  # same role at the same position, other content
    if m < len(old) and not any(msg in old for msg in rest):
        return "truncated"  # rolled back to an earlier point and went on from there
    return "history_edited"
