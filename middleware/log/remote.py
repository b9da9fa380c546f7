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
from typing import TYPE_CHECKING

from steptap.middleware.files import atomic_write
from steptap.middleware.log.segments import HEADER, SEG_RE, seg_name

if TYPE_CHECKING:
    import threading
    from pathlib import Path
    from typing import Any

    from steptap.middleware.log.wal import LogStats


logger = logging.getLogger("steptap.wal")


class Remote:
    """Mixin of ``TrajectoryLog``: uploads of sealed segments and the restore of an empty local directory."""

    # What TrajectoryLog (wal.py) provides, declared for the type checker (annotations only: no values).
    _fs: Any
    _lock: threading.Lock
    _remote_root: str | None
    _segno: int
    _size: int
    _upload_failed: set[int]
    _upload_lock: threading.Lock
    _uploading: set[int]
    _uploads: set[asyncio.Task[None]]
    dir: Path
    stats: LogStats
    _active_uploader: asyncio.Task[None] | None

    def _schedule_upload(self, segno: int, *, only_if_missing: bool = False) -> None:
        if self._fs is None or segno in self._uploading:
            return
        self._uploading.add(segno)
        task = asyncio.create_task(asyncio.to_thread(self._upload, segno, only_if_missing))
        self._uploads.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._uploads.discard(t)
            self._uploading.discard(segno)

        task.add_done_callback(done)

    def _start_active_uploads(self, interval_s: float) -> None:
        self._active_uploader = asyncio.create_task(
            self._upload_active_forever(interval_s), name="steptap-wal-active-upload"
        )

    async def _upload_active_forever(self, interval_s: float) -> None:
        uploaded = (0, 0)
        while True:
            await asyncio.sleep(interval_s)
            with self._lock:
                now = (self._segno, self._size)
            if now == uploaded or now[1] <= len(HEADER):
                continue
            try:
                await asyncio.to_thread(self._upload_active, *now)
                uploaded = now
            except Exception:  # noqa: BLE001 - retried at the next tick; the local copy is intact
                logger.exception("uploading the active segment of %s failed", self.dir)

    def _upload_active(self, segno: int, size: int) -> None:
        with self._upload_lock:
            if segno != self._segno:
                return  # sealed meanwhile: its full upload covers it
            with open(self.dir / seg_name(segno), "rb") as f:
                data = f.read(size)  # the committed part only, never a half-written group
            self._fs.makedirs(self._remote_root, exist_ok=True)
            self._fs.pipe_file(f"{self._remote_root}/{seg_name(segno)}", data)
            self.stats.active_uploads += 1

    def _upload(self, segno: int, only_if_missing: bool) -> None:
        with self._upload_lock:
            self._upload_sealed(segno, only_if_missing)

    def _upload_sealed(self, segno: int, only_if_missing: bool) -> None:
        local = self.dir / seg_name(segno)
        remote = f"{self._remote_root}/{seg_name(segno)}"
        try:
            if only_if_missing and self._fs.exists(remote) and self._fs.size(remote) == local.stat().st_size:
                return
            self._fs.makedirs(self._remote_root, exist_ok=True)
            self._fs.put_file(str(local), remote)
            self.stats.uploads += 1
            self._upload_failed.discard(segno)
        except FileNotFoundError:
            pass  # compacted before it was uploaded
        except Exception:  # noqa: BLE001 - retried at the next seal and the next open; the local copy stays
            self._upload_failed.add(segno)
            logger.exception("uploading %s to %s failed", local, remote)

    def _download_remote(self) -> list[int]:
        try:
            names = [p.rsplit("/", 1)[-1] for p in self._fs.ls(self._remote_root, detail=False)]
        except FileNotFoundError:
            return []
        segnos = sorted(int(m.group(1)) for n in names if (m := SEG_RE.match(n)))
        for segno in segnos:  # each whole under its name, 0600 and synced (it may be the only local copy)
            atomic_write(self.dir / seg_name(segno),
                         self._fs.cat_file(f"{self._remote_root}/{seg_name(segno)}"))
        if segnos:
            logger.info("restored %d segment(s) of %s from the remote copy", len(segnos), self._remote_root)
        return segnos

