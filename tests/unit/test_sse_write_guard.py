"""The stream's bound on each write to the agent (``sse._WriteGuard``, one timer a stream): a write that waits
past ``stream_write_timeout_s`` ends as ``_AgentStalled``, however many quick writes came before it; quick
writes never trip it, nor does the time between writes; a cancel from elsewhere (a swap's cut, a shutdown)
stays a cancel."""

from __future__ import annotations

import asyncio

import pytest

from steptap.middleware.proxy.sse import _AgentStalled, _send, _WriteGuard


class Out:
    """A stand-in for the agent's ``StreamResponse``: each write waits ``delay`` seconds (a reader that takes
    its bytes slowly, or not at all)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.written: list[bytes | None] = []

    async def write(self, data: bytes) -> None:
        await asyncio.sleep(self.delay)
        self.written.append(data)

    async def write_eof(self) -> None:
        await asyncio.sleep(self.delay)
        self.written.append(None)


async def test_quick_writes_spread_past_the_bound_never_trip_it() -> None:
    guard = _WriteGuard(0.1)
    out = Out()
    try:
        for _ in range(6):  # 0.3 s of writes and pauses: three times the bound, each write instant
            await _send(out, b"x", guard)  # type: ignore[arg-type]
            await asyncio.sleep(0.05)
        await _send(out, None, guard)  # type: ignore[arg-type]
    finally:
        guard.close()
    assert out.written == [b"x"] * 6 + [None]


async def test_a_write_that_waits_past_the_bound_is_a_stalled_agent() -> None:
    guard = _WriteGuard(0.1)
    out = Out()
    try:
        await asyncio.sleep(0.07)  # the timer's first check falls inside the slow write: it re-arms for it
        await _send(out, b"first", guard)  # type: ignore[arg-type]
        out.delay = 10.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(_AgentStalled):
            await _send(out, b"stuck", guard)  # type: ignore[arg-type]
        assert 0.09 <= loop.time() - t0 < 1.0  # the write's own bound, not the stream's age
        current = asyncio.current_task()
        assert current is not None and current.cancelling() == 0  # the guard's cancel taken back
        await asyncio.sleep(0)  # and nothing left pending on the task
    finally:
        guard.close()
    assert out.written == [b"first"]


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    async def call() -> None:
        guard = _WriteGuard(5.0)
        try:
            await _send(Out(delay=10.0), b"x", guard)  # type: ignore[arg-type]
        finally:
            guard.close()

    task = asyncio.create_task(call())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
