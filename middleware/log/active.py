"""The active segment's write path: what the writer thread (``writer.py``) does with a group of frames.

A group is written at the committed end in one system call (with durability ``fsync``, written and synced by
it where the platform can: ``files.write_all``), rolling over to a new segment at ``segment_bytes``. A failed
write is cut back to the committed end, so the segment never holds half a group. With durability ``os`` a
group is only written; ``sync_forever`` syncs on a timer, and a segment is synced before it is sealed.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

from steptap.middleware import files
from steptap.middleware.log.segments import HEADER, create_segment, seg_name
from steptap.middleware.log.stats import LogStats
from steptap.middleware.log.table import SegmentTable
from steptap.middleware.log.writer import Written

# A lone record is synced on the loop only while the disk's last sync took less than this (a local SSD:
# 0.1-0.2 ms); past it, syncs go to the writer thread until one is quick again
INLINE_SYNC_S = 0.002


class ActiveSegment:
    """The one open segment file of a writable log. ``write`` runs in the writer thread; the timed sync
    and closing in the log's I/O thread, both under ``fd_lock``."""

    def __init__(self, table: SegmentTable, stats: LogStats, *, segment_bytes: int, durability: str) -> None:
        self.table = table
        self.stats = stats
        self.segment_bytes = segment_bytes
        self.fsync = durability == "fsync"
        self.fd_lock = threading.Lock()  # the file: the writer thread vs the timed sync ("os")
        self._fd = -1
        self._unsynced = False  # durability "os": written groups not yet synced

    def open(self) -> None:
        """I/O thread, after recovery: open the active segment at its committed end."""
        segno, size = self.table.active
        self._fd = os.open(self.table.dir / seg_name(segno), os.O_WRONLY)
        os.lseek(self._fd, size, os.SEEK_SET)

    @property
    def unsynced(self) -> bool:
        """Whether groups were written (durability ``os``) and not synced yet."""
        return self._unsynced

    def inline(self, size: int) -> bool:
        """Whether a lone frame of ``size`` bytes may be written and synced on the loop (``writer.py``'s
        ``write_now``): with durability ``fsync`` (no timed sync shares the file), when it fits this segment
        (a roll's syncs and file creation stay off the loop), and while the disk's last sync took under
        ``INLINE_SYNC_S`` (a slow disk leaves the loop free for everything else)."""
        return (self.fsync and not self._rolls(self.table.active[1], size)
                and self.stats.last_sync_s < INLINE_SYNC_S)

    def _rolls(self, pos: int, size: int) -> bool:
        """Whether a frame of ``size`` bytes at ``pos`` starts the next segment (one larger than a segment
        goes alone into an empty one)."""
        return pos > len(HEADER) and pos + size > self.segment_bytes

    def write(self, frames: list[bytes]) -> Written:
        """Writer thread: write ``frames`` as one group (see the module's doc); returns the position after
        each committed frame (a prefix of ``frames``), the segments sealed on the way, and the error that
        stopped it, if any."""
        with self.fd_lock:
            return self._write_frames(frames)

    def _write_frames(self, frames: list[bytes]) -> Written:
        positions: list[tuple[int, int]] = []
        committed = 0
        sealed: list[int] = []
        buf: list[bytes] = []
        segno, pos = self.table.active
        try:
            for fr in frames:
                if self._rolls(pos, len(fr)):
                    self._flush(buf)
                    committed, buf = len(positions), []
                    sealed.append(self.roll())
                    segno, pos = self.table.active
                buf.append(fr)
                pos += len(fr)
                positions.append((segno, pos))
            self._flush(buf)
        except OSError as exc:
            # Leave no half-written group behind: cut back to what was committed.
            end = self.table.active[1]
            try:
                os.ftruncate(self._fd, end)
                os.lseek(self._fd, end, os.SEEK_SET)
            except OSError:
                pass
            return positions[:committed], sealed, exc
        return positions, sealed, None

    def _flush(self, buf: list[bytes]) -> None:
        if not buf:
            return
        # At the committed end; with fsync, written and synced by one system call where the platform can.
        t0 = time.perf_counter()
        files.write_all(self._fd, b"".join(buf), self.table.active[1], dsync=self.fsync)
        if self.fsync:
            self.stats.commits += 1
            self.stats.last_sync_s = time.perf_counter() - t0
        else:
            self._unsynced = True
        self.table.grow(sum(len(b) for b in buf))

    def roll(self) -> int:
        """Seal the active segment (synced) and start the next; returns the sealed segno. The caller holds
        ``fd_lock`` or is the only one left touching the file."""
        old = self.table.active[0]
        self._sync_now()  # durability "os": a sealed segment is synced like any other
        # The next segment exists before any reader can be sent to it; if creating it fails (disk full), the
        # active segment is untouched and the next batch tries again.
        create_segment(self.table.dir, old + 1)
        fd = os.open(self.table.dir / seg_name(old + 1), os.O_WRONLY)
        os.lseek(fd, len(HEADER), os.SEEK_SET)
        os.close(self._fd)
        self._fd = fd
        self.table.roll()
        self.stats.segments = self.table.count()
        return old

    def sync(self) -> None:
        """I/O thread: sync what was written and not yet synced (durability ``os``)."""
        with self.fd_lock:
            self._sync_now()

    def _sync_now(self) -> None:
        if self._unsynced:
            files.datasync(self._fd)
            self._unsynced = False
            self.stats.commits += 1

    async def sync_forever(self, interval_s: float, io: Executor, closed: Callable[[], bool],
                           failed: Callable[[OSError], None]) -> None:
        """Durability ``os``: sync every ``interval_s`` what was written since, until ``closed()``."""
        loop = asyncio.get_running_loop()
        while not closed():
            await asyncio.sleep(interval_s)
            if not self._unsynced:
                continue
            try:
                await loop.run_in_executor(io, self.sync)
            except OSError as exc:
                failed(exc)

    def close(self) -> None:
        """I/O thread, once the writer thread ended: sync what is left and close the file."""
        self.sync()
        os.close(self._fd)
        self._fd = -1
