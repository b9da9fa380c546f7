"""Prefix continuity: ``extends`` exactly when the ids continue token for token, else the break's cause."""

from __future__ import annotations

from typing import Any

import pytest

from steptap.middleware.records import Step
from steptap.middleware.sessions.prefix import classify


def S(c: str) -> dict[str, Any]:
    return {"role": "system", "content": c}


def U(c: str) -> dict[str, Any]:
    return {"role": "user", "content": c}


def A(c: str | None, calls: list[dict[str, Any]] | None = None, **kw: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": c, **kw}
    if calls:
        msg["tool_calls"] = calls
    return msg


def step(
    messages: list[dict[str, Any]],
    prompt: list[int],
    response: list[int] = (),  # type: ignore[assignment]
    reply: dict[str, Any] | None = None,
) -> Step:
    return Step(
        request={"messages": messages},
        prompt_token_ids=list(prompt),
        response_token_ids=list(response),
        response=reply or {"role": "assistant", "content": "a2"},
    )


PREV = step([S("s"), U("u1"), A("a1"), U("u2")], [1, 2, 3, 4], [5, 6])


def test_first_and_extends() -> None:
    assert classify(None, PREV) == "first"
    nxt = step([S("s"), U("u1"), A("a1"), U("u2"), A("a2"), U("u3")], [1, 2, 3, 4, 5, 6, 7, 8])
    assert classify(PREV, nxt) == "extends"
    # extends is decided by ids alone: even an exact equal prompt (no new tokens) continues
    assert classify(PREV, step([], [1, 2, 3, 4, 5, 6])) == "extends"


@pytest.mark.parametrize(
    "messages, cause",
    [
        # same conversation, other tokens (the template re-rendered the reply)
        ([S("s"), U("u1"), A("a1"), U("u2"), A("a2"), U("u3")], "rerendered"),
        # reasoning dropped and content as text parts: the same messages
        (
            [
                S("s"),
                U("u1"),
                A("a1", reasoning_content="hmm"),
                U("u2"),
                A("a2"),
                U([{"type": "text", "text": "u3"}]),
            ],
            "rerendered",
        ),
        # an earlier message changed
        ([S("s"), U("u1 edited"), A("a1"), U("u2"), A("a2"), U("u3")], "history_edited"),
        ([S("other"), U("u1"), A("a1"), U("u2"), A("a2"), U("u3")], "history_edited"),
        ([S("s"), U("u1"), A("a1"), U("u2"), A("a2 changed"), U("u3")], "history_edited"),
        # history dropped: a middle part, the tail, or a retry without the reply
        ([S("s"), U("u2"), A("a2"), U("u3")], "truncated"),
        ([S("s"), U("u1"), U("u3")], "truncated"),
        ([S("s"), U("u1"), A("a1"), U("u2")], "truncated"),
    ],
)
def test_break_causes(messages: list[dict[str, Any]], cause: str) -> None:
    assert classify(PREV, step(messages, [1, 2, 3, 9, 9, 9, 9])) == cause


def test_tool_call_arguments_compare_as_json() -> None:
    call = {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    prev = step([U("add")], [1, 2], [3, 4], reply=A(None, [call]))
    same = {"id": "other-id", "type": "function", "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}
    tool = {"role": "tool", "tool_call_id": "other-id", "content": "5"}
    assert classify(prev, step([U("add"), A(None, [same]), tool], [1, 2, 9])) == "rerendered"
    other = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 4}'}}
    assert classify(prev, step([U("add"), A(None, [other]), tool], [1, 2, 9])) == "history_edited"


def test_completions_use_ids_only() -> None:
    prev = Step(
        endpoint="completions", request={"prompt": "x"}, prompt_token_ids=[1, 2, 3], response_token_ids=[4]
    )
    assert classify(prev, Step(request={"prompt": "y"}, prompt_token_ids=[1, 2, 3, 4, 5])) == "extends"
    assert classify(prev, Step(request={"prompt": "y"}, prompt_token_ids=[1, 2])) == "truncated"
    assert classify(prev, Step(request={"prompt": "y"}, prompt_token_ids=[1, 9, 3, 4])) == "history_edited"


def test_after_an_n_choice_call_the_continued_choice_counts() -> None:
    from steptap.middleware.sessions.prefix import classify_after

    choices = [step([U("q")], [1, 2], [3 + i], reply=A(f"c{i}")) for i in range(3)]
    nxt = step([U("q"), A("c1"), U("more")], [1, 2, 4, 9])
    assert classify_after(choices, nxt) == "extends"
    assert classify(choices[-1], nxt) != "extends"
    assert classify_after([], nxt) == "first"


def test_a_prompt_built_from_the_previous_lists_compares_only_what_is_new() -> None:
    from steptap.middleware.sessions.prefix import extends

    prev = Step(prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5])
    tito = prev.prompt_token_ids + prev.response_token_ids + [9]  # proxy/tito.py's build
    grown = (tito, prev.prompt_token_ids, prev.response_token_ids)
    assert extends(prev, Step(prompt_token_ids=tito), grown)
    tokens = prev.prompt_token_ids + [4, 6, 9]  # proxy/prompts.py's: the old list + the decoded rest
    assert not extends(prev, Step(prompt_token_ids=tokens), (tokens, prev.prompt_token_ids, None))
    tokens = prev.prompt_token_ids + [4, 5, 9]
    assert extends(prev, Step(prompt_token_ids=tokens), (tokens, prev.prompt_token_ids, None))
    # a hint about other lists (another call's, a copy) is not taken: the ids are compared
    other = [1, 7, 3, 4, 5, 9]
    assert not extends(prev, Step(prompt_token_ids=other), (list(other), prev.prompt_token_ids, None))
    assert not extends(prev, Step(prompt_token_ids=other), (other, [1, 2, 3], None))
    assert not extends(prev, Step(prompt_token_ids=[1, 2, 3, 4]), ([1, 2, 3, 4], prev.prompt_token_ids, None))


def test_extends_compares_the_whole_prompt_after_its_end_agrees() -> None:
    from steptap.middleware.sessions.prefix import extends

    ids = list(range(1000, 1300))
    prev = Step(prompt_token_ids=ids, response_token_ids=[7, 8])
    assert extends(prev, Step(prompt_token_ids=ids + [7, 8, 9]))
    edited = [*ids[:10], 5, *ids[11:]]  # far from the end: the end agrees, the whole compare finds it
    assert not extends(prev, Step(prompt_token_ids=edited + [7, 8, 9]))
    moved = ids[:-3] + [7, 8] + ids[-3:]  # the end moved after the reply (OpenClaw's context message)
    assert not extends(prev, Step(prompt_token_ids=moved + [9]))


@pytest.mark.parametrize("seed", range(20))
def test_a_sessions_norms_equal_normalizing_each_message(seed: int) -> None:
    """``Norms`` reuses the forms of held lists' messages (same place, same object or equal) and normalizes
    the rest: over a session of edits, moves, drops and new messages it equals normalizing every message."""
    import random

    from steptap.middleware.sessions.prefix import Norms, _norm

    rng = random.Random(seed)
    pool = [U("u1"), A("a1"), U([{"type": "text", "text": "u1"}]), A(None, [{"function": {
        "name": "f", "arguments": '{"a": 1}'}}]), {"role": "tool", "content": "5"}, U(""), S("s"),
        U([{"type": "image_url", "image_url": {"url": "data:x"}}]), A("a1", reasoning_content="r")]
    norms = Norms()
    messages = [S("s"), U("task")]
    for _ in range(30):
        change = rng.randrange(5)
        if change == 0:  # new messages
            messages = messages + [dict(rng.choice(pool)) for _ in range(rng.randrange(1, 4))]
        elif change == 1 and len(messages) > 2:  # one edited in place (a new object)
            i = rng.randrange(len(messages))
            messages = [*messages[:i], {**messages[i], "content": f"edit {rng.random()}"}, *messages[i + 1:]]
        elif change == 2 and len(messages) > 2:  # one moved to the end
            i = rng.randrange(len(messages))
            messages = [*messages[:i], *messages[i + 1:], messages[i]]
        elif change == 3:  # dropped from the middle
            messages = messages[:1] + messages[rng.randrange(1, len(messages) + 1):]
        else:  # the same conversation, decoded again: equal, not the same objects
            messages = [dict(m) for m in messages]
        for _ in range(rng.randrange(1, 3)):  # judged once or more (plan, prefix, class)
            got = norms(messages)
            assert got == [_norm(m) for m in messages]
            got.append("callers may append")
        if rng.random() < 0.5:
            norms.settle()


def test_norms_keep_text_and_other_content_apart() -> None:
    from steptap.middleware.sessions.prefix import _norm

    # a text whose characters are a JSON list is not the list itself
    assert _norm(U('["a"]')) != _norm(U(["a"]))  # type: ignore[arg-type]
    assert _norm(U("")) == _norm(A(None) | {"role": "user"})
