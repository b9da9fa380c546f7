"""The trajectory log's writer thread: group commit with a direct hand-off to the event loop.

``append`` puts ``(frame, record, future)`` on a thread-safe queue and awaits its future. The thread takes the
first item and everything queued behind it (up to ``max_batch_bytes``), writes and syncs them as one group,
and hands the group back to the loop with **one** ``call_soon_threadsafe``; the loop then resolves every
future of the group in that one callback. Per group that is one wake-up of the thread and one of the loop: no
writer task to schedule, no executor future, no hop per record. Records that arrive while a group is being
synced wait for the next group and share its sync.

A lone call's record can skip the thread (``write_now``): written, synced and resolved on the loop, while the
thread is idle. What such a call waits for is then its sync alone, not the sync and two wake-ups (the
thread's, then the loop's): about 80 us of a call's 0.4 ms commit on this project's machines. The log decides
when (the one model call in flight, a quick disk: ``ActiveSegment.inline``); the loop is blocked for that
sync, with nothing else to do.

After a group fails (disk full, I/O error) the thread writes nothing more until ``resume`` (the log can write
again): what was queued behind the failure fails with it (``NotWritten``), so the log never holds a record
appended after one it lost. A step logged after a lost step of its session would leave a hole in the session's
indexes, or a delta whose base is not there.

The thread owns the write path of the segment files; other threads that touch the active segment (the timed
sync of durability ``os``) take ``fd_lock``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

# (frame bytes, the record, the future its append awaits: the cursors where the record starts and ends)
Item = tuple[bytes, Any, "asyncio.Future[tuple[str, str]]"]
# what the write function returns: the position after each committed frame, segments sealed, the error if any
Written = tuple[list[tuple[int, int]], list[int], BaseException | None]


class NotWritten(Exception):
    """A group not written because an earlier one failed and the log has not taken writes again since."""


class CommitThread:
    """One dedicated thread that writes queued frames in groups. ``committed(batch, written)`` runs
    on the event loop once per group; ``died(exc, unresolved)`` once if the thread itself fails (a bug)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        write: Callable[[list[bytes]], Written],
        committed: Callable[[list[Item], Written], None],
        died: Callable[[BaseException, list[Item]], None],
        max_batch_bytes: int,
    ) -> None:
        self._loop = loop
        self._write = write
        self._committed = committed
        self._died = died
        self._max_batch_bytes = max_batch_bytes
        # Unbounded by itself, bounded by its callers: each item is an append awaited by one admitted call.
        self._queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self.stopped: asyncio.Future[None] = loop.create_future()  # resolved after the last group's callback
        self._thread = threading.Thread(target=self._run, name="steptap-wal-writer", daemon=True)
        self._failed = False  # a group failed: fail the rest until ``resume`` (a bool: set and read whole)
        self._queued = 0  # items put and not yet handed back (the loop's count: read and set there only)

    def resume(self) -> None:
        """The log takes writes again (a probe write succeeded): groups queued from now on are written."""
        self._failed = False

    def start(self) -> None:
        self._thread.start()

    def put(self, item: Item) -> None:
        self._queued += 1
        self._queue.put(item)

    def write_now(self, item: Item) -> None:
        """On the loop: ``item`` written and synced here, alone, and resolved (``committed``) before this
        returns; put for the thread instead while it has a group queued or in hand (the file's order) or a
        group failed since ``resume``."""
        if self._queued or self._failed:
            self.put(item)
            return
        self._committed([item], self._written([item[0]]))

    def stop(self) -> None:
        """Write what is queued, then end (``stopped`` resolves)."""
        self._queue.put(None)

    def pending(self) -> list[Item]:
        """Take what is still queued (after the thread died)."""
        items: list[Item] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return items
            if item is not None:
                items.append(item)

    # ---- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        batch: list[Item] = []
        try:
            stop = False
            while not stop:
                batch = []
                first = self._queue.get()
                if first is None:
                    break
                batch.append(first)
                size = len(first[0])
                while size < self._max_batch_bytes:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        stop = True
                        break
                    batch.append(nxt)
                    size += len(nxt[0])
                written: Written = (([], [], NotWritten("an earlier group of the log failed")) if self._failed
                                    else self._written([item[0] for item in batch]))
                self._call(self._handed_back, batch, written)
            self._call(_resolve, self.stopped)
        except BaseException as exc:  # noqa: BLE001 - report it on the loop: nothing may wait forever
            self._call(self._died, exc, batch)
            self._call(_resolve, self.stopped)

    def _written(self, frames: list[bytes]) -> Written:
        """``frames`` written as one group (in the thread, or on the loop for ``write_now``); a failed group
        stops the writes until ``resume``."""
        try:
            written = self._write(frames)
        except Exception as exc:  # noqa: BLE001 - a bug, not the disk: fail this group
            written = ([], [], exc)
        self._failed = written[2] is not None
        return written

    def _handed_back(self, batch: list[Item], written: Written) -> None:
        """On the loop: a group from the thread."""
        self._queued -= len(batch)
        self._committed(batch, written)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: no one is left to wake
            pass


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
