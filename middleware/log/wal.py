"""The trajectory log: append-only segment files of checksummed msgpack records, durable before ``append``
returns.

The on-disk format (segments, frames, cursors) is in ``segments.py``.

**Group commit.** One writer task drains a queue of encoded frames. It writes what is queued in one ``write``
and one ``fdatasync`` in a worker thread (never on the event loop). A lone record is thus written and synced
at once; records that arrive while a sync is in progress wait for the next one and share it. Each ``append``
resolves only after the sync that covered its record.

**Recovery.** Only the last segment can end in a torn record (a crash mid-write: every earlier segment was
synced before the next was created). Opening truncates the last segment at its first bad frame, keeps the cut
bytes beside it (``seg-N.log.torn-OFFSET``), counts it and logs a warning. A bad frame inside a sealed segment is
disk corruption: it is logged as an error, counted, and the rest of that segment is skipped by every reader.

**Remote logs.** For an fsspec URL (``s3://``, ``gs://``, ``memory://``) the write-ahead log stays in a local
directory (``cache_dir``, or one derived from the URL under ``~/.cache/steptap/wal``) and each sealed segment
is uploaded under the URL with the same name. A fresh local directory is first filled from the remote copy.

**Compaction rule** (``compact(min_cursor)``): only a prefix of sealed segments is ever deleted, locally and
remotely: the segments wholly before ``min_cursor`` (every consumer has acknowledged them) and before the
segment holding the ``SessionOpened`` of the oldest session still open (so a restart can still rebuild every
open session). The latest ``PolicyVersion`` record is re-appended first if its segment is about to go.
"""

from __future__ import annotations

import asyncio
import bisect
import fcntl
import logging
import os
import threading
import time
from array import array
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from steptap.middleware.records import LogRecord, PolicyVersion, SessionOpened, Trajectory, log_decoder, msgpack_encoder
from steptap.middleware.log.segments import (
    FRAME,
    HEADER,
    MAX_RECORD,
    SEG_RE,
    CorruptLogError,
    create_segment,
    cursor_key,
    datasync,
    format_cursor,
    frame,
    frame_at,
    fsync_path,
    list_segments,
    parse_cursor,
    scan_frames,
    seg_name,
    split_location,
)

# Format names are re-exported: callers import them from here.
__all__ = [
    "HEADER", "MAX_RECORD", "CorruptLogError", "LogClosedError", "LogInUseError", "LogStats", "TrajectoryLog",
    "format_cursor", "frame", "parse_cursor",
]

logger = logging.getLogger("steptap.wal")

_MAX_BATCH_BYTES = 8 << 20  # one commit writes at most this much (bounds the latency of the records queued last)


class LogClosedError(RuntimeError):
    pass


class LogInUseError(RuntimeError):
    """Another process has this log open for writing (two writers would interleave frames)."""


class LogStats(msgspec.Struct, kw_only=True):
    records: int = 0  # records appended since open
    bytes: int = 0  # bytes appended since open
    commits: int = 0  # fdatasync calls (one per group commit, plus segment seals)
    torn_records: int = 0  # torn tails truncated at open
    torn_bytes: int = 0
    corrupt_records: int = 0  # bad frames inside sealed segments (the rest of each is skipped)
    last_commit_latency_s: float = 0.0  # write + sync of the last group
    last_batch_records: int = 0
    segments: int = 0  # retained local segments
    uploads: int = 0  # sealed segments uploaded to the remote URL
    compacted_segments: int = 0


class _Peek(msgspec.Struct, kw_only=True, tag_field="type"):
    trajectory_id: str = ""


class _PeekStep(_Peek, tag="step"):
    pass


class _PeekOpened(_Peek, tag="session_opened"):
    pass


class _PeekReward(_Peek, tag="reward_added"):
    pass


class _PeekTrajectory(_Peek, tag="trajectory"):
    id: str = ""
    status: str = "running"


class _PeekVersion(_Peek, tag="policy_version"):
    pass


_peek_decoder = msgspec.msgpack.Decoder(_PeekStep | _PeekOpened | _PeekReward | _PeekTrajectory | _PeekVersion)


class TrajectoryLog:
    """An append-only, crash-safe log of ``LogRecord``s. Create with ``await TrajectoryLog.open(location)``."""

    def __init__(self, dirpath: Path, segment_bytes: int, fs: Any, remote_root: str | None) -> None:
        self.dir = dirpath
        self.location = str(dirpath)  # what open() was given
        self.segment_bytes = segment_bytes
        self.stats = LogStats()
        self._fs = fs
        self._remote_root = remote_root
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="steptap-wal")
        self._queue: asyncio.Queue[tuple[bytes, LogRecord, asyncio.Future[str]] | None] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
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
        self._changed = asyncio.Event()  # set (and replaced) after every commit: wakes followers
        # Guards the segment table (_segno, _size, _valid_end) between the writer thread and reader threads.
        self._lock = threading.Lock()
        self._compact_lock = asyncio.Lock()

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
    ) -> TrajectoryLog:
        """Open (or create) the log at ``location``: a directory path, ``file://`` URL or remote fsspec URL.

        ``upload_url`` is an alternative spelling: a local ``location`` whose sealed segments also go to it.
        ``readonly`` opens an existing local log beside its writer (no lock, no repair, no appends): for
        inspection tools; ``records()`` and ``follow(until_idle=0)`` see what was committed at open.
        """
        if upload_url is not None:
            if "://" in location and not location.startswith("file://"):
                raise ValueError("give either a remote location or upload_url, not both")
            cache_dir = location.removeprefix("file://")
            location = upload_url
        dirpath, fs, root = split_location(location, cache_dir)
        log = cls(dirpath, segment_bytes, fs, root)
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
        log._writer = asyncio.create_task(log._write_loop(), name="steptap-wal-writer")
        log._writer.add_done_callback(log._writer_done)
        if fs is not None:
            for segno in sorted(log._valid_end):
                log._schedule_upload(segno, only_if_missing=True)
        return log

    def _recover(self, readonly: bool = False) -> None:
        """Runs in the I/O thread: restore from remote if empty, validate every segment, truncate a torn tail,
        rebuild the open-session index, and open the active segment for appending."""
        if not readonly:
            self.dir.mkdir(parents=True, exist_ok=True)
            # One writer per directory: an exclusive lock the kernel drops when the process dies (even SIGKILL).
            self._lock_fd = os.open(self.dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LogInUseError(f"trajectory log {self.dir} is open in another process") from None
        segnos = list_segments(self.dir)
        if readonly:
            self._scan_segments(segnos, readonly=True)
            return
        if not segnos and self._fs is not None:
            segnos = self._download_remote()
        self._scan_segments(segnos, readonly=False)
        if not segnos:
            self._segno, self._size = 1, len(HEADER)
            create_segment(self.dir, 1)
        self._fd = os.open(self.dir / seg_name(self._segno), os.O_WRONLY)
        os.lseek(self._fd, self._size, os.SEEK_SET)
        self.stats.segments = len(self._valid_end) + 1

    def _scan_segments(self, segnos: list[int], readonly: bool) -> None:
        for i, segno in enumerate(segnos):
            last = i == len(segnos) - 1
            path = self.dir / seg_name(segno)
            data = path.read_bytes()
            if data[: len(HEADER)] != HEADER:
                if last and len(data) < len(HEADER) and HEADER.startswith(data):
                    data = b""  # crashed while creating it: rewrite the header below
                else:
                    raise CorruptLogError(f"{path} is not a steptap log segment (bad header)")
            frames, good_end = scan_frames(data, len(HEADER)) if data else ([], 0)
            for start, end in frames:
                self._index(segno, end, data[start:end])
            if last:
                # A reader beside a live writer sees its uncommitted tail: not torn, just not there yet.
                if (good_end < len(data) or not data) and not readonly:
                    self._truncate_tail(path, data, good_end)
                self._segno = segno
                self._size = max(good_end, len(HEADER))
            else:
                self._valid_end[segno] = good_end
                if good_end < len(data):
                    self.stats.corrupt_records += 1
                    logger.error(
                        "trajectory log %s is corrupt at offset %d (bad frame inside a sealed segment): "
                        "%d bytes after it are skipped by every reader", path, good_end, len(data) - good_end,
                    )
        if not segnos:
            self._segno, self._size = 1, len(HEADER)

    def _truncate_tail(self, path: Path, data: bytes, good_end: int) -> None:
        if not data:
            path.write_bytes(HEADER)
            fsync_path(path)
            fsync_path(self.dir)
            return
        torn = data[good_end:]
        # Frames after the bad one that still check out mean more than one torn write (e.g. pages persisted out
        # of order on power loss): none of them was acknowledged, since the sync covering them never returned.
        later, _ = scan_frames(data, good_end + 1) if len(torn) > FRAME.size else ([], 0)
        aside = path.with_name(f"{path.name}.torn-{good_end}")
        aside.write_bytes(torn)
        with open(path, "r+b") as f:
            f.truncate(good_end)
            os.fsync(f.fileno())
        fsync_path(self.dir)
        self.stats.torn_records += 1
        self.stats.torn_bytes += len(torn)
        logger.warning(
            "trajectory log %s ended in a torn record at offset %d (crash mid-write): dropped %d bytes "
            "(unacknowledged; kept in %s)%s", path, good_end, len(torn), aside.name,
            f"; {len(later)} later frame(s) in them looked intact" if later else "",
        )

    def _index(self, segno: int, end: int, payload: bytes | memoryview) -> None:
        """Track what compaction must keep (open sessions, the latest policy version) and where finished
        trajectories end."""
        try:
            peek = _peek_decoder.decode(payload)
        except msgspec.DecodeError:
            return  # an unknown record kind (newer writer): nothing to track
        if isinstance(peek, _PeekOpened):
            self._open_sessions.setdefault(peek.trajectory_id, segno)
        elif isinstance(peek, _PeekTrajectory) and peek.status != "running":
            self._open_sessions.pop(peek.id, None)
            self._traj_ends.append(cursor_key(segno, end))
        elif isinstance(peek, _PeekVersion):
            self._last_version = (segno, log_decoder.decode(payload))  # type: ignore[assignment]

    # ---- appending (group commit) ------------------------------------------------------------------------

    async def append(self, record: LogRecord) -> str:
        """Append ``record``; returns the cursor after it once it is on disk (synced)."""
        if self._closed:
            raise LogClosedError("trajectory log is closed (or opened read-only)")
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((frame(msgpack_encoder.encode(record)), record, fut))
        return await fut

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        stop = False
        while not stop:
            item = await self._queue.get()
            if item is None:
                break
            batch, size = [item], len(item[0])
            while size < _MAX_BATCH_BYTES and not self._queue.empty():
                nxt = self._queue.get_nowait()
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
                size += len(nxt[0])
            t0 = time.perf_counter()
            try:
                positions, sealed = await loop.run_in_executor(self._io, self._write_batch, [b[0] for b in batch])
            except Exception as exc:  # noqa: BLE001 - disk full, I/O error: fail these appends, keep serving
                logger.exception("trajectory log write failed; %d append(s) fail", len(batch))
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.stats.last_commit_latency_s = time.perf_counter() - t0
            self.stats.last_batch_records = len(batch)
            self.stats.records += len(batch)
            self.stats.bytes += size
            for (_, record, fut), (segno, offset) in zip(batch, positions):
                self._track(record, segno, offset)
                if not fut.done():  # the caller may have gone away; the record is durable all the same
                    fut.set_result(format_cursor(segno, offset))
            for segno in sealed + sorted(self._upload_failed):
                self._schedule_upload(segno)
            self._changed.set()
            self._changed = asyncio.Event()

    def _writer_done(self, task: asyncio.Task[None]) -> None:
        """The writer only ends at close; if it died of a bug, fail what waits instead of hanging forever."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("trajectory log writer died", exc_info=task.exception())
        self._closed = True
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None and not item[2].done():
                item[2].set_exception(LogClosedError("trajectory log writer died"))

    def _track(self, record: LogRecord, segno: int, offset: int) -> None:
        if isinstance(record, SessionOpened):
            self._open_sessions.setdefault(record.trajectory_id, segno)
        elif isinstance(record, Trajectory) and record.status != "running":
            self._open_sessions.pop(record.id, None)
            self._traj_ends.append(cursor_key(segno, offset))
        elif isinstance(record, PolicyVersion):
            self._last_version = (segno, record)

    def _write_batch(self, frames: list[bytes]) -> tuple[list[tuple[int, int]], list[int]]:
        """I/O thread: write frames (rolling segments over at ``segment_bytes``), sync, return the position
        after each frame and the segments sealed on the way."""
        positions: list[tuple[int, int]] = []
        sealed: list[int] = []
        buf: list[bytes] = []
        pos = self._size
        try:
            for fr in frames:
                if pos > len(HEADER) and pos + len(fr) > self.segment_bytes:
                    self._flush(buf)
                    buf = []
                    sealed.append(self._roll())
                    pos = self._size
                buf.append(fr)
                pos += len(fr)
                positions.append((self._segno, pos))
            self._flush(buf)
        except BaseException:
            # Leave no half-written group behind: cut back to what was committed.
            try:
                os.ftruncate(self._fd, self._size)
                os.lseek(self._fd, self._size, os.SEEK_SET)
            except OSError:
                pass
            raise
        return positions, sealed

    def _flush(self, buf: list[bytes]) -> None:
        if not buf:
            return
        data = memoryview(b"".join(buf))
        while data:
            n = os.write(self._fd, data)
            data = data[n:]
        datasync(self._fd)
        self.stats.commits += 1
        with self._lock:
            self._size += sum(len(b) for b in buf)

    def _roll(self) -> int:
        """Seal the active segment (already synced) and start the next; returns the sealed segno."""
        old = self._segno
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

    # ---- reading -----------------------------------------------------------------------------------------

    def _end_of(self, segno: int) -> int:
        with self._lock:
            return self._size if segno == self._segno else self._valid_end.get(segno, 0)

    def _read_frames(self, segno: int, offset: int, limit_bytes: int) -> tuple[list[tuple[int, bytes]], int]:
        """Committed frames of ``segno`` from ``offset``: ([(offset after, payload)], new offset)."""
        end = self._end_of(segno)
        if offset >= end:
            return [], offset
        try:
            with open(self.dir / seg_name(segno), "rb") as f:
                f.seek(offset)
                data = f.read(min(end - offset, max(limit_bytes, 1)))
        except FileNotFoundError:
            return [], end  # compacted under us
        frames, good = scan_frames(data, 0)
        if not frames and good == 0 and len(data) < end - offset:
            # One frame larger than limit_bytes: read exactly it.
            length, _ = FRAME.unpack_from(data, 0)
            return self._read_frames(segno, offset, FRAME.size + length)
        if not frames and len(data) == end - offset and good < len(data):
            raise ValueError(f"cursor {format_cursor(segno, offset)} does not point at a record")
        return [(offset + e, bytes(data[s:e])) for s, e in frames], offset + (frames[-1][1] if frames else 0)

    def _start_position(self, cursor: str | None) -> tuple[int, int]:
        segs = self._retained()
        if cursor is None:
            return segs[0], len(HEADER)
        segno, offset = parse_cursor(cursor)
        if segno < segs[0]:
            return segs[0], len(HEADER)  # compacted: everything still retained is after it
        if segno > self._segno or offset > self._end_of(segno) or offset < len(HEADER):
            raise ValueError(f"cursor {cursor!r} is beyond the end of this log")
        return segno, offset

    def check_cursor(self, cursor: str) -> None:
        """``ValueError`` unless ``cursor`` names a record boundary of this log (or a compacted position).
        Reads one frame from disk: call it off the event loop."""
        segno, offset = parse_cursor(cursor)
        segs = self._retained()
        if segno < segs[0]:
            return
        end = self._end_of(segno)
        if segno not in segs or offset < len(HEADER) or offset > end:
            raise ValueError(f"cursor {cursor!r} is beyond the end of this log")
        if offset == end:
            return
        if not frame_at(self.dir / seg_name(segno), offset, end):
            raise ValueError(f"cursor {cursor!r} does not point at a record of this log")

    def _retained(self) -> list[int]:
        with self._lock:
            return sorted(self._valid_end) + [self._segno]

    def _next_segment(self, segno: int) -> int | None:
        later = [s for s in self._retained() if s > segno]
        return later[0] if later else None

    def records(self) -> Iterator[LogRecord]:
        """Every retained, committed record in log order (for rebuilding open sessions at startup)."""
        for _, payload in self._iter_payloads(None):
            yield log_decoder.decode(payload)

    def _iter_payloads(self, cursor: str | None) -> Iterator[tuple[str, bytes]]:
        segno, offset = self._start_position(cursor)
        while True:
            frames, offset = self._read_frames(segno, offset, 4 << 20)
            for after, payload in frames:
                yield format_cursor(segno, after), payload
            if frames:
                continue
            nxt = self._next_segment(segno)
            if nxt is None:
                return
            segno, offset = nxt, len(HEADER)

    async def tail(
        self, cursor: str | None = None, *, idle: float | None = None, raw: bool = False
    ) -> AsyncIterator[tuple[str, Any]]:
        """Like ``follow``, but yields ``(cursor, None)`` after each ``idle`` seconds without a new
        trajectory (heartbeats for the HTTP stream); ``idle=None`` never does. With ``raw`` it yields each
        trajectory as the record's msgpack bytes, undecoded (the msgpack stream passes them through)."""
        loop = asyncio.get_running_loop()
        segno, offset = self._start_position(cursor)
        current = format_cursor(segno, offset)
        while True:
            changed = self._changed
            batch, segno, offset = await loop.run_in_executor(None, self._read_trajectories, segno, offset, raw)
            for cur, traj in batch:
                current = cur
                if traj is not None:
                    yield cur, traj
            if batch:
                continue
            if self._closed:
                return
            try:
                await asyncio.wait_for(changed.wait(), idle)
            except TimeoutError:
                yield current, None

    def _read_trajectories(self, segno: int, offset: int, raw: bool) -> tuple[list[tuple[str, Any]], int, int]:
        """Thread: the next finished trajectories after (segno, offset); a (cursor, None) entry marks skipped
        records so the position still advances."""
        while True:
            frames, new_offset = self._read_frames(segno, offset, 4 << 20)
            if frames:
                out: list[tuple[str, Any]] = []
                for after, payload in frames:
                    try:
                        peek = _peek_decoder.decode(payload)
                    except msgspec.DecodeError:
                        continue  # a record kind this version does not know
                    if isinstance(peek, _PeekTrajectory) and peek.status != "running":
                        out.append((format_cursor(segno, after), payload if raw else log_decoder.decode(payload)))
                if not out:
                    out.append((format_cursor(segno, new_offset), None))
                return out, segno, new_offset
            nxt = self._next_segment(segno)
            if nxt is None:
                return [], segno, offset
            segno, offset = nxt, len(HEADER)

    async def follow(
        self, cursor: str | None = None, *, until_idle: float | None = None
    ) -> AsyncIterator[tuple[str, Trajectory]]:
        """Finished trajectories after ``cursor`` (``None``: from the oldest retained), in log order, with the
        cursor after each, waiting for new ones like ``tail -f``. ``until_idle``: stop after that many seconds
        without a new one (0: stop at the current end)."""
        agen = self.tail(cursor, idle=until_idle)
        try:
            async for cur, traj in agen:
                if traj is None:
                    return
                yield cur, traj
        finally:
            await agen.aclose()

    def trajectories_after(self, cursor: str | None) -> int:
        """How many finished trajectories the log holds after ``cursor`` (a consumer's lag)."""
        if cursor is None:
            return len(self._traj_ends)
        return len(self._traj_ends) - bisect.bisect_right(self._traj_ends, cursor_key(*parse_cursor(cursor)))

    @property
    def end_cursor(self) -> str:
        """The cursor after the last committed record."""
        return format_cursor(self._segno, self._size)

    # ---- remote upload and compaction --------------------------------------------------------------------

    def _schedule_upload(self, segno: int, *, only_if_missing: bool = False) -> None:
        if self._fs is None or segno in self._uploading:
            return
        self._uploading.add(segno)
        task = asyncio.create_task(asyncio.to_thread(self._upload, segno, only_if_missing))
        self._uploads.add(task)
        task.add_done_callback(lambda t: (self._uploads.discard(t), self._uploading.discard(segno)))

    def _upload(self, segno: int, only_if_missing: bool) -> None:
        local = self.dir / seg_name(segno)
        remote = f"{self._remote_root}/{seg_name(segno)}"
        try:
            if only_if_missing and self._fs.exists(remote) and self._fs.size(remote) == local.stat().st_size:
                return
            self._fs.makedirs(self._remote_root, exist_ok=True)
            self._fs.put_file(str(local), remote)
            self.stats.uploads += 1
            self._upload_failed.discard(segno)
        except FileNotFoundError:
            pass  # compacted before it was uploaded
        except Exception:  # noqa: BLE001 - retried at the next seal and the next open; the local copy stays
            self._upload_failed.add(segno)
            logger.exception("uploading %s to %s failed", local, remote)

    def _download_remote(self) -> list[int]:
        try:
            names = [p.rsplit("/", 1)[-1] for p in self._fs.ls(self._remote_root, detail=False)]
        except FileNotFoundError:
            return []
        segnos = sorted(int(m.group(1)) for n in names if (m := SEG_RE.match(n)))
        for segno in segnos:
            self._fs.get_file(f"{self._remote_root}/{seg_name(segno)}", str(self.dir / seg_name(segno)))
        if segnos:
            logger.info("restored %d segment(s) of %s from the remote copy", len(segnos), self._remote_root)
        return segnos

    async def compact(self, min_cursor: str) -> list[int]:
        """Delete sealed segments wholly before ``min_cursor`` (the least acknowledged cursor over all
        consumers), never one at or after the oldest open session's ``SessionOpened``. Returns the deleted
        segment numbers."""
        async with self._compact_lock:  # two acks at once must not both carry the policy version forward
            return await self._compact(parse_cursor(min_cursor)[0], min_cursor)

    async def _compact(self, cut: int, min_cursor: str) -> list[int]:
        if self._open_sessions:
            cut = min(cut, min(self._open_sessions.values()))
        if self._upload_failed:  # never delete the only copy of a segment the remote still lacks
            cut = min(cut, min(self._upload_failed))
        victims = [s for s in self._retained()[:-1] if s < cut]
        if not victims:
            return []
        if self._last_version is not None and self._last_version[0] in victims:
            await self.append(self._last_version[1])  # carry the current policy version forward
            victims = [s for s in self._retained()[:-1] if s < cut]
        await asyncio.gather(*list(self._uploads), return_exceptions=True)  # never delete before it is uploaded
        with self._lock:
            for segno in victims:
                self._valid_end.pop(segno, None)
        del self._traj_ends[: bisect.bisect_left(self._traj_ends, cursor_key(victims[-1] + 1, 0))]
        await asyncio.get_running_loop().run_in_executor(self._io, self._delete, victims)
        self.stats.compacted_segments += len(victims)
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
        fsync_path(self.dir)

    # ---- closing -----------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Finish queued appends, seal and upload the active segment of a remote log, and release the files."""
        if self._writer is None:  # read-only (or never opened)
            self._closed = True
            self._io.shutdown(wait=True)
            return
        if self._closed:
            return
        self._closed = True
        self._queue.put_nowait(None)
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)  # a dead writer was reported already
        loop = asyncio.get_running_loop()
        if self._fs is not None and self._size > len(HEADER):
            sealed = await loop.run_in_executor(self._io, self._roll)
            self._schedule_upload(sealed)
        if self._uploads:
            await asyncio.gather(*list(self._uploads), return_exceptions=True)
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

