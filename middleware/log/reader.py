"""Reading a log: committed frames by position, every record in order (start-up), and finished trajectories
after a cursor, following the log like ``tail -f`` (the stream). Reads run in threads; the segment table
(``table.py``) is shared with the writer under its lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, NamedTuple

import msgspec

from steptap.middleware.delta import resolve
from steptap.middleware.log.index import PeekTrajectory, known_kind, peek_decoder
from steptap.middleware.log.segments import (
    FRAME,
    HEADER,
    format_cursor,
    frame_at,
    parse_cursor,
    scan_frames,
    seg_name,
)
from steptap.middleware.log.stats import LogStats
from steptap.middleware.log.table import SegmentTable
from steptap.middleware.records import LogRecord, Trajectory, log_decoder, step_msgpack_decoder

logger = logging.getLogger("steptap.wal")


class Skipped(NamedTuple):
    """A finished trajectory the reader could not decode, in place of it (the position still moves on)."""

    reason: str


class Found(NamedTuple):
    """A finished trajectory as logged: its record and the Step records it refers to (``step_refs``),
    undecoded."""

    payload: bytes
    steps: list[bytes]


BAD_KEPT = 65_536


class Changes:
    """What followers wait on (``event``): set after the next commit, and when the log closes. Made when a
    follower asks for it: a commit nobody follows (most of them) makes and sets none."""

    def __init__(self, closed: bool = False) -> None:
        self._event: asyncio.Event | None = None
        self.closed = closed  # no commit will come any more (closed, read-only, or its writer died)

    @property
    def event(self) -> asyncio.Event:
        """Set by the next commit (take it before reading: a commit during the read sets it)."""
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def committed(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    def close(self) -> None:
        self.closed = True
        if self._event is not None:
            self._event.set()


class Reader:
    """Everything that reads a log's committed records: the segments in ``table`` (shared with the writer),
    the bad records counted in ``stats``, and, to follow the log, its ``changes``."""

    def __init__(self, table: SegmentTable, stats: LogStats, changes: Changes) -> None:
        self.table = table
        self.dir = table.dir
        self.stats = stats
        self.changes = changes
        self._bad: set[str] = set()  # the cursors of the undecodable records counted so far

    def _read_frames(self, segno: int, offset: int, limit_bytes: int) -> tuple[list[tuple[int, bytes]], int]:
        """Committed frames of ``segno`` from ``offset``: ([(offset after, payload)], new offset). Reads about
        ``limit_bytes``, or exactly one frame when the next is larger (its length is checked against the
        committed end first, so a bad length never becomes a huge read)."""
        end = self.table.end_of(segno)
        if offset >= end:
            return [], offset
        try:
            with open(self.dir / seg_name(segno), "rb") as f:
                f.seek(offset)
                data = f.read(min(end - offset, max(limit_bytes, FRAME.size)))
                frames, _ = scan_frames(data, 0)
                if not frames and len(data) < end - offset:
                    length, _ = FRAME.unpack_from(data, 0)
                    if FRAME.size + length <= end - offset:
                        f.seek(offset)
                        data = f.read(FRAME.size + length)
                        frames, _ = scan_frames(data, 0)
        except FileNotFoundError:
            return [], end  # compacted under us
        if not frames:
            raise ValueError(f"cursor {format_cursor(segno, offset)} does not point at a record")
        return [(offset + e, bytes(data[s:e])) for s, e in frames], offset + frames[-1][1]

    def _start_position(self, cursor: str | None) -> tuple[int, int]:
        segs = self.table.retained()
        if cursor is None:
            return segs[0], len(HEADER)
        segno, offset = parse_cursor(cursor)
        if segno < segs[0]:
            return segs[0], len(HEADER)  # compacted: everything still retained is after it
        if segno > segs[-1] or offset > self.table.end_of(segno) or offset < len(HEADER):
            raise ValueError(f"cursor {cursor!r} is beyond the end of this log")
        return segno, offset

    def check_cursor(self, cursor: str) -> None:
        """``ValueError`` unless ``cursor`` names a record boundary of this log (or a compacted position).
        Reads one frame from disk: call it off the event loop."""
        segno, offset = parse_cursor(cursor)
        segs = self.table.retained()
        if segno < segs[0]:
            return
        end = self.table.end_of(segno)
        if segno not in segs or offset < len(HEADER) or offset > end:
            raise ValueError(f"cursor {cursor!r} is beyond the end of this log")
        if offset == end:
            return
        if not frame_at(self.dir / seg_name(segno), offset, end):
            raise ValueError(f"cursor {cursor!r} does not point at a record of this log")

    def records(self) -> Iterator[LogRecord]:
        """Every retained, committed record in log order, as logged (steps in their delta form: ``delta``).
        A record that does not decode (a writer accepted what the schema rejects) is skipped, counted and
        logged."""
        for _, record in self.located_records():
            yield record

    def located_records(self) -> Iterator[tuple[str, LogRecord]]:
        """``records()`` with the cursor where each starts (for rebuilding open sessions at start-up: a
        finished trajectory refers to its steps by it)."""
        for cursor, payload in self._iter_payloads(None):
            try:
                record = log_decoder.decode(payload)
            except msgspec.DecodeError as exc:  # ValidationError included
                if known_kind(payload):
                    self.undecodable(cursor, exc)
                continue
            segno, after = parse_cursor(cursor)
            yield format_cursor(segno, after - FRAME.size - len(payload)), record

    def _payload_at(self, cursor: str) -> bytes:
        """The record that starts at ``cursor`` (a ``StepRef``); ``ValueError`` when none does any more."""
        segno, offset = parse_cursor(cursor)
        if segno not in self.table.retained():
            raise ValueError(f"no record at {cursor}: its segment was compacted")
        frames, _ = self._read_frames(segno, offset, 1)
        if not frames:
            raise ValueError(f"no record at {cursor}")
        return frames[0][1]

    def trajectory_at(self, cursor: str) -> Trajectory:
        """The finished trajectory whose record starts at ``cursor``, with full steps; ``ValueError`` (or a
        decode error) when none does any more. Reads from disk: call it off the event loop."""
        payload = self._payload_at(cursor)
        peek = peek_decoder.decode(payload)
        if not isinstance(peek, PeekTrajectory):
            raise ValueError(f"no trajectory at {cursor}")
        return resolve_found(Found(payload, [self._payload_at(ref.at) for ref in peek.step_refs]))

    def with_steps(self, traj: Trajectory) -> Trajectory:
        """A trajectory whose steps are refs (a held one's) with its full steps read back. Reads from disk:
        call it off the event loop."""
        steps = [step_msgpack_decoder.decode(self._payload_at(ref.at)) for ref in traj.step_refs]
        return resolve(traj, steps)

    @staticmethod
    def start_of(after: str, payload: bytes) -> str:
        """Where the record ``payload`` that ends at cursor ``after`` starts."""
        segno, end = parse_cursor(after)
        return format_cursor(segno, end - FRAME.size - len(payload))

    def undecodable(self, cursor: str, exc: Exception) -> None:
        """Count and log a record that does not decode (the reader's own, or one a stream met)."""
        # Each bad record counts once, however many readers meet it (the stream, the console, a rebuild);
        # the set is bounded: past it, each reading counts
        if cursor in self._bad:
            return
        if len(self._bad) < BAD_KEPT:
            self._bad.add(cursor)
        self.stats.undecodable_records += 1
        logger.error("trajectory log %s: skipped an undecodable record before cursor %s: %s", self.dir,
                     cursor, exc)

    def _iter_payloads(self, cursor: str | None) -> Iterator[tuple[str, bytes]]:
        segno, offset = self._start_position(cursor)
        while True:
            frames, offset = self._read_frames(segno, offset, 4 << 20)
            for after, payload in frames:
                yield format_cursor(segno, after), payload
            if frames:
                continue
            nxt = self.table.next_after(segno)
            if nxt is None:
                return
            segno, offset = nxt, len(HEADER)

    async def tail(
        self, cursor: str | None = None, *, idle: float | None = None, raw: bool = False
    ) -> AsyncGenerator[tuple[str, Any], None]:
        """Like ``follow``, but yields ``(cursor, None)`` after each ``idle`` seconds without a new
        trajectory (heartbeats for the HTTP stream); ``idle=None`` never does. With ``raw`` it yields each
        trajectory as logged, a ``Found`` of undecoded msgpack (the msgpack stream passes it through), else
        resolved (full steps). A finished trajectory that does not decode, or whose steps are not all there,
        is yielded as a ``Skipped`` (counted in the stats)."""
        loop = asyncio.get_running_loop()
        segno, offset = self._start_position(cursor)
        current = format_cursor(segno, offset)
        while True:
            changed = self.changes.event
            batch, segno, offset = await loop.run_in_executor(None, self._read_trajectories, segno, offset,
                                                              raw)
            for cur, traj in batch:
                current = cur
                if traj is not None:
                    yield cur, traj
            if batch:
                continue
            if self.changes.closed:
                return
            try:
                await asyncio.wait_for(changed.wait(), idle)
            except TimeoutError:
                yield current, None

    def finished_after(self, cursor: str) -> tuple[list[tuple[str, Any]], str]:
        """Thread: the finished trajectories logged after ``cursor`` (at most a few MiB of the log: call again
        from the cursor returned while it moves), each a ``Found`` (raw) or ``Skipped``, with the cursor after
        each; and the cursor to read on from. A compacted cursor reads from the oldest retained record."""
        segno, offset = self._start_position(cursor)
        batch, segno, offset = self._read_trajectories(segno, offset, True)
        return [(cur, found) for cur, found in batch if found is not None], format_cursor(segno, offset)

    def _read_trajectories(self, segno: int, offset: int, raw: bool) -> tuple[list[tuple[str, Any]], int,
                                                                              int]:
        """Thread: the next finished trajectories after (segno, offset); a (cursor, None) entry marks skipped
        records so the position still advances."""
        while True:
            frames, new_offset = self._read_frames(segno, offset, 4 << 20)
            if frames:
                out: list[tuple[str, Any]] = []
                for after, payload in frames:
                    cursor = format_cursor(segno, after)
                    try:
                        peek = peek_decoder.decode(payload)
                    except msgspec.DecodeError as exc:
                        if known_kind(payload) == "trajectory":
                            self.undecodable(cursor, exc)
                            out.append((cursor, Skipped(str(exc))))
                        continue  # another kind, or one this version does not know
                    if not (isinstance(peek, PeekTrajectory) and peek.status != "running"):
                        continue
                    try:
                        found = Found(payload, [self._payload_at(ref.at) for ref in peek.step_refs])
                        out.append((cursor, found if raw else resolve_found(found)))
                    # DeltaError and ValidationError included
                    except (ValueError, msgspec.DecodeError) as exc:
                        self.undecodable(cursor, exc)
                        out.append((cursor, Skipped(str(exc))))
                if not out:
                    out.append((format_cursor(segno, new_offset), None))
                return out, segno, new_offset
            nxt = self.table.next_after(segno)
            if nxt is None:
                return [], segno, offset
            segno, offset = nxt, len(HEADER)

    async def follow(
        self, cursor: str | None = None, *, until_idle: float | None = None
    ) -> AsyncIterator[tuple[str, Trajectory]]:
        """Finished trajectories after ``cursor`` (``None``: from the oldest retained), in log order, with the
        cursor after each, waiting for new ones like ``tail -f``. ``until_idle``: stop after that many seconds
        without a new one (0: stop at the current end). Undecodable ones are skipped (and counted)."""
        agen = self.tail(cursor, idle=until_idle)
        try:
            async for cur, traj in agen:
                if traj is None:
                    return
                if isinstance(traj, Skipped):
                    continue
                yield cur, traj
        finally:
            await agen.aclose()

    @property
    def end_cursor(self) -> str:
        """The cursor after the last committed record."""
        return format_cursor(*self.table.active)


def resolve_found(found: Found) -> Trajectory:
    """A logged trajectory and its steps -> the trajectory with full steps (``DecodeError``,
    ``DeltaError``)."""

    traj = log_decoder.decode(found.payload)
    if not isinstance(traj, Trajectory):
        raise msgspec.ValidationError("not a trajectory record")
    steps = [step_msgpack_decoder.decode(p) for p in found.steps]
    return resolve(traj, steps)
