"""Open sessions rebuilt from the log after a restart (``Replayer``): their steps, rewards, groups, and the
held trajectories with their deadlines."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from steptap.middleware.delta import DeltaError, Expander
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import (
    Held,
    HeldDropped,
    LogRecord,
    RewardAdded,
    SessionOpened,
    Step,
    Trajectory,
    msgpack_encoder,
)
from steptap.middleware.sessions.classify import SUPERSEDES, Decision, advance, supersede
from steptap.middleware.sessions.groups import Groups
from steptap.middleware.sessions.holding import Holder
from steptap.middleware.sessions.limits import RECORD_SLACK, Holdings
from steptap.middleware.sessions.registry import Registry
from steptap.middleware.sessions.rewarding import apply_reward
from steptap.middleware.sessions.session import LiveSession, Log, full_sizes, not_logged

logger = logging.getLogger("steptap.sessions")


class Replayer:
    def __init__(self, log: Log, metrics: Metrics, holdings: Holdings, registry: Registry, groups: Groups,
                 holder: Holder) -> None:
        self.log = log
        self.metrics = metrics
        self.holdings = holdings
        self.registry = registry
        self.groups = groups
        self.holder = holder

    async def rebuild(self) -> int:
        """Rebuild the open sessions from the log (blocking reads, so in a thread, before serving starts)."""
        return await asyncio.to_thread(self._rebuild_sync)

    def _rebuild_sync(self) -> int:
        expander = Expander()  # the full form of each open session's latest call
        for start, record in self.log.located_records():
            self._replay(start, record, expander)
        sessions = self.registry.sessions
        for session in sessions.values():
            self._hold_latest(session, expander)
        self.holdings.hold(  # what the open sessions hold, and the held trajectories' records
            sum(len(x.trajectory.steps) for x in sessions.values()) - self.holdings.steps_held,
            sum(x.bytes for x in sessions.values()) + sum(self.holder.held_bytes.values())
            - self.holdings.bytes_held,
        )
        self.metrics.sessions_open.set(len(sessions))
        self.metrics.held.set(len(self.holder.held))
        return len(sessions)

    def _replay(self, start: str, record: LogRecord, expander: Expander) -> None:
        registry = self.registry
        if isinstance(record, SessionOpened):
            if not record.anonymous:
                traj = record.trajectory()
                registry.closed.pop(traj.id, None)
                rebuilt = LiveSession(traj, record.key)
                rebuilt.tito = record.tito
                registry.register(rebuilt)
        elif isinstance(record, Step):
            session = registry.sessions.get(record.trajectory_id)
            if session is not None:
                self._step(session, start, record, expander)
        elif isinstance(record, RewardAdded):
            session = registry.sessions.get(record.trajectory_id)
            if session is not None:
                apply_reward(session.trajectory, record)
        elif isinstance(record, Trajectory) and not record.anonymous:
            session = registry.sessions.pop(record.id, None)
            expander.forget(record.id)
            registry.closed[record.id] = record.status
            if session is not None or self.holder.unhold(record.id) is not None:  # closed, or released
                self.groups.member_closed(record)
        elif isinstance(record, Held):  # finished with its reward pending: held until released
            self._held(record, expander)
        elif isinstance(record, HeldDropped) and self.holder.unhold(record.trajectory_id) is not None:
            registry.closed[record.trajectory_id] = "aborted"

    @staticmethod
    def _step(session: LiveSession, start: str, record: Step, expander: Expander) -> None:
        """An open session's logged step, kept (every one: a hole in the indexes held by a ``not_logged``
        step), and the main line as it was."""
        steps = session.trajectory.steps
        if record.index < len(steps):  # its index given twice (a log written before the writer stopped at a
            # failure)
            logger.error("session %s: step %d left out at rebuild: the index is taken", session.id,
                         record.index)
            return
        try:
            full = expander.full(record)
        except DeltaError as exc:  # its base is not in the log: the rest of the chain cannot be read
            logger.error("session %s: step %d left out at rebuild: %s", session.id, record.index, exc)
            return
        if record.index > len(steps):  # a step whose append failed before it (a log written before the writer
            # stopped at a failure): its index held by a failed step, as live
            logger.warning("session %s: steps %d-%d are not in the log; step %d is", session.id, len(steps),
                           record.index - 1, record.index)
            steps.extend(not_logged(session.id, i) for i in range(len(steps), record.index))
        steps.append(record)
        session.starts[record.index] = start
        if record.status == "ok":  # the main line as it was: its opening, its branch
            advance(session.line, Decision(record.call_class, record.call_rule, record.branch), full)
            if record.call_rule == SUPERSEDES:  # as recorded live: what it replaced is side
                supersede(steps, record.index)

    def _held(self, record: Held, expander: Expander) -> None:
        """A trajectory finished with its reward pending: held until released; its steps kept for
        ``GET /sessions/<id>``."""
        done = record.trajectory
        session = self.registry.sessions.pop(done.id, None)
        expander.forget(done.id)
        self.registry.closed[done.id] = done.status
        if session is not None:
            self.registry.recent[session.id] = msgspec.structs.replace(
                session.trajectory, status=done.status, rewards=done.rewards,
                reward_sources=done.reward_sources)
        self.holder.hold(record)

    def _hold_latest(self, session: LiveSession, expander: Expander) -> None:
        """A rebuilt session's latest call in full, and its bytes, as ``record`` counted them (a choice after
        its first holds its request and prompt)."""
        session.full = expander.last_call(session.id)
        steps = session.trajectory.steps
        sizes: dict[int, tuple[int, int]] = {}
        for i in sorted(session.full):
            d = steps[i].delta
            if d is not None and d.kind == "choice" and d.base in sizes:
                logged = self.holdings.size_of([steps[i]])
                sizes[i] = full_sizes(steps[i], logged, session.full[d.base], sizes)
            else:
                n = self.holdings.size_of([session.full[i]])
                sizes[i] = (n, n)
        session.full_sizes = sizes
        session.full_extra = sum(n for i, (n, _) in sizes.items() if steps[i].delta is not None)
        session.bytes = (len(msgpack_encoder.encode(session.trajectory))
                         + RECORD_SLACK * len(session.starts) + session.full_extra)
