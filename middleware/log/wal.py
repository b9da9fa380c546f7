"""The trajectory log: append-only segment files of checksummed msgpack records, durable before ``append``
returns.

The on-disk format (segments, frames, cursors) is in ``segments.py``.

**Group commit.** One writer thread (``writer.py``) drains a queue of encoded frames. It writes what is queued
in one ``write`` and one ``fdatasync`` (never on the event loop) and hands the group back to the loop in one
callback. A lone record is thus written and synced at once; records that arrive while a sync is in progress
wait for the next one and share it. Each ``append`` resolves only after the sync that covered its record.

``TrajectoryLog`` composes the parts, each given what it needs: the segment table (``table.py``) and what the
log tracks (``index.py``), both shared; the active segment's write path (``active.py``) behind the writer
thread; **recovery** at open (``recovery.py``), which cuts a torn tail and rebuilds the table and the index;
**reading** (``reader.py``), which serves start-up, the stream and cursor checks; **remote logs**
(``remote.py``), which keep the write-ahead log local and upload sealed segments.

**Durability** (``durability``): ``fsync`` (the default) syncs each group before its appends return: a
record survives a crash of the machine once ``append`` returns. ``os`` writes each group to the OS before its
appends return (it survives a crash of the proxy, even SIGKILL) and syncs on a timer every
``os_sync_interval_s``: a crash of the machine (power, kernel) can lose the records of that last interval.
Either way every sealed segment is synced before the next is created.

**Degraded** (``degraded.py``): after a failed write the log refuses records until a probe write succeeds.
**Compaction** (``compaction.py``) deletes the prefix of segments every consumer has acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from steptap.middleware.exceptions import LogUnavailable, RecordTooLarge
from steptap.middleware.log.active import ActiveSegment
from steptap.middleware.log.compaction import Compactor
from steptap.middleware.log.degraded import DegradedMode
from steptap.middleware.log.images import ImageStore
from steptap.middleware.log.index import LogIndex
from steptap.middleware.log.reader import Changes, Reader
from steptap.middleware.log.recovery import LogInUseError, lock_dir, recover
from steptap.middleware.log.remote import Uploader
from steptap.middleware.log.segments import (
    HEADER,
    MAX_RECORD,
    CorruptLogError,
    format_cursor,
    frame,
    parse_cursor,
    split_location,
)
from steptap.middleware.log.stats import LogStats
from steptap.middleware.log.table import SegmentTable
from steptap.middleware.log.writer import CommitThread, Item, NotWritten, Written
from steptap.middleware.records import LogRecord, PolicyVersion, Trajectory, msgpack_encoder

# Format names are re-exported: callers import them from here.
__all__ = [
    "DEFAULT_MAX_RECORD", "HEADER", "MAX_RECORD", "CorruptLogError", "LogClosedError", "LogInUseError",
    "LogStats", "LogUnavailable", "RecordTooLarge", "TrajectoryLog", "format_cursor", "frame", "parse_cursor",
]

logger = logging.getLogger("steptap.wal")

# One commit writes at most this much (bounds the latency of the records queued last)
_MAX_BATCH_BYTES = 8 << 20
DEFAULT_MAX_RECORD = 256 << 20  # the largest record append() takes (a finished session's Trajectory must fit)
DURABILITY = ("fsync", "os")


class LogClosedError(RuntimeError):
    pass


class TrajectoryLog:
    """An append-only, crash-safe log of ``LogRecord``s. Create with ``await
    TrajectoryLog.open(location)``."""

    def __init__(
        self, dirpath: Path, segment_bytes: int, fs: Any, remote_root: str | None,
        max_record_bytes: int = DEFAULT_MAX_RECORD, probe_interval_s: float = 1.0,
        durability: str = "fsync", os_sync_interval_s: float = 0.2, *, readonly: bool = False,
    ) -> None:
        if not 0 < max_record_bytes <= MAX_RECORD:
            raise ValueError(f"max_record_bytes must be between 1 and {MAX_RECORD}")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, not {durability!r}")
        if not os_sync_interval_s > 0:
            raise ValueError("os_sync_interval_s must be positive")
        self.durability = durability
        self.os_sync_interval_s = os_sync_interval_s
        self.dir = dirpath
        self.location = str(dirpath)  # what open() was given
        self.segment_bytes = segment_bytes
        self.max_record_bytes = max_record_bytes
        self.stats = LogStats()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="steptap-wal")
        self._writer: CommitThread | None = None
        self._syncer: asyncio.Task[None] | None = None
        self._lock_fd = -1
        self._closing = False
        self.table = SegmentTable(dirpath)
        self.index = LogIndex()
        self.changes = Changes(closed=readonly)  # a read-only log takes no appends
        self.reader = Reader(self.table, self.stats, self.changes)
        self.active = ActiveSegment(self.table, self.stats, segment_bytes=segment_bytes,
                                    durability=durability)
        self.health = DegradedMode(dirpath, self.stats, self._io, interval_s=probe_interval_s,
                                   writable_again=self._writable_again, closed=lambda: self.changes.closed)
        self.uploader = (Uploader(fs, remote_root, self.table, self.stats)
                         if fs is not None and remote_root is not None else None)
        # The images beside the log (images.py), kept while the index names them (compaction sweeps)
        self.images = ImageStore(dirpath, durable=durability == "fsync", fs=fs, remote_root=remote_root)
        self.compactor = Compactor(self.table, self.index, self.stats, self.images, self._io, self.append,
                                   self.uploader)

    # ---- opening ---------------------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        location: str,
        *,
        segment_bytes: int = 64 << 20,
        upload_url: str | None = None,
        cache_dir: str | None = None,
        readonly: bool = False,
        max_record_bytes: int = DEFAULT_MAX_RECORD,
        upload_interval_s: float | None = 30.0,
        probe_interval_s: float = 1.0,
        durability: str = "fsync",
        os_sync_interval_s: float = 0.2,
    ) -> TrajectoryLog:
        """Open (or create) the log at ``location``: a directory path, ``file://`` URL or remote fsspec URL.

        ``upload_url`` is an alternative spelling: a local ``location`` whose sealed segments also go to it.
        ``readonly`` opens an existing local log beside its writer (no lock, no repair, no appends): for
        inspection tools; ``records()`` and ``follow(until_idle=0)`` see what was committed at open.
        ``max_record_bytes``: the largest record ``append`` takes. ``upload_interval_s`` (remote logs): how
        often the active segment's committed part is uploaded too (None: only sealed segments).
        ``probe_interval_s``: how often a degraded log checks whether it can write again. ``durability``:
        ``fsync`` or ``os`` (synced every ``os_sync_interval_s``), see the module's doc.
        """
        if upload_url is not None:
            if "://" in location and not location.startswith("file://"):
                raise ValueError("give either a remote location or upload_url, not both")
            cache_dir = location.removeprefix("file://")
            location = upload_url
        dirpath, fs, root = split_location(location, cache_dir)
        log = cls(dirpath, segment_bytes, fs, root, max_record_bytes, probe_interval_s, durability,
                  os_sync_interval_s, readonly=readonly)
        log.location = location
        loop = asyncio.get_running_loop()
        if readonly:
            if not dirpath.is_dir():
                raise FileNotFoundError(f"no trajectory log at {dirpath}")
            await loop.run_in_executor(log._io, log._recover, True)
            return log
        try:
            await loop.run_in_executor(log._io, log._recover, False)
        except BaseException:
            log._release()
            raise
        log._start(upload_interval_s)
        return log

    def _recover(self, readonly: bool) -> None:
        """I/O thread: lock the directory, rebuild the table and the index, open the active segment."""
        if readonly:
            recover(self.table, self.index, self.stats, readonly=True)
            return
        self._lock_fd = lock_dir(self.dir)
        recover(self.table, self.index, self.stats,
                restore=self.uploader.download if self.uploader is not None else None)
        self.active.open()

    def _start(self, upload_interval_s: float | None) -> None:
        self._writer = CommitThread(
            asyncio.get_running_loop(), self.active.write, self._committed, self._writer_died,
            _MAX_BATCH_BYTES)
        self._writer.start()
        if self.durability == "os":
            self._syncer = asyncio.create_task(
                self.active.sync_forever(self.os_sync_interval_s, self._io, lambda: self.changes.closed,
                                         self.health.degrade), name="steptap-wal-syncer")
        if self.uploader is not None:
            for segno in self.table.sealed():
                self.uploader.schedule(segno, only_if_missing=True)
            if upload_interval_s:
                self.uploader.start_active_uploads(upload_interval_s)

    # ---- appending (group commit) ------------------------------------------------------------------------

    async def append(self, record: LogRecord) -> str:
        """Append ``record``; returns the cursor after it once it is on disk (synced). ``RecordTooLarge`` when
        it exceeds ``max_record_bytes``; ``LogUnavailable`` while the log cannot write (``degraded``)."""
        return (await self.append_at(record))[1]

    async def append_at(self, record: LogRecord, *, alone: bool = False) -> tuple[str, str]:
        """Like ``append``; returns the cursors where the record starts (what a ``StepRef`` names) and
        ends. ``alone``: the caller is all the loop has to do (the one model call in flight), so the record
        may be synced on the loop (``ActiveSegment.inline``)."""
        self._check_open()
        return await self._queue(msgpack_encoder.encode(record), record, alone)

    async def append_encoded(self, payload: bytes, record: LogRecord, *,
                             alone: bool = False) -> tuple[str, str]:
        """``append_at`` of a record its caller already encoded: ``payload`` is ``record``'s msgpack bytes
        (what ``msgpack_encoder.encode(record)`` gives), written as they are; ``record`` is what the log's
        index reads once it is committed. A caller that measures a record encodes it once."""
        self._check_open()
        return await self._queue(payload, record, alone)

    def _check_open(self) -> None:
        if self.changes.closed:
            raise LogClosedError("trajectory log is closed (or opened read-only)")
        self.health.ensure_writable()

    def _queue(self, payload: bytes, record: LogRecord, alone: bool) -> asyncio.Future[tuple[str, str]]:
        """Hand the record's frame to the writer thread, or sync it here (``alone``, where the active segment
        takes it inline); the future resolves once it is durable."""
        if len(payload) > self.max_record_bytes:
            raise RecordTooLarge(
                f"the record is {len(payload)} bytes, above the trajectory log's limit of "
                f"{self.max_record_bytes} bytes"
            )
        fut: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()
        assert self._writer is not None  # set by open() whenever the log is not closed
        item = (frame(payload), record, fut)
        (self._writer.write_now if alone and self.active.inline(len(item[0])) else self._writer.put)(item)
        return fut

    def _committed(self, batch: list[Item], written: Written) -> None:
        """On the loop, once per group: resolve its appends, track what readers need, wake the followers."""
        positions, sealed, error = written
        self.stats.last_batch_records = len(positions)
        self.stats.records += len(positions)
        self.stats.bytes += sum(len(b[0]) for b in batch[: len(positions)])
        # positions: the committed prefix of the batch
        for (data, record, fut), (segno, offset) in zip(batch, positions, strict=False):
            self.index.appended(record, segno, offset)
            if not fut.done():  # the caller may have gone away; the record is durable all the same
                fut.set_result((format_cursor(segno, offset - len(data)), format_cursor(segno, offset)))
        if error is not None:
            self._failed(batch[len(positions):], error)
        if self.uploader is not None:
            self.uploader.sealed(sealed)
        self.changes.committed()

    def _failed(self, failed: list[Item], error: BaseException) -> None:
        """Disk full, I/O error: what was committed before it stands (resolved); the rest fails and the log
        refuses new records until a probe write succeeds, so memory and log stay in step. What was queued
        behind a failed group fails too (``NotWritten``, not a write error of its own)."""
        if not isinstance(error, NotWritten):
            logger.error("trajectory log write failed (%s); %d append(s) fail", error, len(failed))
            self.health.degrade(error)
        for _, _, fut in failed:
            if not fut.done():
                unavailable = LogUnavailable("the trajectory log could not write: "
                                             f"{self.health.reason or error}")
                unavailable.__cause__ = error
                fut.set_exception(unavailable)

    def _writer_died(self, exc: BaseException, batch: list[Item]) -> None:
        """The writer only ends at close; if it died of a bug, fail what waits instead of hanging forever."""
        logger.error("trajectory log writer died", exc_info=exc)
        self.changes.closed = True
        assert self._writer is not None
        for _, _, fut in batch + self._writer.pending():
            if not fut.done():
                fut.set_exception(LogClosedError("trajectory log writer died"))

    def _writable_again(self) -> None:
        if self._writer is not None:  # it wrote nothing since the failure (writer.py)
            self._writer.resume()

    # ---- what the parts answer ---------------------------------------------------------------------------

    @property
    def disk_bytes(self) -> int:
        """Bytes held by the retained local segments."""
        return self.table.disk_bytes()

    @property
    def degraded(self) -> bool:
        """True while the log cannot write (its last group commit failed and no probe has succeeded since)."""
        return self.health.reason is not None

    @property
    def degraded_reason(self) -> str | None:
        """Why the log cannot write, while it cannot (``degraded.py``)."""
        return self.health.reason

    def ensure_writable(self) -> None:
        """``LogUnavailable`` while degraded: callers refuse new work instead of doing it and losing it."""
        self.health.ensure_writable()

    @property
    def last_policy_version(self) -> PolicyVersion | None:
        """The latest ``PolicyVersion`` record (what compaction carries forward; the weight swapper restores
        its state from it at start-up and owns what it means)."""
        return self.index.last_version[1] if self.index.last_version is not None else None

    async def compact(self, min_cursor: str) -> list[int]:
        """``compaction.py``: delete the sealed segments every consumer is done with; returns them."""
        return await self.compactor.compact(min_cursor)

    def trajectories_after(self, cursor: str | None) -> int:
        """How many finished trajectories the log holds after ``cursor`` (a consumer's lag)."""
        return self.index.trajectories_after(cursor)

    @property
    def end_cursor(self) -> str:
        """The cursor after the last committed record."""
        return self.reader.end_cursor

    def records(self) -> Iterator[LogRecord]:
        """``reader.py``: every retained, committed record in log order, as logged."""
        return self.reader.records()

    def located_records(self) -> Iterator[tuple[str, LogRecord]]:
        """``records()`` with the cursor where each starts."""
        return self.reader.located_records()

    def check_cursor(self, cursor: str) -> None:
        """``ValueError`` unless ``cursor`` names a record boundary of this log (reads from disk)."""
        self.reader.check_cursor(cursor)

    def trajectory_at(self, cursor: str) -> Trajectory:
        """The finished trajectory whose record starts at ``cursor``, with full steps (reads from disk)."""
        return self.reader.trajectory_at(cursor)

    def with_steps(self, traj: Trajectory) -> Trajectory:
        """A held trajectory with its full steps read back from its refs (reads from disk)."""
        return self.reader.with_steps(traj)

    start_of = staticmethod(Reader.start_of)

    def undecodable(self, cursor: str, exc: Exception) -> None:
        """Count and log a record that does not decode (once per record)."""
        self.reader.undecodable(cursor, exc)

    def tail(self, cursor: str | None = None, *, idle: float | None = None,
             raw: bool = False) -> AsyncGenerator[tuple[str, Any], None]:
        """``reader.py``: finished trajectories after ``cursor``, with heartbeats every ``idle`` seconds."""
        return self.reader.tail(cursor, idle=idle, raw=raw)

    def finished_after(self, cursor: str) -> tuple[list[tuple[str, Any]], str]:
        """``reader.py``: a chunk of the finished trajectories after ``cursor``, raw (off the loop)."""
        return self.reader.finished_after(cursor)

    def follow(self, cursor: str | None = None, *,
               until_idle: float | None = None) -> AsyncIterator[tuple[str, Trajectory]]:
        """``reader.py``: finished trajectories after ``cursor``, waiting for new ones like ``tail -f``."""
        return self.reader.follow(cursor, until_idle=until_idle)

    # ---- closing -----------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Finish queued appends, seal and upload the active segment of a remote log, and release the
        files."""
        if self._writer is None:  # read-only (or never opened)
            self.changes.closed = True
            self._io.shutdown(wait=True)
            return
        if self._closing:
            return
        self._closing = True
        self.changes.closed = True
        self._writer.stop()
        self.health.stop()
        if self.uploader is not None:
            self.uploader.stop_active_uploads()
        if self._syncer is not None:
            self._syncer.cancel()
        await self._writer.stopped  # every queued append resolved (a dead writer failed them)
        loop = asyncio.get_running_loop()
        if self.uploader is not None:
            if self.table.active[1] > len(HEADER):
                self.uploader.schedule(await loop.run_in_executor(self._io, self.active.roll))
            await self.uploader.wait()
        await loop.run_in_executor(self._io, self.active.close)
        self._io.shutdown(wait=True)
        self._release()
        self.changes.close()  # followers return

    def _release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = -1

    async def __aenter__(self) -> TrajectoryLog:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
