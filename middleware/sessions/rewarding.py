"""Rewards on an open session (``Rewarder``): validated, logged, then applied (an error changes nothing);
``apply_reward``, also the replay's."""

from __future__ import annotations

import time

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import SessionClosed, SessionFull, StepNotFound
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Provenance, RewardAdded, RewardSource, Trajectory, json_encoder
from steptap.middleware.sessions.limits import Holdings
from steptap.middleware.sessions.session import LiveSession
from steptap.middleware.sessions.writer import Writer


class Rewarder:
    def __init__(self, config: ProxyConfig, metrics: Metrics, holdings: Holdings, writer: Writer) -> None:
        self.config = config
        self.metrics = metrics
        self.holdings = holdings
        self.writer = writer

    async def add_reward(
        self, session: LiveSession, value: float, name: str, step: int | str | None,
        source: RewardSource = "http", provenance: Provenance | None = None,
    ) -> RewardAdded:
        """Validate everything first, then log, then apply: an error changes nothing. Under the session's
        lock, so a reward is either in the closing Trajectory record or refused (409; after the close: a
        late reward, holding.py). ``provenance``: what made it (a judge's model, prompt, rubric hash), kept
        on the trajectory by the reward's name."""
        async with session.lock:
            return await self._add_reward_locked(session, value, name, step, source, provenance or {})

    async def _add_reward_locked(
        self, session: LiveSession, value: float, name: str, step: int | str | None, source: RewardSource,
        provenance: Provenance,
    ) -> RewardAdded:
        if session.closing:
            raise SessionClosed(f"session {session.id!r} is closing")
        steps = session.trajectory.steps
        index: int | None = None
        if step == "last":
            if not steps:
                raise StepNotFound("the session has no steps yet")
            index = len(steps) - 1
        elif step is not None:
            index = int(step)
            if not 0 <= index < len(steps):
                raise StepNotFound(f"no step {index} (the session has {len(steps)})")
        record = RewardAdded(trajectory_id=session.id, name=name, value=value, step=index, source=source,
                             provenance=provenance)
        target = session.trajectory.rewards if index is None else steps[index].rewards
        size = 0 if name in target else len(name.encode()) + 16  # a new name grows the Trajectory record
        if provenance and name not in session.trajectory.reward_provenance:  # so does a new provenance
            size += len(json_encoder.encode(provenance)) + len(name.encode())
        if session.bytes + size > self.config.max_session_bytes:
            raise SessionFull(
                f"session {session.id!r} holds {session.bytes} bytes; another reward name would pass "
                f"max_session_bytes={self.config.max_session_bytes}"
            )
        await self.writer.append(record)
        apply_reward(session.trajectory, record)
        session.bytes += size
        self.holdings.hold(0, size)
        session.last_active = time.monotonic()
        self.metrics.rewards.labels("trajectory" if index is None else "step", source).inc()
        return record


def apply_reward(traj: Trajectory, record: RewardAdded) -> None:
    if record.provenance:
        traj.reward_provenance[record.name] = dict(record.provenance)
    if record.step is None:
        traj.rewards[record.name] = record.value
        traj.reward_sources[record.name] = record.source
    elif 0 <= record.step < len(traj.steps):
        traj.steps[record.step].rewards[record.name] = record.value
