"""The trajectory log: append-only segment files of checksummed msgpack records, durable before ``append``
returns.

The on-disk format (segments, frames, cursors) is in ``segments.py``.

**Group commit.** One writer thread (``writer.py``) drains a queue of encoded frames. It writes what is queued
in one ``write`` and one ``fdatasync`` (never on the event loop) and hands the group back to the loop in one
callback. A lone record is thus written and synced at once; records that arrive while a sync is in progress
wait for the next one and share it. Each ``append`` resolves only after the sync that covered its record.

**Recovery** at open (``recovery.py``) cuts a torn tail and rebuilds what the writer tracks; **reading**
(``reader.py``) serves start-up, the stream and cursor checks; **remote logs** (``remote.py``) keep the
write-ahead log local and upload sealed segments.

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
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from steptap.middleware import files
from steptap.middleware.exceptions import LogUnavailable, RecordTooLarge
from steptap.middleware.log.compaction import Compaction
from steptap.middleware.log.degraded import Degraded
from steptap.middleware.log.images import ImageStore
from steptap.middleware.log.reader import Reader
from steptap.middleware.log.recovery import LogInUseError, Recovery
from steptap.middleware.log.remote import Remote
from steptap.middleware.log.segments import (
    HEADER,
    MAX_RECORD,
    CorruptLogError,
    create_segment,
    format_cursor,
    frame,
    parse_cursor,
    seg_name,
    split_location,
)
from steptap.middleware.log.writer import CommitThread, Item, NotWritten, Written
from steptap.middleware.records import (
    HeldDropped,
    LogRecord,
    PolicyVersion,
    SessionOpened,
    Step,
    Trajectory,
    msgpack_encoder,
)

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


class LogStats(msgspec.Struct, kw_only=True):
    records: int = 0  # records appended since open
    bytes: int = 0  # bytes appended since open
    commits: int = 0  # fdatasync calls (one per group commit, plus segment seals)
    torn_records: int = 0  # torn tails truncated at open
    torn_bytes: int = 0
    corrupt_records: int = 0  # bad frames inside sealed segments (the rest of each is skipped)
    last_batch_records: int = 0
    segments: int = 0  # retained local segments
    uploads: int = 0  # sealed segments uploaded to the remote URL
    active_uploads: int = 0  # uploads of the active segment's committed part (timer)
    # Records that did not decode, skipped by a reader (each time one reads them)
    undecodable_records: int = 0
    write_errors: int = 0  # failed group commits (disk full, I/O error)


class TrajectoryLog(Recovery, Reader, Remote, Degraded, Compaction):
    """An append-only, crash-safe log of ``LogRecord``s. Create with ``await
    TrajectoryLog.open(location)``."""

    _active_uploader: asyncio.Task[None] | None = None

    def __init__(
        self, dirpath: Path, segment_bytes: int, fs: Any, remote_root: str | None,
        max_record_bytes: int = DEFAULT_MAX_RECORD, probe_interval_s: float = 1.0,
        durability: str = "fsync", os_sync_interval_s: float = 0.2,
    ) -> None:
        if not 0 < max_record_bytes <= MAX_RECORD:
            raise ValueError(f"max_record_bytes must be between 1 and {MAX_RECORD}")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, not {durability!r}")
        if not os_sync_interval_s > 0:
            raise ValueError("os_sync_interval_s must be positive")
        self.durability = durability
        self.os_sync_interval_s = os_sync_interval_s
        self._unsynced = False  # durability "os": written groups not yet synced
        self._syncer: asyncio.Task[None] | None = None
        self.dir = dirpath
        self.location = str(dirpath)  # what open() was given
        self.segment_bytes = segment_bytes
        self.max_record_bytes = max_record_bytes
        self.probe_interval_s = probe_interval_s
        self.degraded_reason: str | None = None  # why the log cannot write, while it cannot
        self._probe: asyncio.Task[None] | None = None
        self.stats = LogStats()
        self._bad: set[str] = set()
        self._fs = fs
        self._remote_root = remote_root
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="steptap-wal")
        self._writer: CommitThread | None = None
        self._fd_lock = threading.Lock()  # the active segment: the writer thread vs the timed sync ("os")
        self._uploads: set[asyncio.Task[None]] = set()
        self._closed = False
        self._fd = -1
        self._lock_fd = -1
        self._upload_failed: set[int] = set()
        self._uploading: set[int] = set()
        self._segno = 0  # the active segment
        self._size = 0  # its committed length
        self._valid_end: dict[int, int] = {}  # sealed segno -> end of its readable frames
        self._open_sessions: dict[str, int] = {}  # trajectory id -> segno of its SessionOpened
        self._last_version: tuple[int, PolicyVersion] | None = None
        self._traj_ends = array("q")  # cursor_key() after each finished trajectory, in log order (stream lag)
        # Beside it: the segment of its first referenced step (compaction keeps it)
        self._traj_firsts = array("q")
        self._changed = asyncio.Event()  # set (and replaced) after every commit: wakes followers
        # Guards the segment table (_segno, _size, _valid_end) between the writer thread and reader threads.
        self._lock = threading.Lock()
        self._upload_lock = threading.Lock()  # one upload at a time (remote.py)
        self._compact_lock = asyncio.Lock()
        # The images beside the log (images.py), and the last segment referring to each (compaction sweeps)
        self.images = ImageStore(dirpath, durable=durability == "fsync", fs=fs, remote_root=remote_root)
        self._image_segs: dict[str, int] = {}

    # ---- opening and recovery ----------------------------------------------------------------------------

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
                  os_sync_interval_s)
        log.location = location
        if readonly:
            if not dirpath.is_dir():
                raise FileNotFoundError(f"no trajectory log at {dirpath}")
            log._closed = True  # appends refused
            await asyncio.get_running_loop().run_in_executor(log._io, log._recover, True)
            return log
        try:
            await asyncio.get_running_loop().run_in_executor(log._io, log._recover)
        except BaseException:
            log._release()
            raise
        log._writer = CommitThread(
            asyncio.get_running_loop(), log._write_batch, log._committed, log._writer_died, _MAX_BATCH_BYTES
        )
        log._writer.start()
        if durability == "os":
            log._syncer = asyncio.create_task(log._sync_forever(), name="steptap-wal-syncer")
        if fs is not None:
            for segno in sorted(log._valid_end):
                log._schedule_upload(segno, only_if_missing=True)
            if upload_interval_s:
                log._start_active_uploads(upload_interval_s)
        return log

    # ---- appending (group commit) ------------------------------------------------------------------------

    async def append(self, record: LogRecord) -> str:
        """Append ``record``; returns the cursor after it once it is on disk (synced). ``RecordTooLarge`` when
        it exceeds ``max_record_bytes``; ``LogUnavailable`` while the log cannot write (``degraded``)."""
        return (await self.append_at(record))[1]

    async def append_at(self, record: LogRecord) -> tuple[str, str]:
        """Like ``append``; returns the cursors where the record starts (what a ``StepRef`` names) and
        ends."""
        if self._closed:
            raise LogClosedError("trajectory log is closed (or opened read-only)")
        self.ensure_writable()
        payload = msgpack_encoder.encode(record)
        if len(payload) > self.max_record_bytes:
            raise RecordTooLarge(
                f"the record is {len(payload)} bytes, above the trajectory log's limit of "
                f"{self.max_record_bytes} bytes"
            )
        fut: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()
        assert self._writer is not None  # set by open() whenever _closed is False
        self._writer.put((frame(payload), record, fut))
        return await fut

    @property
    def disk_bytes(self) -> int:
        """Bytes held by the retained local segments."""
        with self._lock:
            return sum(self._valid_end.values()) + self._size

    def _committed(self, batch: list[Item], written: Written) -> None:
        """On the loop, once per group: resolve its appends, track what readers need, wake the followers."""
        positions, sealed, error = written
        self.stats.last_batch_records = len(positions)
        self.stats.records += len(positions)
        self.stats.bytes += sum(len(b[0]) for b in batch[: len(positions)])
        # positions: the committed prefix of the batch
        for (data, record, fut), (segno, offset) in zip(batch, positions, strict=False):
            self._track(record, segno, offset)
            if not fut.done():  # the caller may have gone away; the record is durable all the same
                fut.set_result((format_cursor(segno, offset - len(data)), format_cursor(segno, offset)))
        if error is not None:
            # Disk full, I/O error: what was committed before it stands (resolved above); the rest fails and
            # the log refuses new records until a probe write succeeds, so memory and log stay in step. What
            # was queued behind a failed group fails too (``NotWritten``, not a write error of its own).
            failed = batch[len(positions):]
            if not isinstance(error, NotWritten):
                logger.error("trajectory log write failed (%s); %d append(s) fail", error, len(failed))
                self._degrade(error)
            for _, _, fut in failed:
                if not fut.done():
                    unavailable = LogUnavailable("the trajectory log could not write: "
                                                 f"{self.degraded_reason or error}")
                    unavailable.__cause__ = error
                    fut.set_exception(unavailable)
        for segno in sealed + sorted(self._upload_failed):
            self._schedule_upload(segno)
        self._changed.set()
        self._changed = asyncio.Event()

    def _writer_died(self, exc: BaseException, batch: list[Item]) -> None:
        """The writer only ends at close; if it died of a bug, fail what waits instead of hanging forever."""
        logger.error("trajectory log writer died", exc_info=exc)
        self._closed = True
        assert self._writer is not None
        for _, _, fut in batch + self._writer.pending():
            if not fut.done():
                fut.set_exception(LogClosedError("trajectory log writer died"))

    def _track(self, record: LogRecord, segno: int, offset: int) -> None:
        if isinstance(record, Step):
            self._refers(record.images, segno)
        elif isinstance(record, SessionOpened):
            self._opened(record.trajectory_id, segno)
        elif isinstance(record, Trajectory) and record.status != "running":
            for step in record.steps:  # an anonymous call's steps live in its trajectory record
                self._refers(step.images, segno)
            self._finished(record.id, record.step_refs, segno, offset)
        elif isinstance(record, HeldDropped):  # a held session (still open for compaction) ended untrained
            self._open_sessions.pop(record.trajectory_id, None)
        elif isinstance(record, PolicyVersion):
            self._last_version = (segno, record)

    def _write_batch(
        self, frames: list[bytes]
    ) -> tuple[list[tuple[int, int]], list[int], OSError | None]:
        """Writer thread: write frames (rolling segments over at ``segment_bytes``), sync, return the position
        after each committed frame (a prefix of ``frames``), the segments sealed on the way, and the error
        that stopped it, if any."""
        with self._fd_lock:
            return self._write_frames(frames)

    def _write_frames(
        self, frames: list[bytes]
    ) -> tuple[list[tuple[int, int]], list[int], OSError | None]:
        positions: list[tuple[int, int]] = []
        committed = 0
        sealed: list[int] = []
        buf: list[bytes] = []
        pos = self._size
        try:
            for fr in frames:
                if pos > len(HEADER) and pos + len(fr) > self.segment_bytes:
                    self._flush(buf)
                    committed, buf = len(positions), []
                    sealed.append(self._roll())
                    pos = self._size
                buf.append(fr)
                pos += len(fr)
                positions.append((self._segno, pos))
            self._flush(buf)
        except OSError as exc:
            # Leave no half-written group behind: cut back to what was committed.
            try:
                os.ftruncate(self._fd, self._size)
                os.lseek(self._fd, self._size, os.SEEK_SET)
            except OSError:
                pass
            return positions[:committed], sealed, exc
        return positions, sealed, None

    def _flush(self, buf: list[bytes]) -> None:
        if not buf:
            return
        # At the committed end; with fsync, written and synced by one system call where the platform can.
        files.write_all(self._fd, b"".join(buf), self._size, dsync=self.durability == "fsync")
        if self.durability == "fsync":
            self.stats.commits += 1
        else:
            self._unsynced = True
        with self._lock:
            self._size += sum(len(b) for b in buf)

    def _roll(self) -> int:
        """Seal the active segment (already synced) and start the next; returns the sealed segno."""
        old = self._segno
        self._sync_now()  # durability "os": a sealed segment is synced like any other
        # The next segment exists before any reader can be sent to it; if creating it fails (disk full), the
        # active segment is untouched and the next batch tries again.
        create_segment(self.dir, old + 1)
        fd = os.open(self.dir / seg_name(old + 1), os.O_WRONLY)
        os.lseek(fd, len(HEADER), os.SEEK_SET)
        os.close(self._fd)
        self._fd = fd
        with self._lock:
            self._valid_end[old] = self._size
            self._segno = old + 1
            self._size = len(HEADER)
        self.stats.segments = len(self._valid_end) + 1
        return old

    # ---- durability "os": the timed sync ------------------------------------------------------------------

    def _sync_locked(self) -> None:
        with self._fd_lock:
            self._sync_now()

    def _sync_now(self) -> None:
        """Sync what was written but not yet synced (durability ``os``); the caller holds ``_fd_lock`` or is
        the only one left touching the segment."""
        if self._unsynced:
            files.datasync(self._fd)
            self._unsynced = False
            self.stats.commits += 1

    async def _sync_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(self.os_sync_interval_s)
            if not self._unsynced:
                continue
            try:
                await loop.run_in_executor(self._io, self._sync_locked)
            except OSError as exc:
                self._degrade(exc)

    # ---- closing -----------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Finish queued appends, seal and upload the active segment of a remote log, and release the
        files."""
        if self._writer is None:  # read-only (or never opened)
            self._closed = True
            self._io.shutdown(wait=True)
            return
        if self._closed:
            return
        self._closed = True
        self._writer.stop()
        for task in (self._probe, self._active_uploader, self._syncer):
            if task is not None:
                task.cancel()
        await self._writer.stopped  # every queued append resolved (a dead writer failed them)
        loop = asyncio.get_running_loop()
        if self._fs is not None and self._size > len(HEADER):
            sealed = await loop.run_in_executor(self._io, self._roll)
            self._schedule_upload(sealed)
        if self._uploads:
            await asyncio.gather(*list(self._uploads), return_exceptions=True)
        await loop.run_in_executor(self._io, self._sync_locked)
        await loop.run_in_executor(self._io, os.close, self._fd)
        self._io.shutdown(wait=True)
        self._release()
        self._changed.set()  # followers return

    def _release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = -1

    async def __aenter__(self) -> TrajectoryLog:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

