"""What the proxy holds for a session between its calls (``proxy/call_state.py``), with a real session
manager on a real log (no model call): its bytes count in the session's and the proxy's while the session is
open and are freed with it; the recorder's part of it is handed over once, in the call's context; and the
table keeps no entry past its session: finished, timed out, forgotten (a pending auto session), anonymous."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from steptap.middleware.config import ProxyConfig
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import Metrics
from steptap.middleware.proxy.call_state import POINTER, CallStates
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.manager import SessionManager
from steptap.middleware.sessions.session import LiveSession


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[SessionManager]:
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    yield SessionManager(ProxyConfig(log=str(tmp_path / "log")), log, Metrics(), None, set())
    await log.close()


def _gone(states: CallStates, session: LiveSession) -> weakref.ref[LiveSession]:
    """A weak reference to ``session`` once the caller drops its own: dead when nothing else holds it."""
    assert session in states
    return weakref.ref(session)


async def test_held_bytes_count_while_open_and_go_with_the_session(manager: SessionManager) -> None:
    states = CallStates()
    session = await manager.open()
    opened, held = session.bytes, manager.holdings.bytes_held
    state = states.of(session)
    assert states.of(session) is state  # one entry per session
    ids = list(range(300))
    state.hold_prompt(manager, session, (b"x" * 1000, ids))
    assert (session.bytes, manager.holdings.bytes_held) == (opened + 1000, held + 1000)
    state.tito_spare = (ids, [])  # a TITO turn's spare list counts a pointer an id, with the next prompt
    state.hold_prompt(manager, session, (b"y" * 400, ids))
    more = 400 + POINTER * 300
    assert (session.bytes, manager.holdings.bytes_held) == (opened + more, held + more)
    await manager.finish(session)
    assert manager.holdings.bytes_held == held - opened  # the session's bytes, what the proxy held included
    gone = _gone(states, session)
    del session, state
    gc.collect()
    assert gone() is None and len(states) == 0


async def test_the_recorder_takes_grown_and_kept_once(manager: SessionManager) -> None:
    session = await manager.open()
    state = CallStates().of(session)
    grown: tuple[list[int], list[int], list[int] | None] = ([1, 2, 3], [1], [2])
    state.grown, state.kept = grown, ([], [], 0)
    ctx = state.context(["m"])
    assert ctx.chat == ["m"] and ctx.grown is grown and ctx.kept == ([], [], 0)
    assert (state.grown, state.kept) == (None, None)  # held, they would keep the last prompt alive
    assert state.context() == (None, None, None)


async def test_no_entry_outlives_a_timed_out_forgotten_or_anonymous_session(manager: SessionManager) -> None:
    states = CallStates()
    timed = await manager.open(idle_timeout_s=0.0)
    states.of(timed).hold_prompt(manager, timed, (b"z" * 100, [1]))
    auto = await manager.resolve(Identity("path", session_id="agent-1"), "peer")
    assert auto.pending
    before = auto.bytes
    states.of(auto).hold_prompt(manager, auto, (b"z" * 100, [1]))  # not counted: it is not open yet
    assert auto.bytes == before and manager.holdings.bytes_held == timed.bytes
    anon = await manager.resolve(Identity("anonymous"))
    assert states.of(anon) is not states.of(anon) and anon not in states  # one call: its state is the call's
    refs = [_gone(states, s) for s in (timed, auto)] + [weakref.ref(anon)]
    auto.last_active -= 10 * manager.config.auto_session_idle_timeout_s
    manager.sweep()  # closes the idle session, forgets the pending one no call holds
    for _ in range(200):
        if timed.id in manager.closed:
            break
        await asyncio.sleep(0.01)
    assert manager.closed[timed.id] == "timed_out" and auto.id not in manager.pending
    assert manager.holdings.bytes_held == 0
    del timed, auto, anon
    gc.collect()
    assert [r() for r in refs] == [None, None, None] and len(states) == 0
