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
import bisect
import logging
from typing import TYPE_CHECKING

from steptap.middleware import files
from steptap.middleware.log.segments import cursor_key, parse_cursor, seg_name

if TYPE_CHECKING:
    import threading
    from array import array
    from collections.abc import Awaitable, Callable
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    from typing import Any

    from steptap.middleware.log.images import ImageStore
    from steptap.middleware.log.wal import LogStats
    from steptap.middleware.records import LogRecord, PolicyVersion


logger = logging.getLogger("steptap.wal")


class Compaction:
    """Mixin of ``TrajectoryLog``: ``compact``."""

    # What TrajectoryLog (wal.py) provides, declared for the type checker (annotations only: no values).
    _compact_lock: asyncio.Lock
    _fs: Any
    _image_segs: dict[str, int]
    _io: ThreadPoolExecutor
    _last_version: tuple[int, PolicyVersion] | None
    _lock: threading.Lock
    _open_sessions: dict[str, int]
    _remote_root: str | None
    _retained: Callable[[], list[int]]
    _traj_ends: array[int]
    _traj_firsts: array[int]
    _upload_failed: set[int]
    _uploads: set[asyncio.Task[None]]
    _valid_end: dict[int, int]
    append: Callable[[LogRecord], Awaitable[str]]
    dir: Path
    images: ImageStore
    stats: LogStats

    @property
    def last_policy_version(self) -> PolicyVersion | None:
        """The latest ``PolicyVersion`` record (what compaction carries forward; the weight swapper restores
        its state from it at start-up and owns what it means)."""
        return self._last_version[1] if self._last_version is not None else None

    async def compact(self, min_cursor: str) -> list[int]:
        """Delete sealed segments wholly before ``min_cursor`` (the least acknowledged cursor over all
        consumers), never one at or after the oldest open session's ``SessionOpened``. Returns the deleted
        segment numbers."""
        async with self._compact_lock:  # two acks at once must not both carry the policy version forward
            return await self._compact(parse_cursor(min_cursor)[0], min_cursor)

    async def _compact(self, cut: int, min_cursor: str) -> list[int]:
        if self._open_sessions:
            cut = min(cut, min(self._open_sessions.values()))
        # a finished trajectory not yet acknowledged by all needs the steps it refers to
        after = bisect.bisect_right(self._traj_ends, cursor_key(*parse_cursor(min_cursor)))
        if after < len(self._traj_firsts):
            cut = min(cut, min(self._traj_firsts[after:]))
        if self._upload_failed:  # never delete the only copy of a segment the remote still lacks
            cut = min(cut, min(self._upload_failed))
        victims = [s for s in self._retained()[:-1] if s < cut]
        if not victims:
            return []
        if self._last_version is not None and self._last_version[0] in victims:
            await self.append(self._last_version[1])  # carry the current policy version forward
            victims = [s for s in self._retained()[:-1] if s < cut]
        # Never delete before it is uploaded
        await asyncio.gather(*list(self._uploads), return_exceptions=True)
        with self._lock:
            for segno in victims:
                self._valid_end.pop(segno, None)
        gone = bisect.bisect_left(self._traj_ends, cursor_key(victims[-1] + 1, 0))
        del self._traj_ends[:gone]
        del self._traj_firsts[:gone]
        await asyncio.get_running_loop().run_in_executor(self._io, self._delete, victims)
        # The images only deleted records referred to (or none did: a call refused after they were stored)
        for sha in [sha for sha, segno in self._image_segs.items() if segno <= victims[-1]]:
            del self._image_segs[sha]
        await asyncio.to_thread(self.images.sweep, set(self._image_segs))
        self.stats.segments = len(self._valid_end) + 1
        logger.info("compacted %d segment(s) of %s (before %s)", len(victims), self.dir, min_cursor)
        return victims

    def _delete(self, segnos: list[int]) -> None:
        for segno in segnos:
            (self.dir / seg_name(segno)).unlink(missing_ok=True)
            if self._fs is not None:
                try:
                    self._fs.rm_file(f"{self._remote_root}/{seg_name(segno)}")
                except FileNotFoundError:
                    pass
                except Exception:  # noqa: BLE001
                    logger.exception("deleting remote segment %d failed", segno)
        files.fsync_path(self.dir)

