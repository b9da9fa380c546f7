"""Groups of sessions (complete when full or timed out) and the idle sweep that closes sessions past their
timeout. ``Groups`` is a mixin of ``SessionManager`` (manager.py), which holds the state it reads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from steptap.middleware.exceptions import (
    GroupNotFound,
    LogUnavailable,
)
from steptap.middleware.records import (
    Trajectory,
    TrajectoryStatus,
)
from steptap.middleware.sessions.session import LiveSession

if TYPE_CHECKING:
    from steptap.middleware.config import ProxyConfig
    from steptap.middleware.metrics import Metrics
    from steptap.middleware.sessions.session import Log

logger = logging.getLogger("steptap.sessions")

GROUP_RETENTION_S = 3600.0  # complete groups stay visible (GET /groups/<id>) this long
class Group:
    __slots__ = ("complete", "completed_at", "id", "members", "opened", "size")

    def __init__(self, group_id: str, size: int | None) -> None:
        self.id = group_id
        self.size = size
        self.members: dict[str, TrajectoryStatus] = {}
        self.opened = time.monotonic()
        self.complete: str | None = None  # None, "full" or "timeout"
        self.completed_at: float | None = None

    def state(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for status in self.members.values():
            counts[status] = counts.get(status, 0) + 1
        return {
            "id": self.id,
            "size": self.size,
            "members": dict(self.members),
            "counts": counts,
            "complete": self.complete is not None,
            "reason": self.complete,
        }


class Groups:
    """``SessionManager``'s groups and idle timeouts."""

    config: ProxyConfig
    log: Log
    metrics: Metrics
    sessions: dict[str, LiveSession]
    pending: dict[str, LiveSession]
    groups: dict[str, Group]
    if TYPE_CHECKING:  # SessionManager's and Closing's
        def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...
        def drop_pending(self, session: LiveSession) -> None: ...
        async def _close(self, session: LiveSession, status: TrajectoryStatus) -> Trajectory: ...
        def expire_held(self) -> None: ...

    def _group_member_closed(self, traj: Trajectory) -> None:
        if traj.group_id is None or traj.group_id not in self.groups:
            return
        group = self.groups[traj.group_id]
        group.members[traj.id] = traj.status
        # an infrastructure error is no member: the runner runs the episode again in its place (docs/tasks.md)
        closed = sum(1 for s in group.members.values() if s not in ("running", "infra_error"))
        if group.complete is None and group.size is not None and closed >= group.size:
            self._complete(group, "full")

    def _complete(self, group: Group, reason: str) -> None:
        group.complete = reason
        group.completed_at = time.monotonic()
        self.metrics.groups_complete.labels(reason).inc()

    def group(self, group_id: str) -> Group:
        group = self.groups.get(group_id)
        if group is None:
            raise GroupNotFound(f"no group {group_id!r}")
        return group

    def sweep(self) -> None:
        """Close sessions idle past their timeout (``timed_out``, still delivered), forget pending auto
        sessions no call holds past it (a first call that ended with no step), and time out groups."""
        now = time.monotonic()
        idle_pending = self.config.auto_session_idle_timeout_s
        for session in [s for s in self.pending.values() if now - s.last_active > idle_pending]:
            self.drop_pending(session)  # one with a call in flight stays
        try:
            self.log.ensure_writable()
        except LogUnavailable:  # idle sessions are closed once their Trajectory record can be written
            writable = False
        else:
            writable = True
        for session in list(self.sessions.values()) if writable else ():
            timeout = session.trajectory.idle_timeout_s
            if (
                timeout is not None
                and not session.closing
                and session.inflight == 0
                and now - session.last_active > timeout
            ):
                session.closing = True  # claimed now, so the next sweep does not close it twice
                self.spawn(self._close_logged(session, "timed_out"))
        if writable:
            self.expire_held()
        gt = self.config.group_timeout_s
        for gid, group in list(self.groups.items()):
            if group.complete is None and gt is not None and now - group.opened > gt:
                self._complete(group, "timeout")
            elif group.completed_at is not None and now - group.completed_at > GROUP_RETENTION_S:
                del self.groups[gid]

    async def _close_logged(self, session: LiveSession, status: TrajectoryStatus) -> None:
        try:
            await self._close(session, status)
        except Exception:
            logger.exception("closing session %s as %s failed", session.id, status)

    async def sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.sweep()
