"""``SteptapClient``: the async client (sessions, rewards, the trajectory stream with reconnects,
de-duplicated)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal, Unpack
from urllib.parse import quote

import aiohttp
import msgspec

from steptap.middleware import files
from steptap.middleware.client.api import (
    SessionInfo,
    SessionOptions,
    SteptapError,
    _finish_body,
    _reward_body,
    _session_dec,
    proxy_url,
    session_body,
)
from steptap.middleware.client.tokens import default_control_token
from steptap.middleware.delta import DeltaError, embed
from steptap.middleware.records import Curation, Trajectory, is_digest, json_encoder, trajectory_json_decoder
from steptap.middleware.wire import (
    StreamCut,
    decode_envelope,
    decode_logged,
    decode_trajectory,
    parse_cursor,
    read_frames,
)

logger = logging.getLogger("steptap.client")


class _Lookup(msgspec.Struct):
    marks: dict[str, list[Curation]] = {}


_lookup_dec = msgspec.json.Decoder(_Lookup)


class Delivery(msgspec.Struct):
    """One trajectory from the stream and the cursor to acknowledge once done with it."""

    cursor: str
    trajectory: Trajectory


def delivery_key(traj: Trajectory) -> str:
    """What identifies one trajectory record across re-deliveries: its id and its ``created_at``. The id alone
    is not enough: after compaction (or a restart on a new log) a session id can be used again, and that new
    trajectory must not be dropped as a duplicate of the old one. ``created_at`` is set once, when the session
    opens, and is part of the record, so every re-delivery of one record carries the same key."""
    return f"{traj.id}@{traj.created_at!r}"


class SeenSet:
    """A bounded set of delivery keys (oldest forgotten first), optionally backed by an append-only file."""

    def __init__(self, max_ids: int = 100_000, path: str | os.PathLike[str] | None = None) -> None:
        self.max_ids = max_ids
        self.path = Path(path) if path is not None else None
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._pending: list[tuple[tuple[int, int], str]] = []  # delivered, not yet acknowledged
        self._lines = 0
        if self.path is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                if line:
                    self._remember(line)
                    self._lines += 1

    def __contains__(self, tid: str) -> bool:
        return tid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def _remember(self, tid: str) -> None:
        self._ids[tid] = None
        self._ids.move_to_end(tid)
        while len(self._ids) > self.max_ids:
            self._ids.popitem(last=False)

    def delivered(self, tid: str, cursor: str) -> None:
        self._remember(tid)
        if self.path is not None:
            self._pending.append((parse_cursor(cursor), tid))

    def acknowledged(self, cursor: str) -> None:
        """Persist the ids delivered up to ``cursor`` (synced: they must survive a crash of the consumer)."""
        if self.path is None or not self._pending:
            return
        upto = parse_cursor(cursor)
        done = [tid for key, tid in self._pending if key <= upto]
        self._pending = [(key, tid) for key, tid in self._pending if key > upto]
        if not done:
            return
        if self._lines + len(done) > 2 * self.max_ids:  # rewrite to the retained ids, atomically
            files.atomic_write(self.path, "".join(f"{t}\n" for t in self._ids))
            self._lines = len(self._ids)
            return
        files.append_durable(self.path, "".join(f"{t}\n" for t in done))
        self._lines += len(done)


class SteptapClient:
    """Async client; use as ``async with SteptapClient(base_url, control_token) as c:``. ``base_url``:
    ``http(s)://host:port`` or ``unix:PATH``, ``/v1`` or not (``proxy_url``). ``session``: an aiohttp session
    to share (a TCP proxy only: a ``unix:`` one is reached through the client's own)."""

    def __init__(
        self,
        base_url: str,
        control_token: str | None = None,
        *,
        timeout_s: float = 60.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.url = proxy_url(base_url)  # ``url.name``: as given, for messages
        self.base_url = self.url.base
        self.control_token = control_token or default_control_token()
        self.timeout_s = timeout_s
        if self.url.socket is not None:
            session = None  # a shared session's connector speaks TCP
        self._session = session
        self._own_session = session is None
        self._seen: dict[str, SeenSet] = {}
        self.skipped: dict[str, int] = {}  # per consumer: stream records that could not be read, skipped

    def _skip(self, consumer: str, cursor: str, why: str) -> None:
        """A record no reader can decode must not stop the consumer (nor every restart after it): skip,
        count, report."""
        self.skipped[consumer] = self.skipped.get(consumer, 0) + 1
        logger.warning("trajectory stream for %s: skipped an unreadable record before cursor %s (%s)",
                       consumer, cursor, why)

    async def __aenter__(self) -> SteptapClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.UnixConnector(path=self.url.socket) if self.url.socket is not None else None
            self._session = aiohttp.ClientSession(connector=connector, read_bufsize=1 << 20)
        return self._session

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.control_token:
            h["Authorization"] = f"Bearer {self.control_token}"
        return h

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        data = json_encoder.encode(body) if body is not None else None
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self._http().request(method, self.base_url + path, data=data, headers=self._headers(),
                                        timeout=timeout) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise SteptapError.from_body(resp.status, raw)
            return raw

    async def image(self, sha256: str) -> bytes | None:
        """The bytes of an image a step names (``ImageRef.sha256``; ``GET /images/<sha256>``), None when the
        proxy's log does not hold it. The learner's ``resolve``."""
        if not is_digest(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256[:80]!r}")
        try:
            return await self._request("GET", f"/images/{sha256}")
        except SteptapError as exc:
            if exc.status == 404:
                return None
            raise

    # ---- sessions and rewards ----------------------------------------------------------------------------

    async def open_session(self, **options: Unpack[SessionOptions]) -> SessionInfo:
        """Open a session (``SessionOptions``: the same for both clients; ``session_id``: choose its id
        instead of letting the proxy generate one; ``tito``, ``train`` and ``side_models``:
        docs/sessions.md)."""
        return _session_dec.decode(await self._request("POST", "/sessions", session_body(options)))

    async def add_reward(self, session_id: str, value: float, *, name: str | None = None,
                         step: int | Literal["last"] | None = None,
                         source: Literal["http", "human"] | None = None,
                         provenance: dict[str, Any] | None = None) -> None:
        """A reward; on a session finished with its reward pending it releases the trajectory; after the
        trajectory was streamed it is recorded as late (never trained). ``provenance``: what made it (at
        most 16 flat entries), kept on the trajectory by the reward's name."""
        await self._request("POST", f"/sessions/{quote(session_id, safe='')}/rewards",
                            _reward_body(value, name, step, source, provenance))

    async def finish(self, session_id: str, *, reward: float | Literal["pending"] | None = None,
                     status: str = "finished", deadline_s: float | None = None,
                     on_deadline: Literal["drop"] | float | None = None, error: str | None = None,
                     infra_cause: str | None = None, task_run: Any = None) -> dict[str, Any]:
        """Close the session; the proxy's answer (id, status, steps, rewards, reward, error, infra_cause)."""
        raw = await self._request("POST", f"/sessions/{quote(session_id, safe='')}/finish",
                                 _finish_body(reward, status, deadline_s, on_deadline, error, infra_cause,
                                              task_run))
        return dict(msgspec.json.decode(raw))

    async def get_session(self, session_id: str) -> Trajectory:
        body = await self._request("GET", f"/sessions/{quote(session_id, safe='')}")
        return trajectory_json_decoder.decode(body)

    # ---- curation (docs/console.md) ----------------------------------------------------------------------

    async def curate(self, session_id: str, action: Literal["exclude", "include", "reward", "tag"], *,
                     step: int | None = None, value: float | None = None, name: str = "reward",
                     tags: list[str] | None = None, reason: str = "") -> dict[str, Any]:
        """Mark a trajectory (or one of its steps): durable in the log, honoured by the learner for what it
        has not trained yet."""
        body: dict[str, Any] = {"action": action, "step": step, "name": name, "reason": reason}
        if value is not None:
            body["value"] = value
        if tags:
            body["tags"] = tags
        raw = await self._request("POST", f"/sessions/{quote(session_id, safe='')}/curation", body)
        result: dict[str, Any] = msgspec.json.decode(raw)
        return result

    async def curation(self, ids: list[str]) -> dict[str, list[Curation]]:
        """The curation marks of these trajectories, in log order (those without any are left out)."""
        return _lookup_dec.decode(await self._request("POST", "/curation/lookup", {"ids": ids})).marks

    # ---- the stream --------------------------------------------------------------------------------------

    async def ack(self, consumer: str, cursor: str) -> None:
        await self._request("POST", "/trajectories/ack", {"consumer": consumer, "cursor": cursor})
        seen = self._seen.get(consumer)
        if seen is not None:
            # No await between the acknowledgement and its record in the seen file: a consumer cancelled there
            # would take the ack as failed while the proxy (and the file) have it, and never see the
            # trajectory again. One small synced append, once per ack (acks come at checkpoint time).
            seen.acknowledged(cursor)

    async def trajectories(
        self,
        consumer: str,
        *,
        cursor: str | None = None,
        follow: bool = True,
        dedup: bool = True,
        seen_file: str | os.PathLike[str] | None = None,
        max_seen: int = 100_000,
        format: Literal["ndjson", "msgpack"] = "msgpack",
        heartbeat_s: float = 10.0,
        max_backoff_s: float = 5.0,
        full: bool = True,
    ) -> AsyncIterator[Delivery]:
        """Finished trajectories for ``consumer``, at least once, de-duplicated (``delivery_key``) when
        ``dedup``; unreadable records are skipped and counted. ``full=False``: each trajectory's steps as
        logged (``delta.embed``: a delta step holds only what is new) instead of full, for a reader that
        expands them one at a time (the learner's rows), in memory linear in a long session.

        Reconnects with exponential backoff (up to ``max_backoff_s``) on connection errors and 5xx answers;
        4xx answers raise ``SteptapError``. With ``follow=False`` it ends once caught up with the log."""
        seen = self._seen_for(consumer, seen_file, max_seen) if dedup else None
        position = cursor
        backoff = 0.2
        # Between messages the server writes a heartbeat every heartbeat_s: silence much longer than that is
        # a dead connection (a proxy killed without closing its sockets), so reconnect.
        read_timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=max(3 * heartbeat_s, 5.0))
        while True:
            params = {"consumer": consumer, "format": format, "follow": "1" if follow else "0",
                      "heartbeat": str(heartbeat_s)}
            if position is not None:
                params["cursor"] = position
            try:
                async with self._http().get(self.base_url + "/trajectories", params=params,
                                            headers=self._headers(), timeout=read_timeout) as resp:
                    if resp.status >= 500:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                    if resp.status >= 400:
                        raise SteptapError.from_body(resp.status, await resp.read())
                    backoff = 0.2
                    async for cur, delivery, end in self._messages(resp, consumer, format, full, seen):
                        position = cur
                        if end:
                            return
                        if delivery is not None:
                            yield delivery
            except (TimeoutError, aiohttp.ClientError, ConnectionError, StreamCut) as exc:
                logger.info("trajectory stream for %s dropped (%s); reconnecting in %.1fs", consumer, exc,
                            backoff)
            else:
                logger.info("trajectory stream for %s ended by the proxy; reconnecting", consumer)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff_s)

    def _seen_for(self, consumer: str, seen_file: str | os.PathLike[str] | None, max_seen: int) -> SeenSet:
        seen = self._seen.get(consumer)
        if seen is None or (seen_file is not None and seen.path != Path(seen_file)):
            seen = SeenSet(max_seen, seen_file)
            self._seen[consumer] = seen
        return seen

    async def _messages(self, resp: aiohttp.ClientResponse, consumer: str,
                        format: Literal["ndjson", "msgpack"], full: bool,
                        seen: SeenSet | None) -> AsyncIterator[tuple[str, Delivery | None, bool]]:
        """Each stream message: (its cursor, the trajectory to deliver or None, whether the stream ended)."""
        async for body in read_frames(resp.content, format):
            try:
                msg = decode_envelope(body, format)
            except msgspec.DecodeError as exc:  # not a record problem: the stream itself is broken
                raise StreamCut(f"undecodable stream message: {exc}") from None
            if msg.end:
                yield msg.cursor, None, True
                return
            yield msg.cursor, self._delivery(consumer, msg, format, full, seen), False

    def _delivery(self, consumer: str, msg: Any, format: Literal["ndjson", "msgpack"], full: bool,
                  seen: SeenSet | None) -> Delivery | None:
        """The trajectory a message carries, unless it is a heartbeat, a skipped or unreadable record, or one
        already delivered."""
        if msg.skipped is not None:
            self._skip(consumer, msg.cursor, f"skipped by the proxy: {msg.skipped}")
            return None
        if not msg.trajectory:
            return None  # a heartbeat
        try:
            traj = decode_trajectory(msg.trajectory, format, msg.steps) if full else embed(
                *decode_logged(msg.trajectory, format, msg.steps))
        except (msgspec.DecodeError, DeltaError) as exc:  # a record we cannot read
            self._skip(consumer, msg.cursor, str(exc))
            return None
        if seen is not None:
            key = delivery_key(traj)
            if key in seen:
                logger.debug("dropping duplicate trajectory %s", traj.id)
                return None
            seen.delivered(key, msg.cursor)
        return Delivery(msg.cursor, traj)
