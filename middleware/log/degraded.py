"""When the disk cannot write (full, I/O error): the log reports **degraded** and refuses new records until a
probe write succeeds, then goes back to normal by itself.

A failed group commit leaves what was committed before it and nothing else (the writer cuts back to the
committed end). The appends that failed, and every append while degraded, raise ``LogUnavailable`` (an HTTP
503): callers refuse new work instead of doing it and losing its record. A probe writes and syncs
``PROBE_BYTES`` beside the segments every ``probe_interval_s``; once one succeeds, the log takes records
again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from steptap.middleware import files
from steptap.middleware.exceptions import LogUnavailable
from steptap.middleware.log.stats import LogStats

logger = logging.getLogger("steptap.wal")

PROBE_BYTES = 1 << 20  # while degraded, the log is writable again once this much can be written and synced


class DegradedMode:
    """Whether the log in ``dir`` can write. ``writable_again`` runs once a probe write succeeded (the log's
    writer takes groups again); probes run in ``io`` every ``interval_s`` until then or ``closed()``."""

    def __init__(self, dirpath: Path, stats: LogStats, io: Executor, *, interval_s: float,
                 writable_again: Callable[[], None], closed: Callable[[], bool]) -> None:
        self.dir = dirpath
        self.stats = stats
        self.io = io
        self.interval_s = interval_s
        self.reason: str | None = None  # why the log cannot write, while it cannot
        self._writable_again = writable_again
        self._closed = closed
        self._probe: asyncio.Task[None] | None = None

    def ensure_writable(self) -> None:
        """``LogUnavailable`` while degraded: callers refuse new work instead of doing it and losing it."""
        if self.reason is not None:
            raise LogUnavailable(
                f"the trajectory log cannot write ({self.reason}); retry once it has space again",
            )

    def degrade(self, exc: BaseException) -> None:
        """A write failed: refuse records from now on, and probe until the disk takes writes again."""
        self.stats.write_errors += 1
        if self.reason is None:
            logger.error("trajectory log %s cannot write (%s): refusing new records until it can", self.dir,
                         exc)
        self.reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, OSError) else (
            f"{exc.strerror or exc}" + (f" [errno {exc.errno}]" if exc.errno else ""))
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_until_writable(), name="steptap-wal-probe")

    def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()

    async def _probe_until_writable(self) -> None:
        loop = asyncio.get_running_loop()
        while self.reason is not None and not self._closed():
            await asyncio.sleep(self.interval_s)
            try:
                await loop.run_in_executor(self.io, self._probe_write)
            except OSError:
                continue
            logger.warning("trajectory log %s can write again: accepting records", self.dir)
            self.reason = None
            self._writable_again()

    def _probe_write(self) -> None:
        """I/O thread: write and sync ``PROBE_BYTES`` beside the segments, then remove them."""
        path = self.dir / ".write-probe"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, files.FILE_MODE)
            try:
                files.write_all(fd, bytes(PROBE_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            path.unlink(missing_ok=True)
