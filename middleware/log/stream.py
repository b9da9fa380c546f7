"""The stream to the learner: ``GET /trajectories`` and ``POST /trajectories/ack`` (control token only).

``GET /trajectories?consumer=NAME&cursor=C&format=ndjson|msgpack&follow=1&heartbeat=S`` sends the finished
trajectories after cursor ``C`` (default: the consumer's acknowledged cursor, else the start of the log), each
with the cursor after it. With ``follow=1`` (the default) the response stays open and new trajectories are sent
as they finish; every ``heartbeat`` seconds (default 10) without one, a heartbeat is written so idle connections
stay open and a dead client is noticed (its write fails). With ``follow=0`` the stream ends with an ``end``
message once it has caught up.

Framing (one ``StreamMessage`` each):
- ``format=ndjson``: one JSON object per line: ``{"cursor": C, "trajectory": {...}}``, ``{"cursor": C,
  "heartbeat": T}`` or ``{"cursor": C, "end": true}``.
- ``format=msgpack``: a 4-byte big-endian length, then the same object as msgpack.

``POST /trajectories/ack {"consumer", "cursor"}`` records that the consumer is done with everything up to the
cursor, durably (``consumers/NAME.cursor`` in the log directory, replaced atomically). Acknowledged cursors only
move forward. With compaction on, segments every known consumer has acknowledged are then deleted (the log's
rule keeps the segments of open sessions). Delivery is at least once: a consumer that reconnects from its
acknowledged cursor may see trajectories again, and de-duplicates by trajectory id (the client does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from steptap.middleware.auth import require_control
from steptap.middleware.errors import ApiError, bad_request
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.records import Trajectory
from steptap.middleware.log.wal import TrajectoryLog, parse_cursor

logger = logging.getLogger("steptap.stream")

LOG_KEY = web.AppKey("steptap_log", TrajectoryLog)

_CONSUMER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_LEN = struct.Struct(">I")
NDJSON = "application/x-ndjson"
MSGPACK = "application/x-msgpack"


class StreamMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message of the stream: a trajectory, a heartbeat or the end of a non-following stream."""

    cursor: str
    trajectory: Trajectory | None = None
    heartbeat: float | None = None
    end: bool = False


class _RawStreamMessage(msgspec.Struct, kw_only=True):
    """A trajectory message whose record is passed through as the log's msgpack bytes (no decode, re-encode)."""

    cursor: str
    trajectory: msgspec.Raw


class AckBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    consumer: str
    cursor: str


_json_enc = msgspec.json.Encoder()
_mp_enc = msgspec.msgpack.Encoder()
_ack_dec = msgspec.json.Decoder(AckBody)


class ConsumerCursors:
    """Acknowledged cursors, one small file per consumer under ``<log dir>/consumers``."""

    def __init__(self, dirpath: Path) -> None:
        self.dir = dirpath
        self._cache: dict[str, str] | None = None
        self._lock = asyncio.Lock()

    def _load(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.dir.is_dir():
            for p in self.dir.glob("*.cursor"):
                try:
                    out[p.stem] = json.loads(p.read_text())["cursor"]
                except (OSError, ValueError, KeyError):
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
            await asyncio.to_thread(self._write, consumer, cursor)
            assert self._cache is not None
            self._cache[consumer] = cursor
            return cursor

    def _write(self, consumer: str, cursor: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{consumer}.cursor"
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump({"consumer": consumer, "cursor": cursor, "at": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a crash leaves the old cursor or the new one, never half of one
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _StreamState:
    """What the routes share; filled on first use, after the app's cleanup_ctx has opened the log."""

    def __init__(self, compact: bool, heartbeat_s: float) -> None:
        self.compact = compact
        self.heartbeat_s = heartbeat_s
        self.cursors: ConsumerCursors | None = None
        self.streams: set[asyncio.Task[object]] = set()  # open long-lived responses, ended at shutdown

    def consumer_cursors(self, log: TrajectoryLog) -> ConsumerCursors:
        if self.cursors is None:
            self.cursors = ConsumerCursors(log.dir / "consumers")
        return self.cursors


STREAM_STATE_KEY = web.AppKey("steptap_stream_state", _StreamState)


def add_routes(app: web.Application, *, compact: bool = True, heartbeat_s: float = 10.0,
               lag_interval_s: float = 5.0) -> None:
    """Add the stream routes to ``app``; ``app[LOG_KEY]`` must hold the open log by the time requests come.
    Call it after the cleanup_ctx that opens the log is registered (the lag updater uses the log)."""
    app[STREAM_STATE_KEY] = _StreamState(compact, heartbeat_s)
    app.router.add_get("/trajectories", get_trajectories)
    app.router.add_post("/trajectories/ack", post_ack)
    app.on_shutdown.append(_end_streams)
    app.cleanup_ctx.append(_lag_ctx(lag_interval_s))


def _lag_ctx(interval_s: float) -> Any:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(_refresh_lag_forever(app, interval_s), name="steptap-stream-lag")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return ctx


async def update_lag(app: web.Application) -> None:
    """Set ``steptap_stream_lag_records{consumer}``: finished trajectories after each consumer's ack."""
    if LOG_KEY not in app or METRICS_KEY not in app:
        return
    log = app[LOG_KEY]
    gauge = app[METRICS_KEY].stream_lag
    for consumer, cursor in (await app[STREAM_STATE_KEY].consumer_cursors(log).all()).items():
        gauge.labels(consumer).set(log.trajectories_after(cursor))


async def _refresh_lag_forever(app: web.Application, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await update_lag(app)
        except Exception:  # noqa: BLE001 - metrics must never take the proxy down
            logger.exception("updating stream lag failed")


async def _end_streams(app: web.Application) -> None:
    """Streams never end by themselves: cut them at shutdown, or the server waits out its shutdown timeout.
    Consumers reconnect from their last cursor."""
    for task in list(app[STREAM_STATE_KEY].streams):
        task.cancel()


def _consumer(value: str | None, *, required: bool) -> str | None:
    if value is None or value == "":
        if required:
            raise bad_request("'consumer' is required", "missing_consumer")
        return None
    if not _CONSUMER_RE.match(value):
        raise bad_request("'consumer' must be 1-128 letters, digits, '.', '_' or '-'", "invalid_consumer")
    return value


async def _check_cursor(log: TrajectoryLog, cursor: str) -> None:
    """400 for a cursor this log never handed out (a bad one would otherwise fail mid-stream, after 200)."""
    try:
        await asyncio.to_thread(log.check_cursor, cursor)
    except ValueError as exc:
        raise bad_request(str(exc), "invalid_cursor") from None


def _flag(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise bad_request(f"expected 0 or 1, got {value!r}", "invalid_parameter")


async def get_trajectories(request: web.Request) -> web.StreamResponse:
    require_control(request)
    log = request.app[LOG_KEY]
    state = request.app[STREAM_STATE_KEY]
    q = request.query
    consumer = _consumer(q.get("consumer"), required=False)
    fmt = q.get("format", "ndjson")
    if fmt not in ("ndjson", "msgpack"):
        raise bad_request("'format' must be 'ndjson' or 'msgpack'", "invalid_format")
    follow = _flag(q.get("follow"), True)
    try:
        heartbeat = float(q.get("heartbeat", state.heartbeat_s))
    except ValueError:
        raise bad_request("'heartbeat' must be a number of seconds", "invalid_parameter") from None
    if not 0.05 <= heartbeat <= 3600:
        raise bad_request("'heartbeat' must be between 0.05 and 3600 seconds", "invalid_parameter")
    cursor = q.get("cursor") or None
    if cursor is None and consumer is not None:
        cursor = await state.consumer_cursors(log).get(consumer)
    if cursor is not None:
        await _check_cursor(log, cursor)

    def encode(msg: StreamMessage | _RawStreamMessage) -> bytes:
        if fmt == "ndjson":
            return _json_enc.encode(msg) + b"\n"
        body = _mp_enc.encode(msg)
        return _LEN.pack(len(body)) + body

    def message(cur: str, traj: Any) -> StreamMessage | _RawStreamMessage:
        if fmt == "msgpack":
            return _RawStreamMessage(cursor=cur, trajectory=msgspec.Raw(traj))
        return StreamMessage(cursor=cur, trajectory=traj)

    resp = web.StreamResponse(headers={"Content-Type": NDJSON if fmt == "ndjson" else MSGPACK,
                                       "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    # Not following: a short idle wait marks "caught up". Following: idle waits are heartbeats.
    agen = log.tail(cursor, idle=heartbeat if follow else 0.0, raw=fmt == "msgpack")
    sent = 0
    task = asyncio.current_task()
    assert task is not None
    state.streams.add(task)
    try:
        async for cur, traj in agen:
            if traj is not None:
                await resp.write(encode(message(cur, traj)))
                sent += 1
            elif follow:
                await resp.write(encode(StreamMessage(cursor=cur, heartbeat=time.time())))
            else:
                await resp.write(encode(StreamMessage(cursor=cur, end=True)))
                break
    except (ConnectionResetError, asyncio.CancelledError):
        logger.info("stream to consumer %s ended (client gone or shutdown) after %d trajectories", consumer, sent)
        raise
    finally:
        state.streams.discard(task)
        await agen.aclose()
    await resp.write_eof()
    return resp


async def post_ack(request: web.Request) -> web.Response:
    require_control(request)
    log = request.app[LOG_KEY]
    state = request.app[STREAM_STATE_KEY]
    try:
        body = _ack_dec.decode(await request.read())
    except msgspec.ValidationError as exc:
        raise bad_request(f"bad ack body: {exc}", "invalid_body") from None
    except msgspec.DecodeError:
        raise bad_request("the ack body must be JSON: {\"consumer\": NAME, \"cursor\": CURSOR}", "invalid_json") from None
    consumer = _consumer(body.consumer, required=True)
    assert consumer is not None
    await _check_cursor(log, body.cursor)
    store = state.consumer_cursors(log)
    stored = await store.ack(consumer, body.cursor)
    deleted: list[int] = []
    if state.compact:
        cursors = await store.all()
        floor = min(cursors.values(), key=parse_cursor)
        try:
            deleted = await log.compact(floor)
        except Exception:  # noqa: BLE001 - the ack itself is durable; compaction retries at the next one
            logger.exception("compaction after ack from %s failed", consumer)
    await update_lag(request.app)
    return web.json_response({"consumer": consumer, "cursor": stored, "compacted_segments": len(deleted)})


__all__ = ["LOG_KEY", "StreamMessage", "ConsumerCursors", "add_routes", "ApiError"]
