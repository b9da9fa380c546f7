"""Groups of sessions (``Group``), complete when full or timed out, and their table (``Groups``): a member
joins when its session opens and counts once closed; complete groups stay visible for a while, and the table
is bounded (``max_groups``)."""

from __future__ import annotations

import time
from typing import Any

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import GroupNotFound
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Trajectory, TrajectoryStatus

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
    """The groups by id (``groups``, what ``GET /groups/<id>`` reads)."""

    def __init__(self, config: ProxyConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.groups: dict[str, Group] = {}

    def join(self, traj: Trajectory) -> bool:
        """An opened session joins its group; whether the group is new (the table grew)."""
        assert traj.group_id is not None
        group = self.groups.get(traj.group_id)
        new = group is None
        if group is None:
            group = self.groups[traj.group_id] = Group(traj.group_id, traj.group_size)
        elif group.size is None:
            group.size = traj.group_size
        group.members[traj.id] = traj.status
        return new

    def member_closed(self, traj: Trajectory) -> None:
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

    def time_out(self, now: float) -> None:
        """From the sweep: groups open past ``group_timeout_s`` complete, complete ones past their retention
        are forgotten."""
        gt = self.config.group_timeout_s
        for gid, group in list(self.groups.items()):
            if group.complete is None and gt is not None and now - group.opened > gt:
                self._complete(group, "timeout")
            elif group.completed_at is not None and now - group.completed_at > GROUP_RETENTION_S:
                del self.groups[gid]

    def prune(self) -> None:
        """At most ``max_groups``: a complete group goes first, else the oldest."""
        while len(self.groups) > self.config.max_groups:
            done = next((g for g in self.groups.values() if g.complete is not None), None)
            del self.groups[(done or next(iter(self.groups.values()))).id]
