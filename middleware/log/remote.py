"""Remote logs: for an fsspec URL (``s3://``, ``gs://``, ``memory://``) the write-ahead log stays in a local
directory and each sealed segment is uploaded under the URL with the same name. A fresh local directory is
first filled from the remote copy.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from steptap.middleware.log.segments import SEG_RE, seg_name

logger = logging.getLogger("steptap.wal")


class Remote:
    """Mixin of ``TrajectoryLog``: uploads of sealed segments and the restore of an empty local directory."""

    def _schedule_upload(self, segno: int, *, only_if_missing: bool = False) -> None:
        if self._fs is None or segno in self._uploading:
            return
        self._uploading.add(segno)
        task = asyncio.create_task(asyncio.to_thread(self._upload, segno, only_if_missing))
        self._uploads.add(task)
        task.add_done_callback(lambda t: (self._uploads.discard(t), self._uploading.discard(segno)))

    def _upload(self, segno: int, only_if_missing: bool) -> None:
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
        for segno in segnos:
            self._fs.get_file(f"{self._remote_root}/{seg_name(segno)}", str(self.dir / seg_name(segno)))
        if segnos:
            logger.info("restored %d segment(s) of %s from the remote copy", len(segnos), self._remote_root)
        return segnos

