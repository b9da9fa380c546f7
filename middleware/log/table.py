"""The segment table: which segments a log retains and where each one's committed records end.

The writer thread grows and rolls it (``active.py``), readers' threads read it (``reader.py``), uploads and
compaction consult and shrink it: every read and write goes through its lock, so a reader never sees a
segment whose end is not yet committed.
"""

from __future__ import annotations

import threading
from pathlib import Path

from steptap.middleware.log.segments import HEADER


class SegmentTable:
    """The retained segments of the log in ``dir``: the sealed ones and the end of each one's readable frames,
    and the active one with its committed length."""

    def __init__(self, dirpath: Path) -> None:
        self.dir = dirpath
        self._lock = threading.Lock()
        self._active = 0  # the active segment's number (0 until recovery set it)
        self._size = 0  # its committed length
        self._sealed: dict[int, int] = {}  # sealed segno -> end of its readable frames

    # ---- set at open (recovery) ----------------------------------------------------------------------------

    def sealed_at(self, segno: int, end: int) -> None:
        with self._lock:
            self._sealed[segno] = end

    def activate(self, segno: int, size: int) -> None:
        with self._lock:
            self._active, self._size = segno, size

    # ---- the writer ----------------------------------------------------------------------------------------

    def grow(self, nbytes: int) -> None:
        """Committed ``nbytes`` more to the active segment."""
        with self._lock:
            self._size += nbytes

    def roll(self) -> int:
        """Seal the active segment (its next one exists) and make the next active; returns the sealed one."""
        with self._lock:
            old = self._active
            self._sealed[old] = self._size
            self._active, self._size = old + 1, len(HEADER)
        return old

    # ---- compaction ----------------------------------------------------------------------------------------

    def drop(self, segnos: list[int]) -> None:
        with self._lock:
            for segno in segnos:
                self._sealed.pop(segno, None)

    # ---- readers -------------------------------------------------------------------------------------------

    @property
    def active(self) -> tuple[int, int]:
        """(the active segment, its committed length)."""
        with self._lock:
            return self._active, self._size

    def end_of(self, segno: int) -> int:
        """Where ``segno``'s committed records end (0: not retained)."""
        with self._lock:
            return self._size if segno == self._active else self._sealed.get(segno, 0)

    def retained(self) -> list[int]:
        """The retained segments, oldest first; the last is the active one."""
        with self._lock:
            return sorted(self._sealed) + [self._active]

    def sealed(self) -> list[int]:
        with self._lock:
            return sorted(self._sealed)

    def next_after(self, segno: int) -> int | None:
        later = [s for s in self.retained() if s > segno]
        return later[0] if later else None

    def count(self) -> int:
        """How many segments are retained, the active one included."""
        with self._lock:
            return len(self._sealed) + 1

    def disk_bytes(self) -> int:
        """Bytes held by the retained segments."""
        with self._lock:
            return sum(self._sealed.values()) + self._size
