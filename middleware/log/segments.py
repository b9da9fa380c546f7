"""The trajectory log's on-disk format: segment files, frames, cursors, and the file helpers around them.

A log directory holds ``seg-00000001.log``, ``seg-00000002.log``, ... Each segment starts with an 8-byte
header (``STAPLOG`` + a format byte) followed by frames::

    u32 length (little endian) | u32 crc32 of the payload | payload (a msgspec msgpack ``LogRecord``)

A **cursor** names the position just after a record: ``"SEGNO:OFFSET"`` (``"3:1048576"``; defined in
``wire.py``, which the stream's client shares). Reading "after cursor C" starts at that byte.

Everything here is stateless; ``table.py`` holds the segment table, ``active.py`` the write path.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any

from steptap.middleware.files import FILE_MODE, datasync, fsync_path, write_all
from steptap.middleware.wire import cursor_key, format_cursor, parse_cursor

HEADER = b"STAPLOG\x01"  # magic + format version 1
FRAME = struct.Struct("<II")  # length, crc32
MAX_RECORD = 1 << 30  # the format's ceiling for a record limit (``TrajectoryLog.max_record_bytes``)
SEG_RE = re.compile(r"^seg-(\d{8})\.log$")


class CorruptLogError(Exception):
    """A log that cannot be read as one (bad header); torn tails and bad frames never raise."""


def seg_name(segno: int) -> str:
    return f"seg-{segno:08d}.log"


def list_segments(dirpath: Path) -> list[int]:
    """The segment numbers present in ``dirpath``, ascending (none if it does not exist)."""
    if not dirpath.is_dir():
        return []
    return sorted(int(m.group(1)) for p in os.listdir(dirpath) if (m := SEG_RE.match(p)))


def frame(payload: bytes) -> bytes:
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def scan_frames(data: bytes | memoryview, start: int) -> tuple[list[tuple[int, int]], int]:
    """Walk frames from ``start``: ([(payload_offset, payload_end)], offset of the first bad or partial frame
    or len(data) when all are good). A frame whose length fits in ``data`` and whose checksum matches is good
    whatever its size: no reader's limit may turn an intact, acknowledged record into "corruption"."""
    out: list[tuple[int, int]] = []
    pos, n = start, len(data)
    while pos < n:
        if n - pos < FRAME.size:
            return out, pos
        length, crc = FRAME.unpack_from(data, pos)
        end = pos + FRAME.size + length
        if end > n or zlib.crc32(data[pos + FRAME.size:end]) != crc:
            return out, pos
        out.append((pos + FRAME.size, end))
        pos = end
    return out, pos


def frame_at(path: Path, offset: int, end: int) -> bool:
    """Whether an intact frame starts at ``offset`` of ``path`` and ends by ``end``."""
    with open(path, "rb") as f:
        f.seek(offset)
        head = f.read(FRAME.size)
        if len(head) != FRAME.size:
            return False
        length: int  # FRAME unpacks to ints (struct gives tuple[Any, ...])
        length, crc = FRAME.unpack(head)
        return offset + FRAME.size + length <= end and zlib.crc32(f.read(length)) == crc


def create_segment(dirpath: Path, segno: int) -> None:
    """Create segment ``segno`` holding only the header, synced (file and directory entry)."""
    path = dirpath / seg_name(segno)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        if path.stat().st_size > len(HEADER):  # never overwrite records
            raise CorruptLogError(f"{path} already exists and holds records") from None
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)  # left over from a failed earlier try
    try:
        write_all(fd, HEADER)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(dirpath)


def split_location(location: str, cache_dir: str | None) -> tuple[Path, Any, str | None]:
    """-> (local dir, remote fsspec filesystem or None, remote root path or None). A ``cache_dir`` given with
    a ``file://`` URL makes that URL the upload target (a second local directory)."""
    if cache_dir is None and location.startswith("file://"):
        return Path(location[len("file://"):]), None, None
    if "://" not in location:
        return Path(location), None, None
    import fsspec  # only remote logs need it

    fs, root = fsspec.core.url_to_fs(location)
    if cache_dir is None:
        digest = hashlib.sha256(location.encode()).hexdigest()[:16]
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "steptap" / "wal"
        cache_dir = str(base / digest)
    return Path(cache_dir), fs, root.rstrip("/")


__all__ = [
    "FRAME", "HEADER", "MAX_RECORD", "SEG_RE", "CorruptLogError", "create_segment", "cursor_key", "datasync",
    "format_cursor", "frame", "frame_at", "fsync_path", "list_segments", "parse_cursor", "scan_frames",
    "seg_name", "split_location", "write_all",
]
