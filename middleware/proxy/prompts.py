"""A session's token prompt decoded from what is new: a ``/v1/completions`` body whose prompt is token ids,
and vLLM's echo of a chat call's prompt ids (``take_echo``).

An agent sends its whole context every call: at 120k tokens the prompt is a 0.6 MB JSON array, and decoding it
(120k int objects) was the proxy's largest cost per call. A session keeps the raw bytes of its latest prompt
with the ids they decoded to (``CallState.prompt``, proxy/call_state.py); a prompt whose bytes start with
them, up to the closing ``]`` and then a comma, holds the same ids first (the same text), so only the bytes
after the comma are decoded and the list is the old one + the new ids. The new list shares the old one's int
objects, which also makes the prefix check (``sessions/prefix.extends``) an identity compare.

Anything else (no session, no ``prompt`` key where expected, another shape, other bytes) decodes the whole
body: the result is the same dict either way.

A chat call's prompt is messages, but vLLM's reply echoes its prompt ids (``return_token_ids``): the same
held bytes and ids serve it, so a chat session's step decodes only the ids of the last reply and its new
messages, and its continuity check is an identity compare too.

A prompt that shares only a start with the held one (an edited history: a message changed or moved) takes
the ids before the last comma of the shared bytes from the held list and decodes the rest (``_shared``).

The other way, a TITO turn sends vLLM the previous prompt + the reply + the new messages' ids: its JSON is the
held bytes continued (``grown_json``), only the new ids encoded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from steptap.middleware.records import json_encoder
from steptap.middleware.sessions.prefix import Grown

if TYPE_CHECKING:
    from steptap.middleware.proxy.call_state import CallState
    from steptap.middleware.sessions.manager import SessionManager
    from steptap.middleware.sessions.session import LiveSession

_decode = msgspec.json.decode
_encode = json_encoder.encode
_ids = msgspec.json.Decoder(list[int])  # strict: a float or a bool is not an id
_KEY = b'"prompt"'
_SPACE = b" \t\r\n"


def decode_completion(raw: bytes, held: tuple[bytes, list[int]] | None
                      ) -> tuple[dict[str, Any], tuple[bytes, list[int]], Grown | None] | None:
    """The body of ``raw`` (as ``msgspec.json.decode`` gives it), what the session holds for its next call
    (the prompt's bytes and ids) and, when the ids continue the held ones, how they were built (for
    ``prefix.extends``); None: decode it whole.

    Found by bytes, not by parsing the whole body: the value after the one ``"prompt"`` key, up to its first
    ``]`` (an array of ids ends there; anything else does not decode as ids), and the rest of the body decoded
    with null in its place, which must then be the top-level key's value. A body with a ``\\u`` escape could
    spell another key "prompt": decoded whole."""
    found = _array_at(raw, _KEY)
    if found is None or _may_escape_a_key(raw):
        return None
    at, end = found
    prompt = raw[at:end + 1]
    try:
        ids = _extend(prompt, held) if held is not None else None
        grown: Grown | None = None if ids is None or held is None else (ids, held[1], None)
        if ids is None:
            ids = _shared(prompt, held) or _ids.decode(prompt)
        body = _decode(b"".join((raw[:at], b"null", raw[end + 1:])))
    except msgspec.DecodeError:  # not all ids (text, a batch), or not JSON: decode it whole
        return None
    if not isinstance(body, dict) or "prompt" not in body or body["prompt"] is not None:
        return None  # the one "prompt" was not the top-level key
    body["prompt"] = ids
    return body, (prompt, ids), grown


ECHO_KEY = b'"prompt_token_ids"'  # the key of vLLM's echo of a chat prompt's ids


def _array_at(raw: bytes, key: bytes) -> tuple[int, int] | None:
    """Where the array after the one ``key`` in ``raw`` starts (past its colon and spaces) and where its first
    ``]`` is (an array of ids ends there; anything else fails to decode as ids); None when the key is absent,
    there more than once, or not followed by a colon and a ``[``. The array is not searched for the key: ids
    hold no quote."""
    found = raw.find(key)
    if found < 0:
        return None
    at = found + len(key)
    while at < len(raw) and raw[at] in _SPACE:
        at += 1
    if raw[at:at + 1] != b":":
        return None
    at += 1
    while at < len(raw) and raw[at] in _SPACE:
        at += 1
    end = raw.find(b"]", at)
    if raw[at:at + 1] != b"[" or end < 0 or raw.find(key, end) >= 0:
        return None
    return at, end


def _may_escape_a_key(raw: bytes) -> bool:
    """Whether ``raw`` may hold a ``\\u`` escape, with which a key could spell "prompt" (a backslash is found
    at memchr speed; past a few of them, taken as yes: the whole decode decides)."""
    at = raw.find(b"\\")
    for _ in range(_ESCAPES_LOOKED_AT):
        if at < 0:
            return False
        if raw[at + 1:at + 2] == b"u":
            return True
        at = raw.find(b"\\", at + 2)  # past the escaped character (an escaped backslash too)
    return True


_ESCAPES_LOOKED_AT = 64


def take_echo(data: bytes, held: tuple[bytes, list[int]] | None
              ) -> tuple[bytes, bytes, list[int], Grown | None] | None:
    """vLLM's echo of a chat call's prompt ids (a chat reply, or a stream's first chunk): ``data`` with the
    echo's value replaced by ``null`` (decoded, it gives the same dict less the ids), the echo's bytes, its
    ids (only what is new decoded when they continue the held ones: an agent's next call echoes the last
    prompt + reply + its new messages) and how they were built (``prefix.extends``); None: no echo of ids
    there (or more than one key of that name), decode it whole. A ``"prompt_token_ids":`` in ``data`` is a
    key (a quote in a string is escaped), and an array of ids ends at its first ``]``."""
    found = _array_at(data, ECHO_KEY)
    if found is None:
        return None
    at, end = found
    echo = data[at:end + 1]
    if held is not None and echo == held[0]:
        return b"".join((data[:at], b"null", data[end + 1:])), echo, held[1], None  # the same bytes: ids
    try:
        ids = _extend(echo, held) if held is not None else None
        grown: Grown | None = None if ids is None or held is None else (ids, held[1], None)
        if ids is None:
            ids = _shared(echo, held) or _ids.decode(echo)
    except msgspec.DecodeError:
        return None
    return b"".join((data[:at], b"null", data[end + 1:])), echo, ids, grown


Echo = tuple[bytes, bytes, list[int], Grown | None]  # take_echo's: (the rest, the echo, its ids, how built)


def session_echo(data: bytes, manager: SessionManager, session: LiveSession, state: CallState,
                 built: tuple[bytes, list[int]] | None) -> Echo | None:
    """``take_echo`` for a chat reply or first chunk of ``session``: its ids held for the next call (a named
    session's). ``built``: a TITO turn's prompt (its JSON, its ids), which its stream echoes."""
    if built is not None:
        return take_echo(data, built)
    if session.trajectory.anonymous:
        return None  # one call: nothing to continue
    echo = take_echo(data, state.prompt)
    if echo is not None:
        state.hold_prompt(manager, session, (echo[1], echo[2]))
        state.grown = echo[3]
    return echo


def _extend(prompt: bytes, held: tuple[bytes, list[int]]) -> list[int] | None:
    """The ids of ``prompt`` when it continues the held prompt (its bytes up to the ``]``, then a comma)."""
    old, old_ids = held
    n = len(old) - 1  # up to the closing bracket
    if len(prompt) <= n or not prompt.startswith(memoryview(old)[:n]):
        return None
    at = n
    while at < len(prompt) and prompt[at] in _SPACE:
        at += 1
    if prompt[at:at + 1] != b"," or old.rstrip(_SPACE)[-1:] != b"]" or not old_ids:
        return None
    return old_ids + _ids.decode(b"[" + prompt[at + 1:])


def _shared(prompt: bytes, held: tuple[bytes, list[int]] | None) -> list[int] | None:
    """The ids of ``prompt`` when it starts with some of the held prompt's (an edited history: the same bytes
    up to a comma): those taken from the held list, only the rest decoded; None when no id is shared whole.
    The shared ids are the held list's int objects, so ``delta.shared_prefix`` compares them by identity."""
    if held is None or not held[1]:
        return None
    old, old_ids = held
    cut = old.rfind(b",", 0, _shared_bytes(prompt, old))  # the ids before it are whole in both
    if cut < 0:
        return None
    n = old.count(b",", 0, cut + 1)
    if n > len(old_ids):
        return None
    ids = old_ids[:n]
    ids.extend(_ids.decode(b"[" + prompt[cut + 1:]))
    return ids


_BLOCK = 1 << 16


def _shared_bytes(a: bytes, b: bytes) -> int:
    """How many first bytes ``a`` and ``b`` share: compared a block at a time (memcmp, no copies), then
    bisected in the block where they differ."""
    n, view, i = min(len(a), len(b)), memoryview(b), 0
    while i + _BLOCK <= n and a.startswith(view[i:i + _BLOCK], i):
        i += _BLOCK
    lo, hi = i, min(i + _BLOCK, n)  # a[:lo] == b[:lo]
    if a.startswith(view[lo:hi], lo):
        return hi
    while hi - lo > 1:  # a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a.startswith(view[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


def grown_json(held: tuple[bytes, list[int]], rest: list[int]) -> bytes:
    """The JSON of ``held``'s ids + ``rest``: the held bytes (a JSON array of those ids) continued, only
    ``rest`` encoded (encoding 120k ids a turn was linear in the context)."""
    old, old_ids = held
    if not rest:
        return old
    if not old_ids:
        return _encode(rest)
    # a view, not a slice: the 0.6 MB of held bytes are copied once, into the new JSON
    return b"".join((memoryview(old)[:len(old.rstrip(_SPACE)) - 1], b",", _encode(rest)[1:]))
