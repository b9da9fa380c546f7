"""Opening a log: restore from the remote copy if empty, validate every segment, cut a torn tail, and rebuild
what the writer tracks (open sessions, the latest policy version, where finished trajectories end).

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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from steptap.middleware import files
from steptap.middleware.log.segments import (
    FRAME,
    HEADER,
    CorruptLogError,
    create_segment,
    cursor_key,
    list_segments,
    parse_cursor,
    scan_frames,
    seg_name,
)
from steptap.middleware.records import PolicyVersion, log_decoder

if TYPE_CHECKING:
    from array import array
    from collections.abc import Callable


logger = logging.getLogger("steptap.wal")


class LogInUseError(RuntimeError):
    """Another process has this log open for writing (two writers would interleave frames)."""


class Peek(msgspec.Struct, kw_only=True, tag_field="type"):
    trajectory_id: str = ""


class PeekImage(msgspec.Struct):
    sha256: str = ""


class PeekStep(Peek, tag="step"):
    images: list[PeekImage] = []  # compaction keeps what a kept step refers to (images.py)


class PeekOpened(Peek, tag="session_opened"):
    pass


class PeekReward(Peek, tag="reward_added"):
    pass


class PeekRef(msgspec.Struct, array_like=True):
    at: str  # a StepRef's cursor (its rewards are not read)


class PeekImages(msgspec.Struct):
    images: list[PeekImage] = []


class PeekTrajectory(Peek, tag="trajectory"):
    id: str = ""
    status: str = "running"
    step_refs: list[PeekRef] = []
    steps: list[PeekImages] = []  # an anonymous call's steps live in its trajectory record


class PeekVersion(Peek, tag="policy_version"):
    pass


class PeekCuration(Peek, tag="curation"):
    pass


class PeekDropped(Peek, tag="held_dropped"):
    pass


# A ``held`` record (a trajectory whose reward is pending) is not peeked: its session stays open for
# compaction until a Trajectory or HeldDropped record ends it
peek_decoder = msgspec.msgpack.Decoder(
    PeekStep | PeekOpened | PeekReward | PeekTrajectory | PeekVersion | PeekCuration | PeekDropped
)


def first_segment(refs: list[Any], segno: int) -> int:
    """The segment of a finished trajectory's first referenced step (``segno``, its own, when it refers to
    none): compaction keeps it until every consumer has acknowledged the trajectory."""
    return min((parse_cursor(r.at)[0] for r in refs), default=segno)


class _Kind(msgspec.Struct):
    type: str = ""


_kind_decoder = msgspec.msgpack.Decoder(_Kind)
KINDS = frozenset(("step", "session_opened", "reward_added", "trajectory", "policy_version", "curation",
                   "held", "held_dropped"))


def known_kind(payload: bytes | memoryview) -> str | None:
    """The record kind of ``payload`` if it is one this version writes (then a failed decode is a bad
    record, not a newer writer's record kind), else None."""
    try:
        kind = _kind_decoder.decode(payload).type
    except msgspec.DecodeError:
        return None
    return kind if kind in KINDS else None


class Recovery:
    """Mixin of ``TrajectoryLog``: the start-up scan (runs in the log's I/O thread)."""

    # What TrajectoryLog (wal.py) provides, declared for the type checker (annotations only: no values).
    _download_remote: Callable[[], list[int]]
    _open_sessions: dict[str, int]
    _image_segs: dict[str, int]
    _traj_ends: array[int]
    _traj_firsts: array[int]
    _valid_end: dict[int, int]
    _last_version: tuple[int, PolicyVersion] | None

    dir: Path
    stats: Any
    _fs: Any

    def _recover(self, readonly: bool = False) -> None:
        """Runs in the I/O thread: restore from remote if empty, validate every segment, truncate a torn tail,
        rebuild the open-session index, and open the active segment for appending."""
        if not readonly:
            files.makedirs(self.dir)
            # One writer per directory: an exclusive lock the kernel drops when the process dies (even
            # SIGKILL).
            self._lock_fd = os.open(self.dir / "LOCK", os.O_RDWR | os.O_CREAT, files.FILE_MODE)
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
            files.fsync_path(path)
            files.fsync_path(self.dir)
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
        files.fsync_path(self.dir)
        self.stats.torn_records += 1
        self.stats.torn_bytes += len(torn)
        logger.warning(
            "trajectory log %s ended in a torn record at offset %d (crash mid-write): dropped %d bytes "
            "(unacknowledged; kept in %s)%s", path, good_end, len(torn), aside.name,
            f"; {len(later)} later frame(s) in them looked intact" if later else "",
        )

    # What an opened and a finished trajectory change: at start-up (``_index``), on append (``wal._track``).
    def _opened(self, trajectory_id: str, segno: int) -> None:
        self._open_sessions.setdefault(trajectory_id, segno)

    def _finished(self, trajectory_id: str, refs: list[Any], segno: int, end: int) -> None:
        self._open_sessions.pop(trajectory_id, None)
        self._traj_ends.append(cursor_key(segno, end))
        self._traj_firsts.append(first_segment(refs, segno))

    def _refers(self, images: list[Any], segno: int) -> None:
        """A record in ``segno`` names these images: compaction keeps them while it is kept (images.py)."""
        for image in images:
            self._image_segs[image.sha256] = segno

    def _index(self, segno: int, end: int, payload: bytes | memoryview) -> None:
        """Track what compaction must keep (open sessions, the latest policy version) and where finished
        trajectories end."""
        try:
            peek = peek_decoder.decode(payload)
        except msgspec.DecodeError:
            # An unknown record kind (newer writer) or a bad record (readers skip it): nothing to track
            return
        if isinstance(peek, PeekStep):
            self._refers(peek.images, segno)
        elif isinstance(peek, PeekOpened):
            self._opened(peek.trajectory_id, segno)
        elif isinstance(peek, PeekTrajectory) and peek.status != "running":
            for step in peek.steps:
                self._refers(step.images, segno)
            self._finished(peek.id, peek.step_refs, segno, end)
        elif isinstance(peek, PeekDropped):
            self._open_sessions.pop(peek.trajectory_id, None)
        elif isinstance(peek, PeekVersion):
            try:
                record = log_decoder.decode(payload)
            except msgspec.DecodeError:
                return  # skipped (and counted) by records(), like any undecodable record
            if isinstance(record, PolicyVersion):  # the peek said so
                self._last_version = (segno, record)

