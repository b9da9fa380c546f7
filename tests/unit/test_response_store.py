"""The Responses store (``previous_response_id``) is bounded in bytes and age, kept only for named sessions,
and one session cannot push out another's conversations (issue 25, item 3 and a low)."""

from __future__ import annotations

import pytest

from steptap.middleware.errors import ApiError
from steptap.middleware.proxy.responses import ResponseStore

MSG = [{"role": "user", "content": "a"}]


def kept(store: ResponseStore, sid: str | None, rid: str) -> bool:
    try:
        store.history(sid, rid)
    except ApiError as exc:
        assert exc.status == 404
        return False
    return True


def test_anonymous_calls_store_nothing() -> None:
    store = ResponseStore()
    store.put(None, "r1", [{"role": "user", "content": "x" * 1000}])
    assert not kept(store, None, "r1") and store.bytes == 0


def test_the_store_is_bounded_in_bytes() -> None:
    store = ResponseStore(max_bytes=10_000)
    big = [{"role": "user", "content": "x" * 4000}]
    for i in range(5):
        store.put("s", f"r{i}", big)
    assert store.bytes <= 10_000
    assert kept(store, "s", "r4") and not kept(store, "s", "r0")
    # Larger than the whole store: not kept
    store.put("s", "huge", [{"role": "user", "content": "x" * 20_000}])
    assert not kept(store, "s", "huge") and store.bytes <= 10_000


def test_the_store_forgets_old_conversations(monkeypatch: pytest.MonkeyPatch) -> None:
    import steptap.middleware.proxy.responses as responses

    now = [1000.0]
    monkeypatch.setattr(responses.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_age_s=60)
    store.put("s", "r1", MSG)
    now[0] += 61
    assert not kept(store, "s", "r1") and store.bytes == 0


def test_one_session_cannot_push_out_anothers() -> None:
    store = ResponseStore(max_entries=100, per_session=3)
    store.put("quiet", "q1", MSG)
    for i in range(50):
        store.put("busy", f"b{i}", MSG)
    assert kept(store, "quiet", "q1")
    assert [kept(store, "busy", f"b{i}") for i in (46, 47, 48, 49)] == [False, True, True, True]
