"""Remote logs: for an fsspec URL (``s3://``, ``gs://``, ``memory://``) the write-ahead log stays in a local
directory and each sealed segment is uploaded under the URL with the same name. A fresh local directory is
first filled from the remote copy.

The active segment's committed part is also uploaded every ``upload_interval_s`` (when it grew), so losing the
local disk loses at most that interval of records (plus what is not yet sealed if the interval is off). All
uploads of one log run one at a time, so a late upload of the active part can never overwrite the sealed
segment's full upload.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from steptap.middleware.files import atomic_write
from steptap.middleware.log.segments import HEADER, SEG_RE, seg_name
from steptap.middleware.log.stats import LogStats
from steptap.middleware.log.table import SegmentTable

logger = logging.getLogger("steptap.wal")


class Uploader:
    """The remote copy of one log: ``fs`` (an fsspec filesystem) under ``root``, uploads of the segments in
    ``table`` (one at a time), counted in ``stats``."""

    def __init__(self, fs: Any, root: str, table: SegmentTable, stats: LogStats) -> None:
        self.fs = fs
        self.root = root
        self.table = table
        self.dir = table.dir
        self.stats = stats
        self.failed: set[int] = set()  # sealed segments whose upload failed (retried; compaction keeps them)
        self._uploading: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = threading.Lock()  # one upload at a time
        self._active_uploader: asyncio.Task[None] | None = None

    def schedule(self, segno: int, *, only_if_missing: bool = False) -> None:
        """Upload sealed segment ``segno`` in a thread (once at a time per segment)."""
        if segno in self._uploading:
            return
        self._uploading.add(segno)
        task = asyncio.create_task(asyncio.to_thread(self._upload, segno, only_if_missing))
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self._uploading.discard(segno)

        task.add_done_callback(done)

    def sealed(self, segnos: list[int]) -> None:
        """After a commit: upload the segments it sealed, and try the failed ones again."""
        for segno in segnos + sorted(self.failed):
            self.schedule(segno)

    async def wait(self) -> None:
        """Until every upload started so far has ended (compaction never deletes before)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def start_active_uploads(self, interval_s: float) -> None:
        self._active_uploader = asyncio.create_task(
            self._upload_active_forever(interval_s), name="steptap-wal-active-upload"
        )

    def stop_active_uploads(self) -> None:
        if self._active_uploader is not None:
            self._active_uploader.cancel()

    async def _upload_active_forever(self, interval_s: float) -> None:
        uploaded = (0, 0)
        while True:
            await asyncio.sleep(interval_s)
            now = self.table.active
            if now == uploaded or now[1] <= len(HEADER):
                continue
            try:
                await asyncio.to_thread(self._upload_active, *now)
                uploaded = now
            except Exception:  # noqa: BLE001 - retried at the next tick; the local copy is intact
                logger.exception("uploading the active segment of %s failed", self.dir)

    def _upload_active(self, segno: int, size: int) -> None:
        with self._lock:
            if segno != self.table.active[0]:
                return  # sealed meanwhile: its full upload covers it
            with open(self.dir / seg_name(segno), "rb") as f:
                data = f.read(size)  # the committed part only, never a half-written group
            self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(f"{self.root}/{seg_name(segno)}", data)
            self.stats.active_uploads += 1

    def _upload(self, segno: int, only_if_missing: bool) -> None:
        with self._lock:
            self._upload_sealed(segno, only_if_missing)

    def _upload_sealed(self, segno: int, only_if_missing: bool) -> None:
        local = self.dir / seg_name(segno)
        remote = f"{self.root}/{seg_name(segno)}"
        try:
            if only_if_missing and self.fs.exists(remote) and self.fs.size(remote) == local.stat().st_size:
                return
            self.fs.makedirs(self.root, exist_ok=True)
            self.fs.put_file(str(local), remote)
            self.stats.uploads += 1
            self.failed.discard(segno)
        except FileNotFoundError:
            pass  # compacted before it was uploaded
        except Exception:  # noqa: BLE001 - retried at the next seal and the next open; the local copy stays
            self.failed.add(segno)
            logger.exception("uploading %s to %s failed", local, remote)

    def delete(self, segno: int) -> None:
        """Thread: remove a compacted segment's remote copy."""
        try:
            self.fs.rm_file(f"{self.root}/{seg_name(segno)}")
        except FileNotFoundError:
            pass
        except Exception:  # noqa: BLE001
            logger.exception("deleting remote segment %d failed", segno)

    def download(self) -> list[int]:
        """Thread, at open: fill the empty local directory with the remote copy; returns the segments."""
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        segnos = sorted(int(m.group(1)) for n in names if (m := SEG_RE.match(n)))
        for segno in segnos:  # each whole under its name, 0600 and synced (it may be the only local copy)
            atomic_write(self.dir / seg_name(segno), self.fs.cat_file(f"{self.root}/{seg_name(segno)}"))
        if segnos:
            logger.info("restored %d segment(s) of %s from the remote copy", len(segnos), self.root)
        return segnos
