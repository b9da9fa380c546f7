"""A failed append never loses a later step (issue 25, low): a session's steps are indexed when their calls
end, so a concurrent call's step can be queued behind one whose group commit fails. Before, that later step
was written (the next group succeeded), the failed one left a hole in the session's indexes, the next call
took the later step's index again, and a restart's rebuild (which wanted contiguous indexes) dropped every
step from the hole on. Now the log writes nothing queued behind a failed group until it takes writes again
(those appends fail as well: their calls get the 503), the live session keeps its indexes its steps'
positions, and the rebuild keeps every step the log holds, a hole (a log written before) held by a failed
step. A real log and session manager; the disk failure is a stand-in (tests/faults.py:
FailingWriteInjector)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from faults import FailingWriteInjector

from steptap.middleware import files
from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import LogUnavailable
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import SessionOpened, Step, msgpack_encoder
from steptap.middleware.sessions.manager import SessionManager
from steptap.middleware.sessions.session import NOT_LOGGED

enc = msgpack_encoder.encode


def step(t: int) -> Step:
    """A call of its own (a new conversation each: logged whole)."""
    return Step(model="m", request={"messages": [{"role": "user", "content": f"task {t}"}]},
                prompt_token_ids=[t + 1, 5, 6], response_token_ids=[7, t], response_logprobs=[-0.5, -0.25],
                finish_reason="stop", response={"role": "assistant", "content": "ok"}, started_at=1000.0 + t)


def logged_steps(log: TrajectoryLog, sid: str) -> list[Step]:
    return [r for r in log.records() if isinstance(r, Step) and r.trajectory_id == sid]


async def test_a_call_queued_behind_a_failed_append_is_never_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = FailingWriteInjector(files.write_all)
    monkeypatch.setattr(files, "write_all", disk)
    log = await TrajectoryLog.open(str(tmp_path / "log"), probe_interval_s=0.05)
    cfg = ProxyConfig(log=str(tmp_path / "log"))
    manager = SessionManager(cfg, log, Metrics(), None, set())
    session = await manager.open(session_id="s")
    await manager.record(session, [step(0)])

    disk.arm()
    a = asyncio.ensure_future(manager.record(session, [step(1)]))  # its group commit fails
    while not disk.entered.is_set():  # the writer is inside that commit
        await asyncio.sleep(0.005)
    b = asyncio.ensure_future(manager.record(session, [step(2)]))  # a concurrent call, indexed after it
    queued = log._writer._queue  # type: ignore[union-attr]
    while queued.qsize() == 0:  # its append queues its frame behind the held commit
        await asyncio.sleep(0.005)
    disk.fail()
    got = await asyncio.gather(a, b, return_exceptions=True)
    # Before: b's step was written (the next group succeeded) and the session held steps [0, 2]
    assert [type(x) for x in got] == [LogUnavailable, LogUnavailable], got
    assert [s.index for s in logged_steps(log, "s")] == [0]
    assert [s.index for s in session.trajectory.steps] == [0]
    assert manager.steps_held == 1 and manager.bytes_held == session.bytes

    while log.degraded:  # the probe finds the disk writable again
        await asyncio.sleep(0.01)
    c = step(3)
    await manager.record(session, [c])
    assert c.index == 1  # before: index 2 again, the index of the step already in the log
    assert [s.index for s in session.trajectory.steps] == [0, 1]
    kept = logged_steps(log, "s")
    await log.close()

    log = await TrajectoryLog.open(str(tmp_path / "log"))
    again = SessionManager(cfg, log, Metrics(), None, set())
    assert await again.rebuild() == 1
    assert [enc(s) for s in again.sessions["s"].trajectory.steps] == [enc(s) for s in kept]
    await log.close()


async def test_the_rebuild_keeps_every_logged_step_of_a_session_with_a_hole(tmp_path: Path) -> None:
    """A log that holds steps 0, 2 and 3 of a session (step 1's append failed, written before the writer
    stopped at a failure): the rebuilt session keeps all three, step 1 held by a failed step; the next call
    is step 4, and the finished trajectory refers to the three logged steps (before: only step 0 was kept,
    and the next call took index 1)."""
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    await log.append(SessionOpened(trajectory_id="s"))
    written = []
    for i in (0, 2, 3):
        s = step(i)
        s.trajectory_id, s.index = "s", i
        written.append(s)
        await log.append(s)
    await log.close()

    log = await TrajectoryLog.open(str(tmp_path / "log"))
    manager = SessionManager(ProxyConfig(log=str(tmp_path / "log")), log, Metrics(), None, set())
    assert await manager.rebuild() == 1
    session = manager.sessions["s"]
    held = session.trajectory.steps
    assert [s.index for s in held] == [0, 1, 2, 3]
    assert held[1].status == "failed" and held[1].error is not None and held[1].error.type == NOT_LOGGED
    assert [enc(s) for s in held if s.index != 1] == [enc(s) for s in written]
    nxt = step(4)
    await manager.record(session, [nxt])
    assert nxt.index == 4
    await manager.add_reward(session, 1.0, "judge", 2)
    await manager.finish(session)
    [(_, traj)] = [x async for x in log.follow(until_idle=0)]
    assert [s.index for s in traj.steps] == [0, 2, 3, 4] and traj.steps[1].rewards == {"judge": 1.0}
    await log.close()
