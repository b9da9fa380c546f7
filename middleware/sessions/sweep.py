"""The idle sweep (``Sweeper``), every ``sweep_interval_s``: sessions idle past their timeout closed
(``timed_out``, still delivered), pending auto sessions no call holds forgotten, held trajectories past their
deadline given their default (or dropped), groups timed out."""

from __future__ import annotations

import asyncio
import time

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import LogUnavailable
from steptap.middleware.sessions.closing import Closer
from steptap.middleware.sessions.groups import Groups
from steptap.middleware.sessions.holding import Holder
from steptap.middleware.sessions.registry import Registry
from steptap.middleware.sessions.writer import Writer


class Sweeper:
    def __init__(self, config: ProxyConfig, writer: Writer, registry: Registry, closer: Closer,
                 holder: Holder, groups: Groups) -> None:
        self.config = config
        self.writer = writer
        self.registry = registry
        self.closer = closer
        self.holder = holder
        self.groups = groups

    def sweep(self) -> None:
        """Close sessions idle past their timeout (``timed_out``, still delivered), forget pending auto
        sessions no call holds past it (a first call that ended with no step), and time out groups."""
        now = time.monotonic()
        idle_pending = self.config.auto_session_idle_timeout_s
        registry = self.registry
        for session in [s for s in registry.pending.values() if now - s.last_active > idle_pending]:
            registry.drop_pending(session)  # one with a call in flight stays
        try:
            self.writer.log.ensure_writable()
        except LogUnavailable:  # idle sessions are closed once their Trajectory record can be written
            writable = False
        else:
            writable = True
        for session in list(registry.sessions.values()) if writable else ():
            timeout = session.trajectory.idle_timeout_s
            if (
                timeout is not None
                and not session.closing
                and session.inflight == 0
                and now - session.last_active > timeout
            ):
                session.closing = True  # claimed now, so the next sweep does not close it twice
                self.writer.spawn(self.closer.close_logged(session, "timed_out"))
        if writable:
            self.holder.expire_held()
        self.groups.time_out(now)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.sweep()
