"""The TITO plan's one encode a call: its byte match across msgpack header sizes, the next state built from
the same bytes, and the log's delta told which messages the match kept (``delta.Kept``)."""

from __future__ import annotations

from typing import Any

import pytest

from steptap.middleware.delta import compress, expand
from steptap.middleware.proxy import tito_plan
from steptap.middleware.records import Step, msgpack_encoder


def _turns(n: int) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(n)]


def _step(messages: list[Any], prompt: list[int], reply: str) -> Step:
    return Step(prompt_token_ids=prompt, response_token_ids=[7, 2], finish_reason="stop", status="ok",
                request={"model": "m", "messages": messages},
                response={"role": "assistant", "content": reply})


@pytest.mark.parametrize("before", [1, 14, 15, 16, 65_535])  # each side of a header size (1, 3, 5 bytes)
def test_the_byte_match_holds_across_header_sizes(before: int) -> None:
    first = {"messages": _turns(before)}
    decided = tito_plan.plan(None, first)
    assert decided.cause == "first" and decided.packed is not None
    assert decided.packed[1] == msgpack_encoder.encode(first["messages"])  # encoded once, here
    state = tito_plan.next_state(first, _step(first["messages"], [1, 2], "ok"), packed=decided.packed)
    assert state is not None
    reply = {"role": "assistant", "content": "ok"}
    chat = {"messages": [*first["messages"], reply, {"role": "user", "content": "next"}]}
    later = tito_plan.plan(state, chat)
    assert (later.cause, later.same, later.new) == ("tokens", True, chat["messages"][-1:])
    # an edit anywhere in the history breaks the match, and the plan says why
    edited = {"messages": [{"role": "user", "content": "other"}, *chat["messages"][1:]]}
    assert tito_plan.plan(state, edited)[2:] == ("history_edited", (edited["messages"],
                                                                   msgpack_encoder.encode(edited["messages"])),
                                                 False)


def test_equal_values_of_other_types_are_not_a_byte_match() -> None:
    # 1, 1.0 and True compare equal in Python; a template renders them differently
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{}"}, "n": 1}]}
    first = {"messages": [{"role": "user", "content": "a"}, call, {"role": "tool", "tool_call_id": "c",
                                                                   "content": "r"}]}
    state = tito_plan.next_state(first, _step(first["messages"], [1], "ok"))
    assert state is not None
    for value in (1.0, True):
        changed = {**call, "tool_calls": [{**call["tool_calls"][0], "n": value}]}
        chat = {"messages": [first["messages"][0], changed, first["messages"][2],
                             {"role": "assistant", "content": "ok"}, {"role": "user", "content": "b"}]}
        assert chat["messages"][1] == call  # equal by ==
        assert not tito_plan.plan(state, chat).same


def test_the_next_state_reuses_the_plans_bytes_only_for_the_same_list() -> None:
    chat = {"messages": _turns(3)}
    decided = tito_plan.plan(None, chat)
    step = _step(chat["messages"], [1, 2], "ok")
    reused = tito_plan.next_state(chat, step, packed=decided.packed)
    fresh = tito_plan.next_state(chat, step)
    assert reused is not None and fresh is not None and reused.sent == fresh.sent
    # bytes planned for another list (the body changed since) are not taken
    stale = (_turns(3), b"\x93stale")
    assert tito_plan.next_state(chat, step, packed=stale).sent == fresh.sent  # type: ignore[union-attr]


def test_the_kept_messages_make_the_same_delta_without_encoding_them() -> None:
    old = _turns(5)
    base = _step(old, [1, 2, 3], "ok")
    new = [*old, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    step = _step(new, [1, 2, 3, 7, 2, 4], "fine")
    plain = compress(step, base)
    told = compress(step, base, (new, old, len(old)))
    assert msgpack_encoder.encode(told) == msgpack_encoder.encode(plain)
    assert told.delta is not None and told.delta.tails == {"messages": 5}
    assert msgpack_encoder.encode(expand(told, base)) == msgpack_encoder.encode(step)
    # a witness for other lists says nothing about these: the delta compares them itself
    wrong = compress(step, base, (list(new), old, 1))
    assert msgpack_encoder.encode(wrong) == msgpack_encoder.encode(plain)


def test_the_tools_are_compared_whatever_their_key_order() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    first = {"messages": _turns(1), "tools": [tool]}
    state = tito_plan.next_state(first, _step(first["messages"], [1], "ok"))
    reordered = {"function": {"parameters": {"type": "object"}, "name": "f"}, "type": "function"}
    turn = [*first["messages"], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "b"}]
    assert tito_plan.plan(state, {"messages": turn, "tools": [reordered]}).cause == "tokens"
    renamed = {**tool, "function": {**tool["function"], "name": "g"}}
    assert tito_plan.plan(state, {"messages": turn, "tools": [renamed]}).cause == "tools_changed"
