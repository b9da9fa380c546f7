"""``SyncSteptapClient``: the control calls synchronously (stdlib only, ``unix:`` too), plus what launchers
and the learner poll: health, models, weight swap, metrics."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any, Literal, Unpack
from urllib.parse import quote, urlsplit

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
from steptap.middleware.records import Trajectory, is_digest, json_encoder, trajectory_json_decoder


def split_url(url: str) -> tuple[str, str | None]:
    """``(http base URL, unix socket path or None)`` of a proxy or backend URL (``/v1`` stripped):
    ``unix:/run/x.sock`` (a vLLM started with ``--uds``) is reached as ``http://localhost`` over that
    socket."""
    parsed = proxy_url(url)
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


def http_call(url: str, method: str = "GET", *, body: bytes | None = None,
              headers: dict[str, str] | None = None,
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
        self.url = proxy_url(base_url)  # ``url.name``: as given, for messages
        self.base_url, self.unix_socket = self.url.base, self.url.socket
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
        data = json_encoder.encode(body) if body is not None else None
        return http_call(self.base_url + path, method, body=data,
                         headers=headers, timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                         unix_socket=self.unix_socket)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout_s: float | None = None) -> bytes:
        status, raw = self._call(method, path, body, timeout_s)
        if status >= 400:
            raise SteptapError.from_body(status, raw)
        return raw

    def image(self, sha256: str) -> bytes | None:
        """The bytes of an image a step names (``GET /images/<sha256>``), None when the proxy's log does not
        hold it: a ``resolve(sha256)`` for code without an event loop (the learner, ``steptap export``)."""
        if not is_digest(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256[:80]!r}")
        status, raw = self._call("GET", f"/images/{sha256}")
        if status == 404:
            return None
        if status >= 400:
            raise SteptapError.from_body(status, raw)
        return raw

    def open_session(self, **options: Unpack[SessionOptions]) -> SessionInfo:
        """Open a session (``SessionOptions``: the same for both clients)."""
        return _session_dec.decode(self._request("POST", "/sessions", session_body(options)))

    def add_reward(self, session_id: str, value: float, *, name: str | None = None,
                   step: int | Literal["last"] | None = None,
                   source: Literal["http", "human"] | None = None,
                   provenance: dict[str, Any] | None = None) -> None:
        self._request("POST", f"/sessions/{quote(session_id, safe='')}/rewards",
                      _reward_body(value, name, step, source, provenance))

    def finish(self, session_id: str, *, reward: float | Literal["pending"] | None = None,
               status: str = "finished", deadline_s: float | None = None,
               on_deadline: Literal["drop"] | float | None = None, error: str | None = None,
               infra_cause: str | None = None, task_run: Any = None) -> dict[str, Any]:
        """Close the session; the proxy's answer (id, status, steps, rewards, reward, error, infra_cause)."""
        raw = self._request("POST", f"/sessions/{quote(session_id, safe='')}/finish",
                           _finish_body(reward, status, deadline_s, on_deadline, error, infra_cause,
                                              task_run))
        return dict(json.loads(raw))

    def get_session(self, session_id: str) -> Trajectory:
        return trajectory_json_decoder.decode(self._request("GET", f"/sessions/{quote(session_id, safe='')}"))

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

    def console_link(self, role: str = "control") -> str:
        """A one-time login link to the console (``/console/#code=...``: the code rides in the fragment, which
        no browser sends, and works once)."""
        path = json.loads(self._request("POST", "/console/api/codes", {"role": role}))["path"]
        return f"{self.base_url}{path}"

    def metrics_text(self) -> str:
        """``GET /metrics``: the Prometheus text (names in ``steptap.middleware.metrics``)."""
        return self._request("GET", "/metrics", timeout_s=min(self.timeout_s, 5.0)).decode("utf-8", "replace")
