"""The stream to the learner (control token only): ``GET /trajectories``, ``POST /trajectories/ack`` and
``DELETE /trajectories/consumers/NAME``.

``GET /trajectories?consumer=NAME&cursor=C&format=ndjson|msgpack&follow=1&heartbeat=S`` sends the finished
trajectories after cursor ``C`` (default: the consumer's acknowledged cursor, else the start of the log), each
with the cursor after it. With ``follow=1`` (the default) the response stays open and new trajectories are
sent as they finish; every ``heartbeat`` seconds (default 10) without one, a heartbeat is written so idle
connections stay open and a dead client is noticed (its write fails). With ``follow=0`` the stream ends with
an ``end`` message once it has caught up. A record that does not decode is not sent: a ``skipped`` message
takes its place (the NDJSON stream decodes every record; the msgpack stream passes records through and the
client skips what it cannot decode). Both send a trajectory as logged: its record and the Step records it
refers to, each as logged (a delta step holds only what is new, so each new token travels once), and readers
resolve them into full steps (``wire.decode_trajectory``, the client does). The NDJSON stream re-encodes the
msgpack records as JSON, in a worker thread when they are large (not on the event loop).

Framing and messages are defined in ``wire.py`` (shared with the client): NDJSON lines, or length-prefixed
msgpack frames.

``POST /trajectories/ack {"consumer", "cursor"}`` records that the consumer is done with everything up to the
cursor, durably (``cursors.py``). Acknowledged cursors only move forward. With compaction on, segments every
known consumer has acknowledged are then deleted (the log's rule keeps the segments of open sessions).
``DELETE /trajectories/consumers/NAME`` forgets a consumer, so an abandoned one stops holding compaction back.
Delivery is at least once: a consumer that reconnects from its acknowledged cursor may see trajectories again,
and de-duplicates them (the client does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple, cast

import msgspec
from aiohttp import web

from steptap.middleware.auth import require_control
from steptap.middleware.errors import ApiError, bad_request
from steptap.middleware.log.cursors import CONSUMER_RE, ConsumerCursors, TooManyConsumers
from steptap.middleware.log.reader import Found, Skipped
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.records import Trajectory, is_digest, log_decoder, step_msgpack_decoder
from steptap.middleware.wire import (
    FORMATS,
    MSGPACK,
    NDJSON,
    Format,
    RawTrajectoryMessage,
    StreamMessage,
    encode_message,
    parse_cursor,
)

logger = logging.getLogger("steptap.stream")

LOG_KEY = web.AppKey("steptap_log", TrajectoryLog)
INLINE_BYTES = 64 << 10  # an NDJSON message from fewer logged bytes is built on the loop (no thread hop)


class AckBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    consumer: str
    cursor: str


_ack_dec = msgspec.json.Decoder(AckBody)


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
    app.router.add_delete("/trajectories/consumers/{consumer}", delete_consumer)
    app.router.add_get("/images/{sha256}", get_image)
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
    if not CONSUMER_RE.match(value):
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


class _Ask(NamedTuple):
    """What a ``GET /trajectories`` asks for, checked."""

    consumer: str | None
    fmt: Format
    follow: bool
    heartbeat: float
    cursor: str | None


async def _ask(request: web.Request) -> _Ask:
    log, state, q = request.app[LOG_KEY], request.app[STREAM_STATE_KEY], request.query
    consumer = _consumer(q.get("consumer"), required=False)
    asked = q.get("format", "ndjson")
    if asked not in FORMATS:
        raise bad_request("'format' must be 'ndjson' or 'msgpack'", "invalid_format")
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
    # one of FORMATS, checked above (mypy does not narrow `in` to a Literal)
    return _Ask(consumer, cast(Format, asked), _flag(q.get("follow"), True), heartbeat, cursor)


async def _message(log: TrajectoryLog, fmt: Format, cur: str, found: Found) -> bytes:
    """One finished trajectory on the stream, in ``fmt``."""
    if fmt == "msgpack":  # passed through as logged: the client resolves the steps
        return encode_message(RawTrajectoryMessage(
            cursor=cur, trajectory=msgspec.Raw(found.payload), steps=[msgspec.Raw(p) for p in found.steps]
        ), fmt)
    try:  # JSON of the logged records; a large one built off the loop (a first step can be megabytes)
        if len(found.payload) + sum(map(len, found.steps)) < INLINE_BYTES:
            return _ndjson_message(cur, found)
        return await asyncio.to_thread(_ndjson_message, cur, found)
    except msgspec.DecodeError as exc:  # ValidationError included
        log.undecodable(cur, exc)  # counted as the reader counts its own
        return encode_message(StreamMessage(cursor=cur, skipped=str(exc)), fmt)


async def get_trajectories(request: web.Request) -> web.StreamResponse:
    require_control(request)
    log, state = request.app[LOG_KEY], request.app[STREAM_STATE_KEY]
    ask = await _ask(request)
    fmt = ask.fmt
    resp = web.StreamResponse(headers={"Content-Type": NDJSON if fmt == "ndjson" else MSGPACK,
                                       "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    # Not following: a short idle wait marks "caught up". Following: idle waits are heartbeats.
    agen = log.tail(ask.cursor, idle=ask.heartbeat if ask.follow else 0.0, raw=True)
    sent = 0
    task = asyncio.current_task()
    assert task is not None
    state.streams.add(task)
    try:
        async for cur, traj in agen:
            if isinstance(traj, Skipped):  # undecodable: say so (the client counts it) and move past it
                await resp.write(encode_message(StreamMessage(cursor=cur, skipped=traj.reason), fmt))
            elif traj is not None:
                await resp.write(await _message(log, fmt, cur, traj))
                sent += 1
            elif ask.follow:
                await resp.write(encode_message(StreamMessage(cursor=cur, heartbeat=time.time()), fmt))
            else:
                await resp.write(encode_message(StreamMessage(cursor=cur, end=True), fmt))
                break
    except ConnectionResetError:  # the consumer went away mid-write: nothing to tell it, and no error of ours
        logger.info("stream to consumer %s ended (client gone) after %d trajectories", ask.consumer, sent)
        return resp
    except asyncio.CancelledError:
        logger.info("stream to consumer %s ended (shutdown) after %d trajectories", ask.consumer, sent)
        raise
    finally:
        state.streams.discard(task)
        await agen.aclose()
    await resp.write_eof()
    return resp


def _ndjson_message(cursor: str, found: Found) -> bytes:
    """A trajectory message as NDJSON: the logged records decoded (checked against the schema) and re-encoded,
    steps in their logged (delta) form."""
    traj = log_decoder.decode(found.payload)
    if not isinstance(traj, Trajectory):
        raise msgspec.ValidationError("not a trajectory record")
    steps = [step_msgpack_decoder.decode(p) for p in found.steps]
    return encode_message(StreamMessage(cursor=cursor, trajectory=traj, steps=steps), "ndjson")


async def post_ack(request: web.Request) -> web.Response:
    require_control(request)
    log = request.app[LOG_KEY]
    state = request.app[STREAM_STATE_KEY]
    try:
        body = _ack_dec.decode(await request.read())
    except msgspec.ValidationError as exc:
        raise bad_request(f"bad ack body: {exc}", "invalid_body") from None
    except msgspec.DecodeError:
        raise bad_request("the ack body must be JSON: {\"consumer\": NAME, \"cursor\": CURSOR}",
                          "invalid_json") from None
    consumer = _consumer(body.consumer, required=True)
    assert consumer is not None
    await _check_cursor(log, body.cursor)
    store = state.consumer_cursors(log)
    try:
        stored = await store.ack(consumer, body.cursor)
    except TooManyConsumers as exc:
        raise ApiError(409, str(exc), "too_many_consumers") from None
    deleted = await _compact(request.app, consumer)
    return web.json_response({"consumer": consumer, "cursor": stored, "compacted_segments": len(deleted)})


async def delete_consumer(request: web.Request) -> web.Response:
    """Forget a consumer (an abandoned learner): its cursor no longer holds compaction back."""
    require_control(request)
    consumer = _consumer(request.match_info["consumer"], required=True)
    assert consumer is not None
    log = request.app[LOG_KEY]
    if not await request.app[STREAM_STATE_KEY].consumer_cursors(log).remove(consumer):
        raise ApiError(404, f"no consumer {consumer!r} has acknowledged this log", "consumer_not_found")
    if METRICS_KEY in request.app:
        try:
            request.app[METRICS_KEY].stream_lag.remove(consumer)
        except KeyError:
            pass
    deleted = await _compact(request.app, consumer)
    return web.json_response({"consumer": consumer, "deleted": True, "compacted_segments": len(deleted)})


async def _compact(app: web.Application, why: str) -> list[int]:
    """With compaction on, delete the segments every remaining consumer has acknowledged."""
    log = app[LOG_KEY]
    state = app[STREAM_STATE_KEY]
    deleted: list[int] = []
    cursors = await state.consumer_cursors(log).all()
    if state.compact and cursors:
        floor = min(cursors.values(), key=parse_cursor)
        try:
            deleted = await log.compact(floor)
        except Exception:  # noqa: BLE001 - the ack itself is durable; compaction retries at the next one
            logger.exception("compaction after %s failed", why)
    await update_lag(app)
    return deleted


__all__ = ["LOG_KEY", "StreamMessage", "ConsumerCursors", "add_routes", "ApiError", "delete_consumer"]


async def get_image(request: web.Request) -> web.Response:
    """``GET /images/<sha256>``: the bytes of an image a step names (``Step.images``; log/images.py)."""
    require_control(request)
    sha = request.match_info["sha256"]
    if not is_digest(sha):
        raise bad_request("an image is named by its sha256 hex digest (64 lowercase hex digits)",
                          "invalid_image_ref")
    data = await asyncio.to_thread(request.app[LOG_KEY].images.get, sha)
    if data is None:
        raise ApiError(404, f"no image {sha} in this log", "image_not_found")
    return web.Response(body=data, content_type="application/octet-stream",
                        headers={"Cache-Control": "private, max-age=31536000, immutable"})
