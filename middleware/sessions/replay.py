"""Open sessions rebuilt from the log after a restart (their steps, rewards, groups). ``Replay`` is a mixin
of ``SessionManager`` (manager.py), which holds the state it reads."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import msgspec

from steptap.middleware.delta import DeltaError, Expander
from steptap.middleware.records import (
    Held,
    HeldDropped,
    RewardAdded,
    SessionOpened,
    Step,
    Trajectory,
    msgpack_encoder,
)
from steptap.middleware.sessions.classify import SUPERSEDES, Decision, advance, supersede
from steptap.middleware.sessions.limits import RECORD_SLACK
from steptap.middleware.sessions.session import LiveSession, full_sizes, not_logged

if TYPE_CHECKING:
    from collections import OrderedDict

    from steptap.middleware.metrics import Metrics
    from steptap.middleware.records import TrajectoryStatus
    from steptap.middleware.sessions.limits import Holdings
    from steptap.middleware.sessions.session import Log

logger = logging.getLogger("steptap.sessions")


class Replay:
    """``SessionManager``'s restart."""

    log: Log
    metrics: Metrics
    sessions: dict[str, LiveSession]
    closed: dict[str, TrajectoryStatus]
    recent: OrderedDict[str, Trajectory]
    held: dict[str, Held]
    held_bytes: dict[str, int]
    holdings: Holdings
    if TYPE_CHECKING:  # SessionManager's and Groups'
        @property
        def steps_held(self) -> int: ...
        @property
        def bytes_held(self) -> int: ...
        def _register(self, session: LiveSession) -> None: ...
        @staticmethod
        def _apply_reward(traj: Trajectory, record: RewardAdded) -> None: ...
        def _group_member_closed(self, traj: Trajectory) -> None: ...
        def _held(self, record: Held) -> None: ...
        def _unheld(self, sid: str) -> Held | None: ...

    async def rebuild(self) -> int:
        """Rebuild the open sessions from the log (blocking reads, so in a thread, before serving starts)."""
        return await asyncio.to_thread(self._rebuild_sync)

    def _rebuild_sync(self) -> int:
        expander = Expander()  # the full form of each open session's latest call
        for start, record in self.log.located_records():
            if isinstance(record, SessionOpened):
                if record.anonymous:
                    continue
                traj = record.trajectory()
                self.closed.pop(traj.id, None)
                rebuilt = LiveSession(traj, record.key)
                rebuilt.tito = record.tito
                self._register(rebuilt)
            elif isinstance(record, Step):
                session = self.sessions.get(record.trajectory_id)
                if session is not None and record.index >= len(session.trajectory.steps):
                    try:
                        full = expander.full(record)
                    # Its base is not in the log: the rest of the chain cannot be read
                    except DeltaError as exc:
                        logger.error("session %s: step %d left out at rebuild: %s", session.id, record.index,
                                     exc)
                        continue
                    steps = session.trajectory.steps
                    if record.index > len(steps):  # a step whose append failed before it (a log written
                        # before the writer stopped at a failure): its index held by a failed step, as live
                        logger.warning("session %s: steps %d-%d are not in the log; step %d is", session.id,
                                       len(steps), record.index - 1, record.index)
                        steps.extend(not_logged(session.id, i) for i in range(len(steps), record.index))
                    steps.append(record)
                    session.starts[record.index] = start
                    if record.status == "ok":  # the main line as it was: its opening, its branch
                        advance(session.line, Decision(record.call_class, record.call_rule, record.branch),
                                full)
                        if record.call_rule == SUPERSEDES:  # as recorded live: what it replaced is side
                            supersede(steps, record.index)
                elif session is not None:  # its index given twice (a log written before the writer stopped
                    # at a failure)
                    logger.error("session %s: step %d left out at rebuild: the index is taken", session.id,
                                 record.index)
            elif isinstance(record, RewardAdded):
                session = self.sessions.get(record.trajectory_id)
                if session is not None:
                    self._apply_reward(session.trajectory, record)
            elif isinstance(record, Trajectory) and not record.anonymous:
                session = self.sessions.pop(record.id, None)
                expander.forget(record.id)
                self.closed[record.id] = record.status
                if session is not None or self._unheld(record.id) is not None:  # closed, or released
                    self._group_member_closed(record)
            elif isinstance(record, Held):  # finished with its reward pending: held until released
                session = self.sessions.pop(record.trajectory.id, None)
                expander.forget(record.trajectory.id)
                self.closed[record.trajectory.id] = record.trajectory.status
                if session is not None:  # its steps, for GET /sessions/<id>
                    done = record.trajectory
                    self.recent[session.id] = msgspec.structs.replace(
                        session.trajectory, status=done.status, rewards=done.rewards,
                        reward_sources=done.reward_sources)
                self._held(record)
            elif isinstance(record, HeldDropped) and self._unheld(record.trajectory_id) is not None:
                self.closed[record.trajectory_id] = "aborted"
        for session in self.sessions.values():
            session.full = expander.last_call(session.id)
            steps = session.trajectory.steps
            sizes: dict[int, tuple[int, int]] = {}
            for i in sorted(session.full):  # as ``record`` counted them (a choice after its first)
                d = steps[i].delta
                if d is not None and d.kind == "choice" and d.base in sizes:
                    sizes[i] = full_sizes(steps[i], self.holdings.size_of([steps[i]]), session.full[d.base],
                                          sizes)
                else:
                    n = self.holdings.size_of([session.full[i]])
                    sizes[i] = (n, n)
            session.full_sizes = sizes
            session.full_extra = sum(n for i, (n, _) in session.full_sizes.items()
                                     if steps[i].delta is not None)
            session.bytes = (len(msgpack_encoder.encode(session.trajectory))
                             + RECORD_SLACK * len(session.starts) + session.full_extra)
        self.holdings.hold(  # what the open sessions hold, and the held trajectories' records
            sum(len(x.trajectory.steps) for x in self.sessions.values()) - self.steps_held,
            sum(x.bytes for x in self.sessions.values()) + sum(self.held_bytes.values()) - self.bytes_held,
        )
        self.metrics.sessions_open.set(len(self.sessions))
        self.metrics.held.set(len(self.held))
        return len(self.sessions)
