"""A model call alone in the proxy (``calls_inflight`` 1) has its record synced on the event loop, not handed
to the log's writer thread and back (two thread wake-ups, about 80 us of a lone call's commit: issue 45); with
other calls in flight its record joins the thread's group commit. A real log and session manager, an anonymous
call and a named session's; the steps built by capture from a vLLM-shaped reply."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_choice_steps import call_steps
from test_wal import writer_callbacks

from steptap.middleware.config import ProxyConfig
from steptap.middleware.log import active
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Step, Trajectory
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.manager import SessionManager

MESSAGES = [{"role": "system", "content": "agent"}, {"role": "user", "content": "do it"}]


@pytest.mark.parametrize("inflight", [1, 2])
async def test_a_lone_calls_record_is_synced_on_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         inflight: int) -> None:
    monkeypatch.setattr(active, "INLINE_SYNC_S", 60.0)  # this machine's disk counts as quick (test_wal: not)
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    manager = SessionManager(ProxyConfig(log=str(tmp_path / "log")), log, Metrics(), None, set())
    named = await manager.open(session_id="named")
    anon = await manager.resolve(Identity(source="anonymous"))
    handed = writer_callbacks(monkeypatch)  # the threads that hand work back to the loop
    commits = log.stats.commits
    calls = [manager.admitted(f"peer{i}") for i in range(inflight)]  # the calls in flight (429 bounds)
    for session in (named, anon):
        async with manager.call(session, steps=1, size=100):
            await manager.record(session, call_steps(0, list(range(50)), MESSAGES, n=1))
    for call in calls:
        call.__exit__(None, None, None)
    from_thread = [name for name in handed if name == "steptap-wal-writer"]
    assert log.stats.commits == commits + 2
    # alone: both records synced on the loop; beside another call: both through the writer thread
    assert len(from_thread) == (0 if inflight == 1 else 2), handed
    await log.close()
    logged = list((await TrajectoryLog.open(str(tmp_path / "log"), readonly=True)).records())
    assert [r.trajectory_id for r in logged if isinstance(r, Step)] == ["named"]
    assert [r.anonymous for r in logged if isinstance(r, Trajectory) and r.status == "finished"] == [True]
