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
from pathlib import Path
from typing import Any

from steptap.middleware import files
from steptap.middleware.exceptions import LogUnavailable

logger = logging.getLogger("steptap.wal")

PROBE_BYTES = 1 << 20  # while degraded, the log is writable again once this much can be written and synced



class Degraded:
    """Mixin of ``TrajectoryLog``: the degraded state and the probe that ends it."""

    dir: Path
    stats: Any
    probe_interval_s: float
    degraded_reason: str | None
    _probe: asyncio.Task[None] | None
    _closed: bool
    _io: Any
    _writer: Any  # the log's CommitThread (writer.py)

    @property
    def degraded(self) -> bool:
        """True while the log cannot write (its last group commit failed and no probe has succeeded since)."""
        return self.degraded_reason is not None

    def ensure_writable(self) -> None:
        """``LogUnavailable`` while degraded: callers refuse new work instead of doing it and losing it."""
        if self.degraded_reason is not None:
            raise LogUnavailable(
                f"the trajectory log cannot write ({self.degraded_reason}); retry once it has space again",
            )

    def _degrade(self, exc: BaseException) -> None:
        self.stats.write_errors += 1
        if self.degraded_reason is None:
            logger.error("trajectory log %s cannot write (%s): refusing new records until it can", self.dir,
                         exc)
        self.degraded_reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, OSError) else (
            f"{exc.strerror or exc}" + (f" [errno {exc.errno}]" if exc.errno else ""))
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_until_writable(), name="steptap-wal-probe")

    async def _probe_until_writable(self) -> None:
        loop = asyncio.get_running_loop()
        while self.degraded_reason is not None and not self._closed:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await loop.run_in_executor(self._io, self._probe_write)
            except OSError:
                continue
            logger.warning("trajectory log %s can write again: accepting records", self.dir)
            self.degraded_reason = None
            if self._writer is not None:  # it wrote nothing since the failure (writer.py)
                self._writer.resume()

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

