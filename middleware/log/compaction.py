"""Compaction: deleting the oldest segments once every consumer has acknowledged them.

Only a prefix of sealed segments is ever deleted, locally and remotely: the segments wholly before
``min_cursor`` (every consumer has acknowledged them) and before the segment holding the ``SessionOpened`` of
the oldest session still open (so a restart can still rebuild every open session), before the first step any
unacknowledged finished trajectory refers to (``step_refs``), and never one the remote copy still lacks. The
latest ``PolicyVersion`` record is re-appended first if its segment is about to go. Then the images no kept
step refers to and no call in flight holds are removed (images.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

from steptap.middleware import files
from steptap.middleware.log.images import ImageStore
from steptap.middleware.log.index import LogIndex
from steptap.middleware.log.remote import Uploader
from steptap.middleware.log.segments import seg_name
from steptap.middleware.log.stats import LogStats
from steptap.middleware.log.table import SegmentTable
from steptap.middleware.records import LogRecord

logger = logging.getLogger("steptap.wal")


class Compactor:
    """Deletes what every consumer is done with from the segments in ``table``, as ``index`` allows; a remote
    log's ``uploader`` is waited for (and its failed uploads kept). ``append`` carries the latest policy
    version forward; deletions run in ``io``."""

    def __init__(self, table: SegmentTable, index: LogIndex, stats: LogStats, images: ImageStore,
                 io: Executor, append: Callable[[LogRecord], Awaitable[str]],
                 uploader: Uploader | None) -> None:
        self.table = table
        self.index = index
        self.stats = stats
        self.images = images
        self.io = io
        self.append = append
        self.uploader = uploader
        self._lock = asyncio.Lock()  # two acks at once must not both carry the policy version forward

    async def compact(self, min_cursor: str) -> list[int]:
        """Delete sealed segments wholly before ``min_cursor`` (the least acknowledged cursor over all
        consumers), never one at or after the oldest open session's ``SessionOpened``. Returns the deleted
        segment numbers."""
        async with self._lock:
            return await self._compact(min_cursor)

    def _victims(self, cut: int) -> list[int]:
        return [s for s in self.table.sealed() if s < cut]

    async def _compact(self, min_cursor: str) -> list[int]:
        cut = self.index.keep_from(min_cursor)
        if self.uploader is not None and self.uploader.failed:
            cut = min(cut, min(self.uploader.failed))  # never delete the only copy the remote still lacks
        victims = self._victims(cut)
        if not victims:
            return []
        last = self.index.last_version
        if last is not None and last[0] in victims:
            await self.append(last[1])  # carry the current policy version forward
            victims = self._victims(cut)
        if self.uploader is not None:
            await self.uploader.wait()  # never delete before it is uploaded
        self.table.drop(victims)
        self.index.forget_trajectories(victims[-1])
        await asyncio.get_running_loop().run_in_executor(self.io, self._delete, victims)
        # The images only deleted records referred to (or none did: a call refused after they were stored)
        kept = self.index.forget_images(victims[-1])
        await asyncio.to_thread(self.images.sweep, kept)
        self.stats.segments = self.table.count()
        logger.info("compacted %d segment(s) of %s (before %s)", len(victims), self.table.dir, min_cursor)
        return victims

    def _delete(self, segnos: list[int]) -> None:
        for segno in segnos:
            (self.table.dir / seg_name(segno)).unlink(missing_ok=True)
            if self.uploader is not None:
                self.uploader.delete(segno)
        files.fsync_path(self.table.dir)
