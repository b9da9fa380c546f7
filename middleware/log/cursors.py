"""Consumers' acknowledged cursors: one small JSON file per consumer under ``<log dir>/consumers``.

An acknowledged cursor only moves forward and is durable when ``ack`` returns (written with
``files.atomic_write``: a crash leaves the old cursor or the new one, never half of one). The least cursor
over all consumers bounds compaction, so an abandoned consumer holds every later segment on disk until an
operator removes it (``remove``, ``DELETE /trajectories/consumers/NAME``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

from steptap.middleware import files
from steptap.middleware.wire import parse_cursor

logger = logging.getLogger("steptap.cursors")

CONSUMER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # \Z: "$" would accept a trailing newline
MAX_CONSUMERS = 1024  # each holds compaction back: a bound, not a working limit


class TooManyConsumers(Exception):
    pass


class ConsumerCursors:
    """Acknowledged cursors by consumer name, cached in memory after the first read."""

    def __init__(self, dirpath: Path, max_consumers: int = MAX_CONSUMERS) -> None:
        self.dir = dirpath
        self.max_consumers = max_consumers
        self._cache: dict[str, str] | None = None
        self._lock = asyncio.Lock()

    def _load(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.dir.is_dir():
            for p in self.dir.glob("*.cursor"):
                try:
                    cursor = json.loads(p.read_text())["cursor"]
                    parse_cursor(cursor)
                    out[p.stem] = cursor
                except (OSError, ValueError, KeyError, TypeError):
                    logger.warning("ignoring unreadable consumer cursor file %s", p)
        return out

    async def all(self) -> dict[str, str]:
        if self._cache is None:
            self._cache = await asyncio.to_thread(self._load)
        return dict(self._cache)

    async def get(self, consumer: str) -> str | None:
        return (await self.all()).get(consumer)

    async def ack(self, consumer: str, cursor: str) -> str:
        """Store ``cursor`` for ``consumer`` unless it is behind the stored one; returns the stored cursor."""
        async with self._lock:
            cursors = await self.all()
            old = cursors.get(consumer)
            if old is not None and parse_cursor(old) >= parse_cursor(cursor):
                return old
            if old is None and len(cursors) >= self.max_consumers:
                raise TooManyConsumers(
                    f"{len(cursors)} consumers already acknowledge this log (the limit): remove unused ones "
                    "with DELETE /trajectories/consumers/NAME"
                )
            await asyncio.to_thread(self._write, consumer, cursor)
            assert self._cache is not None
            self._cache[consumer] = cursor
            return cursor

    async def remove(self, consumer: str) -> bool:
        """Forget ``consumer`` (durably); whether it was known."""
        async with self._lock:
            cursors = await self.all()
            if consumer not in cursors:
                return False
            await asyncio.to_thread(self._unlink, consumer)
            assert self._cache is not None
            self._cache.pop(consumer, None)
            return True

    def _write(self, consumer: str, cursor: str) -> None:
        files.makedirs(self.dir)
        body = json.dumps({"consumer": consumer, "cursor": cursor, "at": time.time()})
        files.atomic_write(self.dir / f"{consumer}.cursor", body)

    def _unlink(self, consumer: str) -> None:
        (self.dir / f"{consumer}.cursor").unlink(missing_ok=True)
        files.fsync_path(self.dir)


__all__ = ["CONSUMER_RE", "ConsumerCursors", "TooManyConsumers"]
