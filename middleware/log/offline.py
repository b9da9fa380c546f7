"""Read a trajectory log without a running proxy: the finished trajectories of a log directory or fsspec URL.

    reader = LogReader("/var/lib/steptap/log")          # or "s3://bucket/steptap-log", "file:///..."
    for traj in reader.trajectories():
        ...
    print(reader.stats)                                 # records, trajectories, undecodable, corrupt_bytes
    notes = reader.annotations()                        # late rewards and curation marks, by trajectory

Read-only: no lock is taken, nothing is repaired or written, so it is safe beside a live writer (it sees what
was committed when each segment is read; a torn or still-being-written tail is simply where reading stops).
For a remote URL only the sealed segments uploaded so far are there: the active segment lives in the writer's
local write-ahead log.

Records this version cannot decode (a newer kind, damage that still passes the checksum) are skipped and
counted, never raised; a bad frame ends the reading of its segment and its bytes are counted. A trajectory
that refers to its logged steps (schema 4) is handed out with them, in full form; one whose steps are gone
(compacted) or damaged is counted as undecodable. A trajectory
written twice (a proxy restart can re-finalize one) is yielded once, the first time (ids remembered in a
bounded set).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from steptap.middleware.curation import MAX_MARKS_PER_TRAJECTORY
from steptap.middleware.delta import resolve
from steptap.middleware.log.images import IMAGES_DIR
from steptap.middleware.log.segments import (
    FRAME,
    HEADER,
    SEG_RE,
    CorruptLogError,
    parse_cursor,
    scan_frames,
    seg_name,
)
from steptap.middleware.records import (
    Curation,
    RewardAdded,
    Trajectory,
    is_digest,
    log_decoder,
    step_msgpack_decoder,
)

MAX_REMEMBERED_IDS = 1_000_000  # de-duplication memory: about 100 MB at most


class ReaderStats(msgspec.Struct, kw_only=True):
    segments: int = 0
    records: int = 0  # frames read intact
    trajectories: int = 0  # finished trajectories yielded
    duplicates: int = 0  # finished trajectories seen again and skipped
    undecodable: int = 0  # intact frames this version could not decode (skipped)
    corrupt_bytes: int = 0  # bytes after a bad frame inside a segment (skipped)


class Annotations(msgspec.Struct, kw_only=True):
    """``LogReader.annotations``: late rewards and curation marks by trajectory id, in log order."""

    late: dict[str, list[RewardAdded]] = {}
    marks: dict[str, list[Curation]] = {}
    marks_over: int = 0  # marks past MAX_MARKS_PER_TRAJECTORY for their trajectory (not held)


class LogReader:
    """Iterate the finished trajectories (status other than ``running``) of a log, in log order."""

    def __init__(self, location: str, *, storage_options: dict[str, Any] | None = None) -> None:
        self.location = location
        self.stats = ReaderStats()
        self._storage_options = storage_options or {}

    # ---- where the segments are ---------------------------------------------------------------------------

    def _segments(self) -> tuple[list[int], Any]:
        """(segment numbers ascending, a function reading one segment's bytes)."""
        loc = self.location
        if "://" not in loc or loc.startswith("file://"):
            root = Path(loc.removeprefix("file://"))
            if not root.is_dir():
                raise FileNotFoundError(f"no trajectory log at {root}")
            names = [p.name for p in root.iterdir()]
            return _segnos(names), lambda segno: (root / seg_name(segno)).read_bytes()
        import fsspec  # only remote logs need it

        fs, path = fsspec.core.url_to_fs(loc, **self._storage_options)
        path = path.rstrip("/")
        try:
            names = [p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
        except FileNotFoundError:
            raise FileNotFoundError(f"no trajectory log at {loc}") from None

        def read(segno: int) -> bytes:
            with fs.open(f"{path}/{seg_name(segno)}", "rb") as f:
                data: bytes = f.read()  # fsspec is untyped: a file opened "rb" reads bytes
                return data

        return _segnos(names), read

    def image(self, sha256: str) -> bytes | None:
        """The bytes of an image a step names (``Step.images``), from the log's image store (log/images.py);
        None when the log does not hold it (compacted, or never stored). The learner's ``resolve``."""
        if not is_digest(sha256):
            return None
        loc = self.location
        if "://" not in loc or loc.startswith("file://"):
            try:
                return (Path(loc.removeprefix("file://")) / IMAGES_DIR / sha256).read_bytes()
            except FileNotFoundError:
                return None
        import fsspec

        fs, path = fsspec.core.url_to_fs(loc, **self._storage_options)
        try:
            return bytes(fs.cat_file(f"{path.rstrip('/')}/{IMAGES_DIR}/{sha256}"))
        except FileNotFoundError:
            return None

    # ---- reading ------------------------------------------------------------------------------------------

    def trajectories(self, *, mode: str | None = None) -> Iterator[Trajectory]:
        """Finished trajectories (``mode``: only ``train`` or only ``eval`` ones)."""
        seen: OrderedDict[str, None] = OrderedDict()
        segnos, read = self._segments()
        steps = _Frames(read)
        for record in self._records(segnos, read, steps):
            if not isinstance(record, Trajectory) or record.status == "running":
                continue
            if mode is not None and record.mode != mode:
                continue
            if record.id in seen:
                self.stats.duplicates += 1
                continue
            try:
                record = resolve(record, [step_msgpack_decoder.decode(steps.payload(r.at))
                                          for r in record.step_refs])
            # A step missing (compacted) or damaged: DeltaError too
            except (ValueError, msgspec.DecodeError):
                self.stats.undecodable += 1
                continue
            seen[record.id] = None
            if len(seen) > MAX_REMEMBERED_IDS:
                seen.popitem(last=False)
            self.stats.trajectories += 1
            yield record

    def records(self) -> Iterator[Any]:
        """Every decodable record, in log order, as logged (steps in their delta form, trajectories with
        their step refs): what ``steptap doctor`` counts."""
        segnos, read = self._segments()
        yield from self._records(segnos, read, _Frames(read), count=False)

    def annotations(self) -> Annotations:
        """What was said of trajectories besides their own record, in one pass of the log: rewards given
        after the trajectory went to the stream (``late``: recorded for the dataset, never trained,
        sessions/holding.py) and curation marks (middleware/curation.py), by trajectory id, in log order.
        A trajectory's marks past ``MAX_MARKS_PER_TRAJECTORY`` (the proxy refuses more) are counted in
        ``marks_over``, not held."""
        out = Annotations()
        segnos, read = self._segments()
        for record in self._records(segnos, read, _Frames(read), count=False):
            if isinstance(record, RewardAdded) and record.late:
                out.late.setdefault(record.trajectory_id, []).append(record)
            elif isinstance(record, Curation):
                marks = out.marks.setdefault(record.trajectory_id, [])
                if len(marks) < MAX_MARKS_PER_TRAJECTORY:
                    marks.append(record)
                else:
                    out.marks_over += 1
        return out

    def _records(self, segnos: list[int], read: Any, steps: _Frames, count: bool = True) -> Iterator[Any]:
        """Every decodable record of the segments, in log order (``count``: into ``stats``)."""
        for segno in segnos:
            try:
                data = read(segno)
            except FileNotFoundError:
                continue  # compacted between listing and reading
            steps.current(segno, data)
            if data[: len(HEADER)] != HEADER:
                if len(data) < len(HEADER) and HEADER.startswith(data):
                    continue  # a segment being created right now
                raise CorruptLogError(
                    f"segment {seg_name(segno)} of {self.location} is not a steptap log segment"
                )
            frames, good_end = scan_frames(data, len(HEADER))
            if count:
                self.stats.segments += 1
                self.stats.corrupt_bytes += len(data) - good_end if segno != segnos[-1] else 0
            for start, end in frames:
                self.stats.records += count
                try:
                    yield log_decoder.decode(data[start:end])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.stats.undecodable += count


class _Frames:
    """The records finished trajectories refer to (``StepRef.at``): in the segment being read, or in an
    earlier one (read again, and kept while the next references need it; at most two segments held)."""

    def __init__(self, read: Any) -> None:
        self._read = read
        self._held: dict[int, bytes] = {}

    def current(self, segno: int, data: bytes) -> None:
        # An earlier one, most likely reused
        self._held = {s: d for s, d in self._held.items() if s == segno - 1}
        self._held[segno] = data

    def payload(self, cursor: str) -> bytes:
        segno, offset = parse_cursor(cursor)
        data = self._held.get(segno)
        if data is None:
            try:
                data = self._read(segno)
            except FileNotFoundError:
                raise ValueError(f"no record at {cursor}: its segment is gone") from None
            if len(self._held) >= 2:
                del self._held[min(self._held)]
            self._held[segno] = data
        frames, _ = scan_frames(data[: offset + FRAME.size + _length_at(data, offset)], offset)
        if not frames:
            raise ValueError(f"no record at {cursor}")
        start, end = frames[0]
        return data[start:end]


def _length_at(data: bytes, offset: int) -> int:
    if offset + FRAME.size > len(data):
        return 0
    return int(FRAME.unpack_from(data, offset)[0])


def _segnos(names: list[str]) -> list[int]:
    return sorted(int(m.group(1)) for n in names if (m := SEG_RE.match(n)))


def read_trajectories(location: str, *, mode: str | None = None) -> Iterator[Trajectory]:
    """Shortcut: the finished trajectories of the log at ``location``."""
    return LogReader(location).trajectories(mode=mode)


__all__ = ["Annotations", "LogReader", "ReaderStats", "read_trajectories"]
