"""What the log tracks about its records, in memory: the sessions still open (the segment of each one's
``SessionOpened``), where each finished trajectory ends and the first segment it refers to, the latest
``PolicyVersion`` record, and the last segment naming each image. Compaction reads it to know what it may
delete; the stream reads a consumer's lag from it.

It is rebuilt at open from a tiny peek of each record (its kind and ids, ``peek_decoder``, never a whole
decode) and kept up to date on each append from the record itself.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Any

import msgspec

from steptap.middleware.log.segments import cursor_key, parse_cursor
from steptap.middleware.records import (
    HeldDropped,
    LogRecord,
    PolicyVersion,
    SessionOpened,
    Step,
    Trajectory,
    log_decoder,
)


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


def first_segment(refs: list[Any], segno: int) -> int:
    """The segment of a finished trajectory's first referenced step (``segno``, its own, when it refers to
    none): compaction keeps it until every consumer has acknowledged the trajectory."""
    return min((parse_cursor(r.at)[0] for r in refs), default=segno)


class LogIndex:
    """The log's records as compaction and the stream's lag need them. Lives on the event loop, except at
    open (recovery fills it in the I/O thread before anyone else holds the log)."""

    def __init__(self) -> None:
        self.open_sessions: dict[str, int] = {}  # trajectory id -> segno of its SessionOpened
        self.last_version: tuple[int, PolicyVersion] | None = None
        self._ends = array("q")  # cursor_key() after each finished trajectory, in log order (stream lag)
        self._firsts = array("q")  # beside it: the segment of its first referenced step (compaction keeps it)
        self._image_segs: dict[str, int] = {}  # sha256 -> the last segment referring to it

    # ---- what a record changes -----------------------------------------------------------------------------

    def appended(self, record: LogRecord, segno: int, offset: int) -> None:
        """A record just committed at (``segno``, ``offset`` after it)."""
        if isinstance(record, Step):
            if record.images:
                self._refers(record.images, segno)
        elif isinstance(record, SessionOpened):
            self.open_sessions.setdefault(record.trajectory_id, segno)
        elif isinstance(record, Trajectory) and record.status != "running":
            for step in record.steps:  # an anonymous call's steps live in its trajectory record
                if step.images:
                    self._refers(step.images, segno)
            self._finished(record.id, record.step_refs, segno, offset)
        elif isinstance(record, HeldDropped):  # a held session (still open for compaction) ended untrained
            self.open_sessions.pop(record.trajectory_id, None)
        elif isinstance(record, PolicyVersion):
            self.last_version = (segno, record)

    def peeked(self, segno: int, end: int, payload: bytes | memoryview) -> None:
        """A record found at open, ending at (``segno``, ``end``): the same as ``appended``, from a peek."""
        try:
            peek = peek_decoder.decode(payload)
        except msgspec.DecodeError:
            # An unknown record kind (newer writer) or a bad record (readers skip it): nothing to track
            return
        if isinstance(peek, PeekStep):
            self._refers(peek.images, segno)
        elif isinstance(peek, PeekOpened):
            self.open_sessions.setdefault(peek.trajectory_id, segno)
        elif isinstance(peek, PeekTrajectory) and peek.status != "running":
            for step in peek.steps:
                self._refers(step.images, segno)
            self._finished(peek.id, peek.step_refs, segno, end)
        elif isinstance(peek, PeekDropped):
            self.open_sessions.pop(peek.trajectory_id, None)
        elif isinstance(peek, PeekVersion):
            try:
                record = log_decoder.decode(payload)
            except msgspec.DecodeError:
                return  # skipped (and counted) by records(), like any undecodable record
            if isinstance(record, PolicyVersion):  # the peek said so
                self.last_version = (segno, record)

    def _finished(self, trajectory_id: str, refs: list[Any], segno: int, end: int) -> None:
        self.open_sessions.pop(trajectory_id, None)
        self._ends.append(cursor_key(segno, end))
        self._firsts.append(first_segment(refs, segno) if refs else segno)

    def _refers(self, images: list[Any], segno: int) -> None:
        """A record in ``segno`` names these images: compaction keeps them while it is kept (images.py)."""
        for image in images:
            self._image_segs[image.sha256] = segno

    # ---- what readers ask -----------------------------------------------------------------------------

    def trajectories_after(self, cursor: str | None) -> int:
        """How many finished trajectories the log holds after ``cursor`` (a consumer's lag)."""
        if cursor is None:
            return len(self._ends)
        return len(self._ends) - bisect.bisect_right(self._ends, cursor_key(*parse_cursor(cursor)))

    def keep_from(self, min_cursor: str) -> int:
        """The oldest segment compaction must keep when every consumer acknowledged ``min_cursor``: not past
        the oldest open session's ``SessionOpened``, nor the first step an unacknowledged finished trajectory
        refers to."""
        cut = parse_cursor(min_cursor)[0]
        if self.open_sessions:
            cut = min(cut, min(self.open_sessions.values()))
        after = bisect.bisect_right(self._ends, cursor_key(*parse_cursor(min_cursor)))
        if after < len(self._firsts):
            cut = min(cut, min(self._firsts[after:]))
        return cut

    def forget_trajectories(self, through: int) -> None:
        """Segments up to ``through`` are gone: so are the finished trajectories in them."""
        gone = bisect.bisect_left(self._ends, cursor_key(through + 1, 0))
        del self._ends[:gone]
        del self._firsts[:gone]

    def forget_images(self, through: int) -> set[str]:
        """The images only records in segments up to ``through`` named are no longer kept for them; returns
        the images still named by a kept record."""
        for sha in [sha for sha, segno in self._image_segs.items() if segno <= through]:
            del self._image_segs[sha]
        return set(self._image_segs)
