"""A TITO turn's prompt list: the list the previous turn was built from, once dead, grown in place into this
turn's (``tito.Turn._grow``), so no turn copies or frees a whole prompt; anything else gets a copy."""

from __future__ import annotations

from steptap.middleware.proxy.tito import Turn


def _turn(spare: tuple[list[int], list[int]] | None) -> Turn:
    turn = Turn(None, {}, None)  # type: ignore[arg-type]  # _grow reads neither the client nor the plan
    turn.spare = spare
    return turn


def _ids(n: int, start: int = 1000) -> list[int]:
    return [int(str(start + i)) for i in range(n)]  # distinct int objects, as decoded ids are


def test_a_dead_spare_is_grown_into_the_new_prompt() -> None:
    before = _ids(50)
    old = before + _ids(7, 5000)  # the previous turn's prompt, built from ``before``
    rest = _ids(9, 9000)
    turn = _turn((before, old))
    spare_id = id(before)
    del before  # the previous turn is done: only the session's pair held it
    got = turn._grow(old, rest)
    assert id(got) == spare_id  # the spare list itself, grown
    assert got == old + rest
    assert all(a is b for a, b in zip(got, old + rest, strict=True))  # the same id objects
    assert turn.spare is None
    assert len(old) == 57  # the previous prompt is left as it was


def test_a_spare_held_elsewhere_or_for_another_list_is_left_alone() -> None:
    before = _ids(50)
    old = before + _ids(7, 5000)
    rest = _ids(9, 9000)
    kept = before  # still read somewhere (a step, a turn in flight on the same state)
    got = _turn((before, old))._grow(old, rest)
    assert got == old + rest and got is not kept and kept == _ids(50)

    other = list(old)  # the state moved on to a prompt built otherwise (rendered): not the spare's
    spare = _ids(50)
    got = _turn((spare, other))._grow(old, rest)
    assert got == old + rest and spare == _ids(50)

    assert _turn(None)._grow(old, rest) == old + rest


def test_a_spare_longer_than_the_prompt_is_not_grown() -> None:
    old = _ids(10)
    spare = _ids(20)
    got = _turn((spare, old))._grow(old, [1])
    assert got == old + [1] and len(spare) == 20
