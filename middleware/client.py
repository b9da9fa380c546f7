"""The Python client of the proxy's control API and trajectory stream (aiohttp only; no ML stack).

    async with SteptapClient("http://127.0.0.1:8100", control_token) as c:
        s = await c.open_session(group_id="g1", group_size=4)
        ...  # the agent uses s.base_url / s.api_key
        await c.finish(s.id, reward=1.0)

    async for d in c.trajectories("learner"):      # at least once, de-duplicated (delivery_key)
        train_on(d.trajectory)
        await c.ack("learner", d.cursor)            # everything up to d.cursor is done

**Delivery.** The stream reconnects with backoff when the proxy restarts or the connection drops, resuming
after the last cursor it delivered (before the first delivery: the given cursor, else the consumer's
acknowledged one). The same trajectory can come twice (a restart re-sends from the acknowledged cursor); with
``dedup=True`` the iterator drops records it has already delivered (a bounded seen-set keyed by
``delivery_key``: trajectory id and ``created_at``, so a session id reused later is still delivered). A record
that cannot be decoded is skipped, counted in ``client.skipped[consumer]`` and logged, never fatal. With ``seen_file`` the ids
acknowledged through ``ack`` are also written to that file, so after a consumer restart they are still
recognised; ids delivered but never acknowledged are deliberately re-delivered (the consumer may not have
finished with them).

``SyncSteptapClient`` offers the control calls synchronously (stdlib only), plus the health, model list, weight
swap and metrics that launchers and the learner poll.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit

import aiohttp
import msgspec

from steptap.middleware import files
from steptap.middleware.backend.url import BackendUrl
from steptap.middleware.delta import DeltaError
from steptap.middleware.records import Trajectory
from steptap.middleware.wire import StreamCut, decode_envelope, decode_trajectory, parse_cursor, read_frames

logger = logging.getLogger("steptap.client")

TOKEN_ENV = "STEPTAP_CONTROL_TOKEN"
TOKEN_FILE_ENV = "STEPTAP_CONTROL_TOKEN_FILE"  # a 0600 file holding it (how `steptap up` hands it to a driver)


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in a file: its first line, stripped. ``ValueError`` when the file is empty or unreadable (a token
    file with no token is a mistake to report, never the same as no file)."""
    try:
        lines = Path(path).read_text().strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the token ({exc})") from exc
    if not lines or not lines[0].strip():
        raise ValueError(f"{path}: empty token file")
    return lines[0].strip()


def forget_control_token() -> None:
    """Take the control token (and the name of its file) out of this process's environment once read: every
    process started from here (an agent, a tool, a grader) would inherit it, and with it the power to post
    its own rewards."""
    os.environ.pop(TOKEN_ENV, None)
    os.environ.pop(TOKEN_FILE_ENV, None)


def default_control_token() -> str | None:
    """The control token from ``$STEPTAP_CONTROL_TOKEN``, else from the file ``$STEPTAP_CONTROL_TOKEN_FILE``
    names (``read_token_file``), else None."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV)
    if not path:
        return None
    try:
        return read_token_file(path)
    except ValueError as exc:
        raise ValueError(f"${TOKEN_FILE_ENV}={exc}") from None



class SteptapError(Exception):
    """An error answer from the proxy (OpenAI's error body)."""

    def __init__(self, status: int, message: str, type: str | None = None, code: str | None = None) -> None:
        super().__init__(f"{status} {type or 'error'}: {message}" + (f" ({code})" if code else ""))
        self.status = status
        self.message = message
        self.type = type
        self.code = code

    @classmethod
    def from_body(cls, status: int, body: bytes) -> SteptapError:
        try:
            err = json.loads(body)["error"]
            return cls(status, str(err.get("message", "")), err.get("type"), err.get("code"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls(status, body.decode("utf-8", "replace")[:500] or f"HTTP {status}")


class SessionInfo(msgspec.Struct, kw_only=True):
    id: str
    base_url: str
    api_key: str


class Delivery(msgspec.Struct):
    """One trajectory from the stream and the cursor to acknowledge once done with it."""

    cursor: str
    trajectory: Trajectory


_session_dec = msgspec.json.Decoder(SessionInfo)
_traj_dec = msgspec.json.Decoder(Trajectory)
_enc = msgspec.json.Encoder()


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
    """Async client; use as ``async with SteptapClient(base_url, control_token) as c:``."""

    def __init__(
        self,
        base_url: str,
        control_token: str | None = None,
        *,
        timeout_s: float = 60.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.control_token = control_token or default_control_token()
        self.timeout_s = timeout_s
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
            self._session = aiohttp.ClientSession(read_bufsize=1 << 20)
        return self._session

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.control_token:
            h["Authorization"] = f"Bearer {self.control_token}"
        return h

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        data = _enc.encode(body) if body is not None else None
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self._http().request(method, self.base_url + path, data=data, headers=self._headers(),
                                        timeout=timeout) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise SteptapError.from_body(resp.status, raw)
            return raw

    # ---- sessions and rewards ----------------------------------------------------------------------------

    async def open_session(
        self,
        *,
        group_id: str | None = None,
        group_size: int | None = None,
        mode: Literal["train", "eval"] = "train",
        metadata: dict[str, Any] | None = None,
        idle_timeout_s: float | None = None,
        session_id: str | None = None,
        train: Literal["main", "all"] = "main",
        side_models: list[str] | None = None,
    ) -> SessionInfo:
        """Open a session (``session_id``: choose its id instead of letting the proxy generate one; ``train``
        and ``side_models``: docs/sessions.md, "Side calls and branches")."""
        body = _session_body(group_id, group_size, mode, metadata, idle_timeout_s, session_id, train, side_models)
        return _session_dec.decode(await self._request("POST", "/sessions", body))

    async def add_reward(self, session_id: str, value: float, *, name: str | None = None,
                         step: int | Literal["last"] | None = None) -> None:
        await self._request("POST", f"/sessions/{quote(session_id, safe='')}/rewards",
                            _reward_body(value, name, step))

    async def finish(self, session_id: str, *, reward: float | None = None, status: str = "finished") -> None:
        await self._request("POST", f"/sessions/{quote(session_id, safe='')}/finish", _finish_body(reward, status))

    async def get_session(self, session_id: str) -> Trajectory:
        return _traj_dec.decode(await self._request("GET", f"/sessions/{quote(session_id, safe='')}"))

    # ---- the stream --------------------------------------------------------------------------------------

    async def ack(self, consumer: str, cursor: str) -> None:
        await self._request("POST", "/trajectories/ack", {"consumer": consumer, "cursor": cursor})
        seen = self._seen.get(consumer)
        if seen is not None:
            # No await between the acknowledgement and its record in the seen file: a consumer cancelled there
            # would take the ack as failed while the proxy (and the file) have it, and never see the trajectory
            # again. One small synced append, once per ack (acks come at checkpoint time).
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
    ) -> AsyncIterator[Delivery]:
        """Finished trajectories for ``consumer``, at least once, de-duplicated (``delivery_key``) when ``dedup``; unreadable records are skipped and counted.

        Reconnects with exponential backoff (up to ``max_backoff_s``) on connection errors and 5xx answers;
        4xx answers raise ``SteptapError``. With ``follow=False`` it ends once caught up with the log."""
        seen: SeenSet | None = None
        if dedup:
            seen = self._seen.get(consumer)
            if seen is None or (seen_file is not None and seen.path != Path(seen_file)):
                seen = SeenSet(max_seen, seen_file)
                self._seen[consumer] = seen
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
                    async for body in read_frames(resp.content, format):
                        try:
                            msg = decode_envelope(body, format)
                        except msgspec.DecodeError as exc:  # not a record problem: the stream itself is broken
                            raise StreamCut(f"undecodable stream message: {exc}") from None
                        position = msg.cursor
                        if msg.end:
                            return
                        if msg.skipped is not None:
                            self._skip(consumer, msg.cursor, f"skipped by the proxy: {msg.skipped}")
                            continue
                        if not msg.trajectory:
                            continue  # a heartbeat
                        try:
                            traj = decode_trajectory(msg.trajectory, format, msg.steps)  # full steps
                        except (msgspec.DecodeError, DeltaError) as exc:  # a record we cannot read
                            self._skip(consumer, msg.cursor, str(exc))
                            continue
                        if seen is not None:
                            key = delivery_key(traj)
                            if key in seen:
                                logger.debug("dropping duplicate trajectory %s", traj.id)
                                continue
                            seen.delivered(key, msg.cursor)
                        yield Delivery(msg.cursor, traj)
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, StreamCut) as exc:
                logger.info("trajectory stream for %s dropped (%s); reconnecting in %.1fs", consumer, exc, backoff)
            else:
                logger.info("trajectory stream for %s ended by the proxy; reconnecting", consumer)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff_s)


def _session_body(group_id: str | None, group_size: int | None, mode: str, metadata: dict[str, Any] | None,
                  idle_timeout_s: float | None, session_id: str | None, train: str = "main",
                  side_models: list[str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"mode": mode}
    if train != "main":  # the proxy's default: a body an older proxy also takes
        body["train"] = train
    for k, v in (("group_id", group_id), ("group_size", group_size), ("metadata", metadata),
                 ("idle_timeout_s", idle_timeout_s), ("id", session_id), ("side_models", side_models)):
        if v is not None:
            body[k] = v
    return body


def _reward_body(value: float, name: str | None, step: int | str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"value": value}
    if name is not None:
        body["name"] = name
    if step is not None:
        body["step"] = step
    return body


def _finish_body(reward: float | None, status: str) -> dict[str, Any]:
    body: dict[str, Any] = {"status": status}
    if reward is not None:
        body["reward"] = reward
    return body


def split_url(url: str) -> tuple[str, str | None]:
    """``(http base URL, unix socket path or None)`` of a proxy or backend URL (``/v1`` stripped):
    ``unix:/run/x.sock`` (a vLLM started with ``--uds``) is reached as ``http://localhost`` over that socket."""
    parsed = BackendUrl.parse(url)
    return parsed.base, parsed.socket


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def http_call(url: str, method: str = "GET", *, body: bytes | None = None, headers: dict[str, str] | None = None,
              timeout_s: float = 60.0, unix_socket: str | None = None) -> tuple[int, bytes]:
    """One synchronous HTTP call (stdlib only): ``(status, body)`` for every answer, 4xx and 5xx included;
    ``OSError`` when nothing answers. Never goes through an ``http_proxy`` from the environment (the proxy and
    vLLM are local); with ``unix_socket`` the URL's path is asked over that socket."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    conn: http.client.HTTPConnection
    if unix_socket is not None:
        conn = _UnixHTTPConnection(unix_socket, timeout_s)
    elif parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout_s)
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request(method, target, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except http.client.HTTPException as exc:  # a garbled answer counts as no answer
        raise ConnectionError(f"{method} {url}: {exc!r}") from exc
    finally:
        conn.close()


class SyncSteptapClient:
    """The control calls, synchronous (stdlib only, so launchers and scripts need nothing else): sessions,
    rewards, finish, ack, the weight swap, and the health, model list and metrics that launchers poll. Also
    talks to a vLLM server (``health``, ``models``), over ``unix:PATH`` too."""

    def __init__(self, base_url: str, control_token: str | None = None, *, timeout_s: float = 60.0) -> None:
        self.base_url, self.unix_socket = split_url(base_url)
        self.control_token = control_token or default_control_token()
        self.timeout_s = timeout_s

    def __enter__(self) -> SyncSteptapClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass  # one connection per call: nothing is kept open

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              timeout_s: float | None = None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        if self.control_token:
            headers["Authorization"] = f"Bearer {self.control_token}"
        return http_call(self.base_url + path, method, body=_enc.encode(body) if body is not None else None,
                         headers=headers, timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                         unix_socket=self.unix_socket)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout_s: float | None = None) -> bytes:
        status, raw = self._call(method, path, body, timeout_s)
        if status >= 400:
            raise SteptapError.from_body(status, raw)
        return raw

    def open_session(self, *, group_id: str | None = None, group_size: int | None = None,
                     mode: Literal["train", "eval"] = "train", metadata: dict[str, Any] | None = None,
                     idle_timeout_s: float | None = None, session_id: str | None = None,
                     train: Literal["main", "all"] = "main", side_models: list[str] | None = None) -> SessionInfo:
        body = _session_body(group_id, group_size, mode, metadata, idle_timeout_s, session_id, train, side_models)
        return _session_dec.decode(self._request("POST", "/sessions", body))

    def add_reward(self, session_id: str, value: float, *, name: str | None = None,
                   step: int | Literal["last"] | None = None) -> None:
        self._request("POST", f"/sessions/{quote(session_id, safe='')}/rewards", _reward_body(value, name, step))

    def finish(self, session_id: str, *, reward: float | None = None, status: str = "finished") -> None:
        self._request("POST", f"/sessions/{quote(session_id, safe='')}/finish", _finish_body(reward, status))

    def get_session(self, session_id: str) -> Trajectory:
        return _traj_dec.decode(self._request("GET", f"/sessions/{quote(session_id, safe='')}"))

    def ack(self, consumer: str, cursor: str) -> None:
        self._request("POST", "/trajectories/ack", {"consumer": consumer, "cursor": cursor})

    # ---- what launchers and the learner poll -------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """``GET /health``: the proxy's state (``policy_version``, backends). A 503 (a backend down) is an
        answer too and returns its body; other errors raise ``SteptapError``, no answer raises ``OSError``."""
        status, raw = self._call("GET", "/health", timeout_s=min(self.timeout_s, 5.0))
        if status >= 400 and status != 503:
            raise SteptapError.from_body(status, raw)
        try:
            data = json.loads(raw) if raw.strip() else {}
        except ValueError:
            data = {}
        return data if isinstance(data, dict) else {}

    def healthy(self, timeout_s: float = 3.0) -> bool:
        """Whether ``GET /health`` answers 2xx now (vLLM's or the proxy's); never raises."""
        try:
            status, _ = self._call("GET", "/health", timeout_s=timeout_s)
        except (OSError, ValueError):
            return False
        return 200 <= status < 300

    def models(self) -> list[str]:
        """The model names served (``GET /v1/models``; the bearer is the control token or a session key)."""
        data = json.loads(self._request("GET", "/v1/models"))
        return [str(m["id"]) for m in data.get("data") or () if isinstance(m, dict) and m.get("id")]

    def swap_weights(self, *, path: str | None = None, lora_path: str | None = None,
                     version: int | None = None, timeout_s: float = 900.0) -> int:
        """``POST /admin/weights`` (full weights ``path`` or a LoRA ``lora_path``); the new policy version."""
        if (path is None) == (lora_path is None):
            raise ValueError("give exactly one of path= and lora_path=")
        body: dict[str, Any] = {"path": path} if path is not None else {"lora_path": lora_path}
        if version is not None:
            body["version"] = int(version)
        return int(json.loads(self._request("POST", "/admin/weights", body, timeout_s=timeout_s))["version"])

    def transfer_weights(self, body: dict[str, Any], timeout_s: float = 900.0) -> int:
        """``POST /admin/weights`` with ``{"transfer": {...}}``: full weights the caller broadcasts meanwhile
        (``steptap.learner.transfer``); the new policy version once vLLM loaded them."""
        return int(json.loads(self._request("POST", "/admin/weights", body, timeout_s=timeout_s))["version"])

    def metrics_text(self) -> str:
        """``GET /metrics``: the Prometheus text (names in ``steptap.middleware.metrics``)."""
        return self._request("GET", "/metrics", timeout_s=min(self.timeout_s, 5.0)).decode("utf-8", "replace")


__all__ = ["SteptapClient", "SyncSteptapClient", "http_call", "split_url", "default_control_token",
           "forget_control_token", "read_token_file", "TOKEN_ENV", "TOKEN_FILE_ENV", "SteptapError", "SessionInfo",
           "Delivery", "SeenSet", "delivery_key"]
