"""``Writer``: the session domain's way to the log and to the background. Each append is timed
(``log_commit``) and durable when it returns; a task spawned here is one of the app's, drained at shutdown
before the log closes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from steptap.middleware.metrics import Metrics
from steptap.middleware.records import LogRecord
from steptap.middleware.sessions.session import Log


class Writer:
    def __init__(self, log: Log, metrics: Metrics, tasks: set[asyncio.Task[Any]]) -> None:
        self.log = log
        self.metrics = metrics
        self.tasks = tasks  # the app's background tasks, drained at shutdown

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def append(self, record: LogRecord) -> str:
        return (await self.append_at(record))[1]

    async def append_at(self, record: LogRecord, *, alone: bool = False) -> tuple[str, str]:
        """``alone``: the one model call in flight appends it (the log may sync it on the loop)."""
        t0 = time.perf_counter()
        cursors = await self.log.append_at(record, alone=alone)
        self.metrics.log_commit.observe(time.perf_counter() - t0)
        return cursors

    async def append_encoded(self, payload: bytes, record: LogRecord, *,
                             alone: bool = False) -> tuple[str, str]:
        """``append_at`` of a record already encoded (``payload``: its msgpack bytes, written as is)."""
        t0 = time.perf_counter()
        cursors = await self.log.append_encoded(payload, record, alone=alone)
        self.metrics.log_commit.observe(time.perf_counter() - t0)
        return cursors
