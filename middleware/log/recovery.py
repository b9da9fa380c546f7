"""Opening a log: restore from the remote copy if empty, validate every segment, cut a torn tail, and rebuild
the segment table (``table.py``) and what the log tracks (``index.py``).

Only the last segment can end in a torn record (a crash mid-write: every earlier segment was synced before the
next was created). Opening truncates the last segment at its first bad frame, keeps the cut bytes beside it
(``seg-N.log.torn-OFFSET``), counts it and logs a warning. A bad frame inside a sealed segment is disk
corruption: it is logged as an error, counted, and the rest of that segment is skipped by every reader.

Recovery peeks a tiny struct per record (its kind and ids) instead of decoding whole records.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path

from steptap.middleware import files
from steptap.middleware.log.index import LogIndex
from steptap.middleware.log.segments import (
    FRAME,
    HEADER,
    CorruptLogError,
    create_segment,
    list_segments,
    scan_frames,
    seg_name,
)
from steptap.middleware.log.stats import LogStats
from steptap.middleware.log.table import SegmentTable

logger = logging.getLogger("steptap.wal")


class LogInUseError(RuntimeError):
    """Another process has this log open for writing (two writers would interleave frames)."""


def lock_dir(dirpath: Path) -> int:
    """One writer per directory: an exclusive lock the kernel drops when the process dies (even SIGKILL).
    Returns the lock's descriptor (closing it drops the lock)."""
    files.makedirs(dirpath)
    fd = os.open(dirpath / "LOCK", os.O_RDWR | os.O_CREAT, files.FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LogInUseError(f"trajectory log {dirpath} is open in another process") from None
    return fd


def recover(table: SegmentTable, index: LogIndex, stats: LogStats, *, readonly: bool = False,
            restore: Callable[[], list[int]] | None = None) -> None:
    """Runs in the log's I/O thread, under the directory's lock unless ``readonly``: fill ``table`` and
    ``index`` from the segments (first from ``restore``, the remote copy, when there are none), cut a torn
    tail, and make sure the active segment exists (a reader beside a live writer repairs and creates
    nothing)."""
    segnos = list_segments(table.dir)
    if not segnos and restore is not None and not readonly:
        segnos = restore()
    _scan(table, index, stats, segnos, readonly)
    if not segnos:
        table.activate(1, len(HEADER))
        if not readonly:
            create_segment(table.dir, 1)
    stats.segments = table.count()


def _scan(table: SegmentTable, index: LogIndex, stats: LogStats, segnos: list[int], readonly: bool) -> None:
    for i, segno in enumerate(segnos):
        last = i == len(segnos) - 1
        path = table.dir / seg_name(segno)
        data = path.read_bytes()
        if data[: len(HEADER)] != HEADER:
            if last and len(data) < len(HEADER) and HEADER.startswith(data):
                data = b""  # crashed while creating it: rewrite the header below
            else:
                raise CorruptLogError(f"{path} is not a steptap log segment (bad header)")
        frames, good_end = scan_frames(data, len(HEADER)) if data else ([], 0)
        for start, end in frames:
            index.peeked(segno, end, data[start:end])
        if last:
            # A reader beside a live writer sees its uncommitted tail: not torn, just not there yet.
            if (good_end < len(data) or not data) and not readonly:
                _truncate_tail(path, data, good_end, stats)
            table.activate(segno, max(good_end, len(HEADER)))
        else:
            table.sealed_at(segno, good_end)
            if good_end < len(data):
                stats.corrupt_records += 1
                logger.error(
                    "trajectory log %s is corrupt at offset %d (bad frame inside a sealed segment): "
                    "%d bytes after it are skipped by every reader", path, good_end, len(data) - good_end,
                )


def _truncate_tail(path: Path, data: bytes, good_end: int, stats: LogStats) -> None:
    if not data:
        path.write_bytes(HEADER)
        files.fsync_path(path)
        files.fsync_path(path.parent)
        return
    torn = data[good_end:]
    # Frames after the bad one that still check out mean more than one torn write (e.g. pages persisted
    # out of order on power loss): none of them was acknowledged, since the sync covering them never
    # returned.
    later, _ = scan_frames(data, good_end + 1) if len(torn) > FRAME.size else ([], 0)
    aside = path.with_name(f"{path.name}.torn-{good_end}")
    files.atomic_write(aside, torn)
    with open(path, "r+b") as f:
        f.truncate(good_end)
        os.fsync(f.fileno())
    files.fsync_path(path.parent)
    stats.torn_records += 1
    stats.torn_bytes += len(torn)
    logger.warning(
        "trajectory log %s ended in a torn record at offset %d (crash mid-write): dropped %d bytes "
        "(unacknowledged; kept in %s)%s", path, good_end, len(torn), aside.name,
        f"; {len(later)} later frame(s) in them looked intact" if later else "",
    )
