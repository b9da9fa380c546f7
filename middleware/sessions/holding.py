"""Late and human rewards: a session finished with its reward pending is held, and a reward given after a
trajectory went to the stream is recorded as late (``Holder``).

A held session's trajectory is one durable ``Held`` record (its steps as refs, its deadline, what the
deadline does): not on the stream, so the learner never sees it. It is released by one ``Trajectory`` record,
the same trajectory with the reward in it (its reward arrived over ``POST /sessions/<id>/rewards``, or the
deadline gave the configured value), which streams like any other: the learner trains it once. A deadline
with ``drop`` writes a ``HeldDropped`` record instead, and nothing trains. Both survive a restart:
``replay.py`` rebuilds the held set from the log, with the deadlines as wall-clock times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

import msgspec

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import Overloaded, StepNotFound
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import (
    Held,
    HeldDropped,
    Provenance,
    RewardAdded,
    RewardSource,
    Trajectory,
    msgpack_encoder,
)
from steptap.middleware.sessions.groups import Groups
from steptap.middleware.sessions.limits import Holdings
from steptap.middleware.sessions.registry import Registry
from steptap.middleware.sessions.writer import Writer

logger = logging.getLogger("steptap.sessions")

OnDeadline = Literal["drop"] | float


class Holder:
    """The held trajectories (each released once, by its reward or its deadline) and late rewards."""

    def __init__(self, config: ProxyConfig, metrics: Metrics, holdings: Holdings, writer: Writer,
                 registry: Registry, groups: Groups) -> None:
        self.config = config
        self.metrics = metrics
        self.holdings = holdings
        self.writer = writer
        self.registry = registry  # a released or dropped one's final status, its steps held in ``recent``
        self.groups = groups
        self.held: dict[str, Held] = {}  # id -> its Held record, until released or dropped
        self.held_bytes: dict[str, int] = {}  # its encoded size, counted in max_bytes_held while it waits
        self.lock = asyncio.Lock()  # a reward and the deadline never both end one
        self.expiring: set[str] = set()  # deadlines being recorded now (the next sweep does not start them)

    def check_hold(self) -> None:
        """Before a pending finish changes anything: room for one more held trajectory (429 beyond)."""
        if len(self.held) >= self.config.max_held_trajectories:
            raise Overloaded(f"{len(self.held)} trajectories are waiting for their reward "
                             f"(max_held_trajectories={self.config.max_held_trajectories})")

    def deadline_at(self, deadline_s: float | None) -> float:
        return time.time() + (self.config.reward_deadline_s if deadline_s is None else deadline_s)

    def hold(self, record: Held) -> None:
        """Bookkeeping once a Held record is durable (or found by the replay)."""
        sid = record.trajectory.id
        self.held[sid] = record
        self.held_bytes[sid] = size = len(msgpack_encoder.encode(record))
        self.holdings.hold(0, size)
        self.metrics.held.set(len(self.held))

    def unhold(self, sid: str) -> Held | None:
        record = self.held.pop(sid, None)
        self.holdings.hold(0, -self.held_bytes.pop(sid, 0))
        self.metrics.held.set(len(self.held))
        return record

    def pending_state(self, sid: str) -> dict[str, Any] | None:
        record = self.held.get(sid)
        if record is None:
            return None
        return {"deadline_at": record.deadline_at, "on_deadline": record.on_deadline}

    async def release(self, sid: str, value: float, name: str, source: RewardSource,
                      provenance: Provenance | None = None) -> Trajectory | None:
        """The pending reward arrived: one Trajectory record, the held one with the reward (and what made it)
        in it (it streams now). None when the trajectory is no longer held (released or dropped meanwhile)."""
        async with self.lock:
            record = self.held.get(sid)
            if record is None:
                return None
            traj = msgspec.structs.replace(
                record.trajectory, rewards={**record.trajectory.rewards, name: value},
                reward_sources={**record.trajectory.reward_sources, name: source}, finished_at=time.time(),
                reward_provenance={**record.trajectory.reward_provenance,
                                   **({name: dict(provenance)} if provenance else {})})
            await self.writer.append(traj)
            self._released(traj, "rewarded" if source != "default" else "default")
            self.metrics.rewards.labels("trajectory", source).inc()
            return traj

    async def _drop(self, sid: str, reason: str) -> None:
        async with self.lock:
            if sid not in self.held:
                return
            await self.writer.append(HeldDropped(trajectory_id=sid, reason=reason))
            record = self.unhold(sid)
            assert record is not None  # under the lock, checked above
            self.metrics.held_ended.labels("dropped").inc()
            self.registry.closed[sid] = "aborted"
            self.groups.member_closed(msgspec.structs.replace(record.trajectory, status="aborted"))
            logger.info("session %s: its reward did not arrive by the deadline; dropped", sid)

    def _released(self, traj: Trajectory, outcome: str) -> None:
        self.unhold(traj.id)
        self.metrics.held_ended.labels(outcome).inc()
        self.registry.closed[traj.id] = traj.status
        old = self.registry.recent.get(traj.id)
        if old is not None:  # the steps held in memory, with the new rewards
            self.registry.recent[traj.id] = msgspec.structs.replace(old, rewards=traj.rewards,
                                                           reward_sources=traj.reward_sources,
                                                           reward_provenance=traj.reward_provenance)
        if traj.rewards:
            self.metrics.reward_values.observe(traj.reward)
            self.metrics.reward_sum.inc(traj.reward)
        self.groups.member_closed(traj)

    def expire_held(self) -> None:
        """From the sweep: held trajectories past their deadline get their default (or are dropped)."""
        now = time.time()
        for sid, record in list(self.held.items()):
            if record.deadline_at <= now and sid not in self.expiring:
                self.expiring.add(sid)
                self.writer.spawn(self._expire(sid, record.on_deadline))

    async def _expire(self, sid: str, on_deadline: OnDeadline) -> None:
        try:
            if on_deadline == "drop":
                await self._drop(sid, "deadline")
            else:
                await self.release(sid, float(on_deadline), "reward", "default")
        except Exception:  # the log refused (degraded): the next sweep tries again
            logger.exception("session %s: its reward deadline could not be recorded", sid)
        finally:
            self.expiring.discard(sid)

    async def late_reward(self, sid: str, value: float, name: str, step: int | str | None,
                          source: RewardSource, provenance: Provenance | None = None) -> RewardAdded:
        """A reward on a trajectory that already went to the stream: recorded (``late``, exported), counted,
        never trained."""
        traj = self.registry.recent.get(sid)
        index: int | None = None
        if step == "last" or (isinstance(step, int) and traj is not None):
            n = len(traj.steps) if traj is not None else 0
            index = n - 1 if step == "last" else int(step)
            if not 0 <= index < n:
                raise StepNotFound(f"no step {step} in session {sid!r} (known steps: {n})")
        elif step is not None:
            index = int(step)  # the trajectory is no longer in memory: recorded as given
        record = RewardAdded(trajectory_id=sid, name=name, value=value, step=index, source=source, late=True,
                             provenance=provenance or {})
        await self.writer.append(record)
        self.metrics.late_rewards.labels(source).inc()
        return record
