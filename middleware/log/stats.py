"""What the trajectory log counts (``TrajectoryLog.stats``: ``/metrics``, ``/health`` and the tests read it).
Each part of the log adds to its own fields."""

from __future__ import annotations

import msgspec


class LogStats(msgspec.Struct, kw_only=True):
    records: int = 0  # records appended since open
    bytes: int = 0  # bytes appended since open
    commits: int = 0  # fdatasync calls (one per group commit, plus segment seals)
    torn_records: int = 0  # torn tails truncated at open
    torn_bytes: int = 0
    corrupt_records: int = 0  # bad frames inside sealed segments (the rest of each is skipped)
    last_batch_records: int = 0
    last_sync_s: float = 0.0  # how long the latest group's write and sync took (durability fsync)
    segments: int = 0  # retained local segments
    uploads: int = 0  # sealed segments uploaded to the remote URL
    active_uploads: int = 0  # uploads of the active segment's committed part (timer)
    # Records that did not decode, skipped by a reader (each time one reads them)
    undecodable_records: int = 0
    write_errors: int = 0  # failed group commits (disk full, I/O error)
