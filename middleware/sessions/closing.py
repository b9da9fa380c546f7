"""Closing a session: wait (bounded) for its calls in flight, the reward callback, one durable ``Trajectory``
record that refers to its logged steps, then the bookkeeping of closed sessions (bounded): ``Closer``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import msgspec

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import SessionClosed
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import (
    INFRA_FAILURE,
    Held,
    InfraCause,
    StepRef,
    TaskRun,
    Trajectory,
    TrajectoryStatus,
)
from steptap.middleware.sessions.classify import SUPERSEDED
from steptap.middleware.sessions.groups import Groups
from steptap.middleware.sessions.holding import Holder, OnDeadline
from steptap.middleware.sessions.registry import Registry
from steptap.middleware.sessions.rewards import RewardFn, run_reward
from steptap.middleware.sessions.session import LiveSession
from steptap.middleware.sessions.writer import Writer

logger = logging.getLogger("steptap.sessions")

# Closed trajectories kept in memory for GET /sessions/<id> (in their held, delta form); the stream has them
# all.
RECENT_KEEP = 128


@dataclass(frozen=True)
class Ended:
    """How a finished session's run ended besides its reward (a task episode's, docs/tasks.md)."""

    error: str | None = None  # the reason (an infrastructure error's, an aborted run's)
    infra_cause: InfraCause | None = None  # with status infra_error
    task_run: TaskRun | None = None


class Closer:
    def __init__(self, config: ProxyConfig, metrics: Metrics, reward_fn: RewardFn | None, writer: Writer,
                 registry: Registry, groups: Groups, holder: Holder) -> None:
        self.config = config
        self.metrics = metrics
        self.reward_fn = reward_fn
        self.writer = writer
        self.registry = registry
        self.groups = groups
        self.holder = holder  # a finish with its reward pending: held (holding.py)

    async def finish(
        self, session: LiveSession, status: TrajectoryStatus = "finished", reward: float | None = None,
        hold: tuple[float, OnDeadline] | None = None, ended: Ended | None = None,
    ) -> Trajectory:
        """Close the session; ``hold`` (its reward pending: the deadline as unix seconds, what the deadline
        does) writes a ``Held`` record instead of the streamed one (holding.py); ``ended`` is how a task
        episode ended (its reason, infrastructure cause, agent and verifier)."""
        async with session.lock:
            if session.closing:
                raise SessionClosed(f"session {session.id!r} is already closing")
            if hold is not None:
                self.holder.check_hold()
            return await self._close_locked(session, status, None if reward is None else {"reward": reward},
                                            hold, ended)

    async def close(self, session: LiveSession, status: TrajectoryStatus) -> Trajectory:
        async with session.lock:
            return await self._close_locked(session, status)

    async def close_logged(self, session: LiveSession, status: TrajectoryStatus) -> None:
        """``close`` in the background (an idle session, an anonymous one with a reward callback): a failure
        is logged."""
        try:
            await self.close(session, status)
        except Exception:
            logger.exception("closing session %s as %s failed", session.id, status)

    async def _close_locked(self, session: LiveSession, status: TrajectoryStatus,
                            rewards: dict[str, float] | None = None,
                            hold: tuple[float, OnDeadline] | None = None,
                            ended: Ended | None = None) -> Trajectory:
        """Close: no new call, wait (bounded) for the calls in flight so their steps are in the trajectory,
        then one durable Trajectory record. A record the log refuses (degraded: 503) leaves the session as it
        was, open, so the finish can be retried; ``rewards`` (the finish's own) are applied only with the
        record."""
        session.closing = True
        traj = session.trajectory
        before = (dict(traj.rewards), traj.error, dict(traj.reward_sources), dict(traj.reward_provenance),
                  traj.infra_cause, traj.task_run)
        try:
            self.writer.log.ensure_writable()  # a 503 before anything changes
            if session.inflight:
                session.drained = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(session.drained.wait(), self.config.finish_drain_timeout_s)
            traj.rewards.update(rewards or {})
            traj.reward_sources.update(dict.fromkeys(rewards or {}, "http"))
            if ended is not None:
                traj.error = ended.error if ended.error is not None else traj.error
                traj.infra_cause, traj.task_run = ended.infra_cause, ended.task_run
            # The callback sees full steps, built as it reads them (they share their rewards with traj's); an
            # infrastructure error has no reward to compute
            unavailable = (self.reward_fn is not None and status != "infra_error"
                           and await self._callback_reward(session, traj))
            if unavailable and status == "finished" and hold is None:
                # no reward could be made: never trained as a reward of 0
                status, traj.infra_cause = INFRA_FAILURE, "reward_unavailable"
            session.sealed = True
            finalize(traj, status)
            record = await self._closing_record(session)
            held = None if hold is None else Held(trajectory=record, deadline_at=hold[0], on_deadline=hold[1])
            await self.writer.append(record if held is None else held)
        except BaseException:
            session.closing = session.sealed = False
            traj.status, traj.finished_at = "running", None
            (traj.rewards, traj.error, traj.reward_sources, traj.reward_provenance, traj.infra_cause,
             traj.task_run) = before
            raise
        self.settle(session, held)
        return traj

    async def _callback_reward(self, session: LiveSession, traj: Trajectory) -> bool:
        """The ``--reward`` callback on a closing session; whether it could make no reward at all
        (exceptions.RewardUnavailable: an infrastructure failure)."""
        assert self.reward_fn is not None
        given = dict(traj.rewards)
        failed = await run_reward(self.reward_fn, traj, self.config.reward_timeout_s, session.full)
        traj.reward_sources.update({k: "callback" for k, v in traj.rewards.items() if given.get(k) != v})
        if failed is None:
            return False
        traj.error = failed.message
        kind = ("unavailable" if failed.unavailable else "timeout" if "timed out" in failed.message
                else "error")
        self.metrics.reward_errors.labels(kind).inc()
        logger.warning("session %s: %s", traj.id, failed.message)
        return failed.unavailable

    @staticmethod
    async def _closing_record(session: LiveSession) -> Trajectory:
        """The session's Trajectory record: it refers to the steps' records (once their appends are done)."""
        traj = session.trajectory
        pending = [t for t in session.starts.values() if isinstance(t, asyncio.Task)]
        if pending:
            await asyncio.wait(pending)
        refs: list[StepRef] = []
        for step in traj.steps:
            at = session.starts.get(step.index)
            if isinstance(at, asyncio.Task):
                at = None if at.cancelled() or at.exception() is not None else at.result()[0]
            if at is not None:  # else its append failed: not durable, so not in the trajectory
                refs.append(StepRef(at=at, rewards=step.rewards,
                                    call=[step.call_class, step.call_rule] if step.call_rule == SUPERSEDED
                                    else None))
        return msgspec.structs.replace(traj, steps=[], step_refs=refs)

    def settle(self, session: LiveSession, held: Held | None = None) -> None:
        """Bookkeeping once the Trajectory (or Held) record is durable."""
        traj = session.trajectory
        self.metrics.trajectories[traj.status] += 1
        if traj.status == "infra_error":
            self.metrics.infra_errors[traj.infra_cause or "other"] += 1
        if held is not None:
            self.holder.hold(held)
        elif traj.rewards:
            self.metrics.reward_values.observe(traj.reward)
            self.metrics.reward_sum.inc(traj.reward)
        if not traj.anonymous:
            registry = self.registry
            registry.closed[traj.id] = traj.status
            registry.recent[traj.id] = traj
            if len(registry.recent) > RECENT_KEEP:
                registry.recent.popitem(last=False)
            registry.unregister(session)
            if held is None:  # a held one is a group's member once released
                self.groups.member_closed(traj)
            registry.prune()


def finalize(traj: Trajectory, status: TrajectoryStatus) -> None:
    traj.status = status
    traj.finished_at = time.time()
