"""The image store: the bytes of each image a step's prompt showed the model, stored once by content beside
the log (``<log dir>/images/<sha256 hex>``), 0600. A step names its images (``Step.images``) and its logged
request refers to them (``records.ref_of``) instead of holding the base64 again, so a screenshot replayed
every turn costs one copy.

An image is written (atomic, synced under ``fsync`` durability: files.py) before the step that refers to it is
appended; under ``os`` durability it is written unsynced, as the log's own groups are. Writes run off the
event loop. Compaction (compaction.py) removes the images no kept record refers to, never one a call in flight
holds (``hold``). A remote log (remote.py) gets each image uploaded under ``<url>/images/`` when it is
written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from steptap.middleware import files
from steptap.middleware.exceptions import LogUnavailable
from steptap.middleware.records import is_digest

logger = logging.getLogger("steptap.wal")

IMAGES_DIR = "images"


class ImageStore:
    """The images of one log directory (and of its remote copy, when it has one)."""

    def __init__(self, log_dir: Path, *, durable: bool = True, fs: Any = None,
                 remote_root: str | None = None, readonly: bool = False) -> None:
        self.dir = log_dir / IMAGES_DIR
        self.durable = durable
        self._fs = fs
        self._remote = f"{remote_root}/{IMAGES_DIR}" if remote_root is not None else None
        self._lock = threading.Lock()
        self._known: set[str] = set()  # on disk here
        self._held: Counter[str] = Counter()  # digests of calls in flight: compaction keeps them
        if not readonly and self.dir.is_dir():
            self._known = {p.name for p in self.dir.iterdir() if is_digest(p.name)}

    def path(self, sha256: str) -> Path:
        if not is_digest(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256[:80]!r}")
        return self.dir / sha256

    async def put(self, images: Iterable[tuple[str, bytes]]) -> None:
        """Store each (digest, bytes) not stored yet; durable (under ``fsync``) when it returns."""
        with self._lock:
            new = {sha: data for sha, data in images if sha not in self._known}
        if new:
            try:
                await asyncio.to_thread(self._write, new)
            except OSError as exc:  # disk full, I/O error: a call it cannot record is not made (503)
                raise LogUnavailable(f"the image store could not write: {exc}") from exc

    def _write(self, new: dict[str, bytes]) -> None:
        files.private_dir(self.dir)
        for sha, data in new.items():
            files.atomic_write(self.path(sha), data, durable=self.durable)
            if self._fs is not None:  # the remote copy: readers of the URL resolve it there
                try:
                    self._fs.makedirs(self._remote, exist_ok=True)
                    self._fs.pipe_file(f"{self._remote}/{sha}", data)
                except Exception:  # noqa: BLE001 - the local copy stands; uploaded again at the next write
                    logger.exception("uploading image %s to %s failed", sha, self._remote)
                    continue
            with self._lock:
                self._known.add(sha)

    def get(self, sha256: str) -> bytes | None:
        """The bytes of an image, from here or the remote copy; None when neither has it."""
        try:
            return self.path(sha256).read_bytes()
        except (FileNotFoundError, ValueError):
            pass
        if self._fs is not None and is_digest(sha256):
            try:
                return bytes(self._fs.cat_file(f"{self._remote}/{sha256}"))
            except FileNotFoundError:
                return None
        return None

    @contextlib.contextmanager
    def hold(self, digests: Iterable[str]) -> Iterator[None]:
        """Keep these images from compaction while a call that will refer to them is in flight."""
        held = list(digests)
        with self._lock:
            self._held.update(held)
        try:
            yield
        finally:
            with self._lock:
                self._held.subtract(held)
                for sha in held:
                    if self._held[sha] <= 0:
                        del self._held[sha]

    def sweep(self, referenced: set[str]) -> list[str]:
        """Delete the images no kept record refers to and no call in flight holds (compaction; a thread)."""
        with self._lock:
            victims = [sha for sha in self._known if sha not in referenced and sha not in self._held]
            self._known.difference_update(victims)
        for sha in victims:
            self.path(sha).unlink(missing_ok=True)
            if self._fs is not None:
                with contextlib.suppress(FileNotFoundError):
                    self._fs.rm_file(f"{self._remote}/{sha}")
        if victims:
            files.fsync_path(self.dir)
        return victims

    def __len__(self) -> int:
        return len(self._known)

