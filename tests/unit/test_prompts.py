"""A session's token prompt decoded from what is new (``proxy/prompts.py``): always the dict a whole decode
gives, and the old ids' objects reused only when the bytes continue the held prompt."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from steptap.middleware.proxy.prompts import decode_completion, grown_json
from steptap.middleware.sessions.prefix import Grown


def _body(prompt: object, **kw: object) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8, **kw}).encode()


Held = tuple[bytes, list[int]]


def _check(raw: bytes, held: Held | None) -> tuple[dict[str, Any], Held, Grown | None] | None:
    got = decode_completion(raw, held)
    if got is not None:
        assert got[0] == msgspec.json.decode(raw)
        assert list(got[0]) == list(msgspec.json.decode(raw))  # the keys in the agent's order
    return got


def test_a_continued_prompt_decodes_only_its_new_ids() -> None:
    first = _check(_body(list(range(300, 1300))), None)
    assert first is not None
    body, held, grown = first
    assert held[1] is body["prompt"] and grown is None
    # json.dumps writes ", " between ids: the held bytes then a comma after spaces, as the agent sends them
    nxt = _check(_body([*range(300, 1300), 7, 300, 5000]), held)
    assert nxt is not None
    ids = nxt[0]["prompt"]
    assert ids == [*range(300, 1300), 7, 300, 5000]
    assert all(a is b for a, b in zip(ids, held[1], strict=False))  # the old objects: an identity compare
    assert nxt[2] == (ids, held[1], None) and nxt[2][0] is ids and nxt[2][1] is held[1]  # extends' hint
    # compact JSON too
    compact = msgspec.json.encode({"prompt": [*range(300, 1300), 9]})
    assert _check(compact, (msgspec.json.encode(list(range(300, 1300))), held[1])) is not None


def test_other_bytes_decode_whole_and_give_the_same_body() -> None:
    held = _check(_body(list(range(300, 400))), None)[1]  # type: ignore[index]
    cases = [
        _body([*range(300, 399), 1, 2]),  # the last id changed: 399 -> 3991 would share text, so 1
        _body([*range(300, 399), 3991]),  # "399" is a prefix of "3991": not a comma after it
        _body(list(range(300, 400))),  # the same prompt again (a retry): no comma after it
        _body([*range(301, 401), 5]),
    ]
    for raw in cases:
        got = _check(raw, held)
        assert got is not None and got[0]["prompt"] == msgspec.json.decode(raw)["prompt"]
        assert got[2] is None  # decoded whole: no hint that it starts with the held ids
    retry = _check(cases[2], held)
    assert retry is not None and retry[0]["prompt"] is not held[1]


def test_shapes_it_leaves_to_the_whole_decode() -> None:
    held = _check(_body(list(range(300, 400))), None)[1]  # type: ignore[index]
    assert decode_completion(_body("text prompt"), held) is None
    assert decode_completion(_body([[1, 2], [3]]), held) is None  # a batch
    assert decode_completion(_body([*range(300, 400), 2.0]), held) is None  # not all ids
    assert decode_completion(_body([*range(300, 400), True]), held) is None
    assert decode_completion(_body([1, 2], vllm_xargs={"prompt": 1}), held) is None  # a second "prompt" key
    assert decode_completion(_body([1, 2], stop=['say "prompt']), held) is None  # ... or in a string
    assert decode_completion(b"[1, 2]", held) is None
    assert decode_completion(b'{"prompt": [1, 2', held) is None  # not JSON: the caller's 400
    assert decode_completion(b'{"model": "m"}', held) is None
    assert decode_completion(b'{"model": "m", "x": {"prompt": [1, 2]}}', held) is None  # nested only
    # a top-level key spelled with an escape, and another "prompt" nested: never the nested one's ids
    assert decode_completion(b'{"pr\\u006fmpt": null, "x": {"prompt": [1, 2]}}', held) is None
    # other escapes (a newline stop string, an escaped backslash before a "u") keep the fast path
    for stop in ("\n\n", "a\\u"):
        got = _check(_body([*range(300, 400), 7], stop=[stop]), held)
        assert got is not None and got[2] is not None and got[0]["stop"] == [stop]


_VALUE = st.recursive(st.none() | st.integers() | st.text(alphabet='"prompt[],{}\\ u\né'),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                          st.sampled_from(["prompt", "model", "x"]), inner, max_size=3), max_leaves=8)


@given(prompt=st.lists(st.integers(0, 2**31), max_size=30) | _VALUE,
       extra=st.dictionaries(st.sampled_from(["model", "stop", "x", "max_tokens"]), _VALUE, max_size=3))
def test_found_by_bytes_or_not_at_all(prompt: Any, extra: dict[str, Any]) -> None:
    """Whatever the body holds around its prompt (keys, strings, nested objects named "prompt"), what is
    found by bytes is what a whole decode gives (``_check`` asserts it), or nothing."""
    raw = _body(prompt, **extra)
    got = _check(raw, None)
    if got is not None:
        assert got[0]["prompt"] == prompt
        nxt = _check(_body([*got[0]["prompt"], 5], **extra), got[1])  # continued: the same, from the held
        assert nxt is not None and (nxt[2] is not None) == bool(prompt)  # (an empty one continues nothing)


def test_a_chat_reply_echo_is_decoded_from_what_is_new() -> None:
    from steptap.middleware.proxy.prompts import take_echo

    def reply(ids: list[int], content: str = "a") -> bytes:
        return msgspec.json.encode({"id": "c", "choices": [{"index": 0, "message": {"content": content},
                                                            "token_ids": [7, 8]}], "prompt_token_ids": ids})

    first = take_echo(reply(list(range(300, 1300))), None)
    assert first is not None
    rest, echo, ids, grown = first
    assert ids == list(range(300, 1300)) and grown is None and echo == msgspec.json.encode(ids)
    assert msgspec.json.decode(rest) == {**msgspec.json.decode(reply(ids)), "prompt_token_ids": None}
    raw = reply([*range(300, 1300), 7, 8, 42])  # the last prompt + its reply + the new message
    nxt = take_echo(raw, (echo, ids))
    assert nxt is not None and nxt[2] == [*range(300, 1300), 7, 8, 42]
    assert all(a is b for a, b in zip(nxt[2], ids, strict=False)) and nxt[3] == (nxt[2], ids, None)
    assert msgspec.json.decode(nxt[0]) == {**msgspec.json.decode(raw), "prompt_token_ids": None}
    same = take_echo(reply(ids), (echo, ids))  # a retry: the held list itself
    assert same is not None and same[2] is ids and same[3] is None
    other = take_echo(reply([1, *range(301, 1300), 5]), (echo, ids))  # other bytes: decoded whole
    assert other is not None and other[2] == [1, *range(301, 1300), 5] and other[3] is None
    # text that looks like the key is inside a string (its quotes escaped): not the echo
    quoted = take_echo(reply(ids, content='"prompt_token_ids": [1]'), None)
    assert quoted is not None and quoted[2] == ids
    assert take_echo(b'{"choices": [], "prompt_token_ids": null}', None) is None
    assert take_echo(b'{"prompt_token_ids": [1, 2], "x": {"prompt_token_ids": [3]}}', None) is None
    assert take_echo(b'{"prompt_token_ids": [1.5, 2]}', None) is None  # not ids: the dict path says so


_ID = st.integers(min_value=0, max_value=2**31)


@given(old=st.lists(_ID, max_size=40), rest=st.lists(_ID, max_size=40), spaced=st.booleans())
def test_grown_json_is_the_whole_encode(old: list[int], rest: list[int], spaced: bool) -> None:
    # The held bytes as msgspec writes them, or as an agent's json.dumps does (", " between ids)
    held_bytes = json.dumps(old).encode() if spaced else msgspec.json.encode(old)
    got = grown_json((held_bytes, old), rest)
    assert msgspec.json.decode(got) == old + rest  # what vLLM reads: the same ids
    if not spaced:
        assert got == msgspec.json.encode(old + rest)  # byte for byte the whole encode


@given(old=st.lists(_ID, max_size=60), keep=st.integers(min_value=0, max_value=60),
       new=st.lists(_ID, max_size=20), spaced=st.booleans(), block=st.sampled_from([1, 3, 16, 1 << 16]))
def test_an_edited_prompt_takes_the_ids_it_shares_from_the_held_list(old: list[int], keep: int,
                                                                     new: list[int], spaced: bool,
                                                                     block: int) -> None:
    """An echo (or token prompt) that starts with some of the held ids, then differs (an edited history):
    the ids are the whole decode's, the shared ones the held list's own objects; at any block size of the
    byte compare."""
    import steptap.middleware.proxy.prompts as prompts
    from steptap.middleware.proxy.prompts import take_echo

    def enc(ids: list[int]) -> bytes:
        return json.dumps(ids).encode() if spaced else msgspec.json.encode(ids)

    held_ids = msgspec.json.decode(enc(old))
    ids = [*old[:keep], *new]
    raw = b'{"choices": [], "prompt_token_ids": ' + enc(ids) + b"}"
    saved, prompts._BLOCK = prompts._BLOCK, block
    try:
        got = take_echo(raw, (enc(old), held_ids))
        body = decode_completion(_body(ids), (json.dumps(old).encode(), held_ids))
    finally:
        prompts._BLOCK = saved
    assert got is not None and got[2] == ids and msgspec.json.decode(got[1]) == ids
    assert body is not None and body[0]["prompt"] == ids
    for taken in (got[2], body[0]["prompt"]):
        shared = 0
        while shared < min(len(ids), len(old)) and ids[shared] == old[shared]:
            shared += 1
        # every id before the last shared comma is the held object (the last shared may be cut in its text)
        whole = max(0, shared - 1)
        assert all(taken[i] is held_ids[i] for i in range(whole)) or taken is held_ids


def test_shared_bytes_is_the_common_start() -> None:
    from steptap.middleware.proxy.prompts import _shared_bytes

    a = bytes(range(256)) * 1000
    for at in (0, 1, 65535, 65536, 65537, 100000, len(a) - 1):
        b = a[:at] + b"\xff\xfe" + a[at + 2:]
        assert _shared_bytes(a, b) == at + (a[at] == 0xFF)
    assert _shared_bytes(a, a) == len(a) and _shared_bytes(a, a[:10]) == 10 and _shared_bytes(b"", a) == 0
