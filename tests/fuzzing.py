"""Hypothesis strategies over every route, body, header and path of the proxy, and the one check every answer
must pass. Used by ``tests/integration/test_fuzz.py`` (deterministic, in CI) and ``bench/fuzz_long.py`` (a
long random run).

What is generated: model calls (chat and completions, plain or streamed, anonymous, by path, header or key)
whose bodies are near-valid (a valid body with keys replaced by arbitrary JSON) or arbitrary (any JSON value,
raw bytes); control calls (open, read, reward, finish, groups, the stream and its acks) with arbitrary bodies
and ids; the admin route without the control token (a fuzzer must never swap the weights of a shared server);
and arbitrary methods and paths. Near-valid bodies always carry a small ``max_tokens`` (or a wrong one), so a
call that reaches the backend stays short.

The check: no hang (every call has a deadline), no 5xx other than the documented backend errors (502, 503,
504 with a ``backend_*`` code), every error in OpenAI's body, every stream ending in ``[DONE]`` or an error
event.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

TIMEOUT_S = 60.0  # a call that takes longer is a hang (the backend answers a short call in well under this)

_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_value = st.recursive(
    _json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                            max_size=3),
    max_leaves=8,
)
_small_text = st.text(max_size=40)
_id = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,20}", fullmatch=True),
    st.text(max_size=20),  # anything, newlines and slashes included
    st.just("auto:x"), st.just("a" * 129), st.just("abc\n"),
)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": _small_text}),
    st.dictionaries(st.text(max_size=8), json_value, max_size=3),
)
_CHAT_KEYS = ["model", "messages", "stream", "n", "temperature", "top_p", "top_k", "min_p", "max_tokens",
              "logprobs", "top_logprobs", "return_token_ids", "logit_bias", "stop", "seed",
              "presence_penalty",
              "frequency_penalty", "repetition_penalty", "min_tokens", "tools", "tool_choice",
              "response_format",
              "stream_options", "x_unknown"]
_COMPLETION_KEYS = ["model", "prompt", "stream", "n", "temperature", "top_p", "max_tokens", "logprobs",
                    "echo",
                    "return_token_ids", "stop", "seed", "x_unknown"]


@dataclass
class Request:
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    model_call: bool = False


@st.composite
def near_valid(draw: st.DrawFn, chat: bool, model: str) -> dict[str, Any]:
    """A valid body with some keys set to arbitrary JSON, and a few sampling knobs set to valid values."""
    if chat:
        body: dict[str, Any] = {"model": model, "messages": draw(st.lists(_message, min_size=1, max_size=3))}
    else:
        body = {"model": model, "prompt": draw(st.one_of(_small_text,
                                                         st.lists(st.integers(0, 300), max_size=8)))}
    body["max_tokens"] = draw(st.integers(1, 3))
    body["stream"] = draw(st.booleans())
    if draw(st.booleans()):
        body["n"] = draw(st.integers(1, 3))
    if draw(st.booleans()):
        body["temperature"] = draw(st.floats(0, 2))
    for key in draw(st.lists(st.sampled_from(_CHAT_KEYS if chat else _COMPLETION_KEYS), max_size=3,
                             unique=True)):
        value = draw(json_value)
        if key == "max_tokens" and isinstance(value, int) and not isinstance(value, bool):
            value = max(-5, min(value, 3))  # stays short when it is a number
        if key == "n" and isinstance(value, int) and not isinstance(value, bool):
            value = max(-5, min(value, 70))  # around the cap, never a flood of choices
        body[key] = value
    return body


def _header_text() -> st.SearchStrategy[str]:
    return st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)


@st.composite
def model_call(draw: st.DrawFn, model: str, session_keys: list[str]) -> Request:
    chat = draw(st.booleans())
    route = "/v1/chat/completions" if chat else "/v1/completions"
    prefix = ""
    if draw(st.booleans()):
        prefix = "/s/" + urllib.parse.quote(draw(_id), safe="")
    headers: dict[str, str] = {"Content-Type": "application/json"}
    if draw(st.booleans()):
        headers["X-Steptap-Session"] = draw(_header_text())
    auth = draw(st.sampled_from(["none", "empty", "junk", "key"]))
    if auth == "empty":
        headers["Authorization"] = "Bearer EMPTY"
    elif auth == "junk":
        headers["Authorization"] = draw(_header_text())
    elif auth == "key" and session_keys:
        headers["Authorization"] = "Bearer " + draw(st.sampled_from(session_keys))
    kind = draw(st.sampled_from(["near", "near", "near", "json", "bytes"]))
    if kind == "near":
        body = json.dumps(draw(near_valid(chat, model))).encode()
    elif kind == "json":
        body = json.dumps(draw(json_value)).encode()
    else:
        body = draw(st.binary(max_size=64))
    return Request("POST", prefix + route, body, headers, model_call=True)


@st.composite
def control_call(draw: st.DrawFn, token: str, session_ids: list[str]) -> Request:
    sid = draw(st.one_of(st.sampled_from(session_ids), _id)) if session_ids else draw(_id)
    quoted = urllib.parse.quote(sid, safe="")
    auth = draw(st.sampled_from(["token", "token", "token", "none", "junk"]))
    headers = {"Content-Type": "application/json"}
    if auth == "token":
        headers["Authorization"] = f"Bearer {token}"
    elif auth == "junk":
        headers["Authorization"] = "Bearer " + draw(_header_text())
    which = draw(st.sampled_from(["open", "get", "reward", "finish", "group", "stream", "ack", "admin",
                                  "metrics",
                                  "health", "models", "any"]))
    body_value = draw(st.one_of(
        json_value,
        st.fixed_dictionaries({}, optional={
            "id": _id, "group_id": st.one_of(st.none(), _id), "group_size": json_value, "mode": json_value,
            "metadata": json_value, "idle_timeout_s": json_value, "value": json_value, "name": json_value,
            "step": json_value, "reward": json_value, "status": json_value, "consumer": json_value,
            "cursor": json_value,
        }),
    ))
    body = json.dumps(body_value).encode() if draw(st.booleans()) else draw(st.binary(max_size=32))
    if which == "open":
        return Request("POST", "/sessions", body, headers)
    if which == "get":
        return Request("GET", f"/sessions/{quoted}", None, headers)
    if which == "reward":
        return Request("POST", f"/sessions/{quoted}/rewards", body, headers)
    if which == "finish":
        return Request("POST", f"/sessions/{quoted}/finish", body, headers)
    if which == "group":
        return Request("GET", f"/groups/{quoted}", None, headers)
    if which == "stream":
        query = {"follow": "0", "consumer": draw(st.one_of(_id, st.just("fuzz"))),
                 "format": draw(st.sampled_from(["ndjson", "msgpack", "xml"]))}
        if draw(st.booleans()):
            query["cursor"] = draw(st.text(max_size=20))
        return Request("GET", "/trajectories?" + urllib.parse.urlencode(query), None, headers)
    if which == "ack":
        return Request("POST", "/trajectories/ack", body, headers)
    if which == "admin":  # never with the token: a fuzzer must not swap a shared server's weights
        headers.pop("Authorization", None)
        return Request("POST", "/admin/weights", body, headers)
    if which in ("metrics", "health", "models"):
        return Request("GET", {"metrics": "/metrics", "health": "/health", "models": "/v1/models"}[which],
                       None, headers)
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
    path = "/" + "/".join(urllib.parse.quote(p, safe="")
                          for p in draw(st.lists(st.text(max_size=8), max_size=4)))
    if path.startswith("/admin"):
        headers.pop("Authorization", None)
    return Request(method, path, body if method != "GET" else None, headers)


BACKEND_5XX = {502, 503, 504}


def send(base: str, req: Request) -> tuple[int, bytes, str]:
    """Send one request (its own connection, a deadline) and check the answer; returns (status, body,
    content type). Raises AssertionError on a broken promise, TimeoutError on a hang."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT_S)
    try:
        conn.request(req.method, req.path, body=req.body, headers=req.headers)
        resp = conn.getresponse()
        data = resp.read()
        ctype = resp.getheader("Content-Type", "")
    finally:
        conn.close()
    status = resp.status
    where = f"{req.method} {req.path} {req.headers} {req.body[:300] if req.body else b''!r}"
    if status >= 500:
        code = _error_code(data)
        assert status in BACKEND_5XX and code is not None and code.startswith("backend"), (
            f"{status} {data[:300]!r} for {where}"
        )
    if status >= 400:
        assert _error_code(data) is not None, f"{status} without OpenAI's error body {data[:200]!r}: {where}"
    if status == 200 and "text/event-stream" in ctype:
        tail = data.rstrip()
        assert tail.endswith(b"data: [DONE]") or b'"error"' in tail.rsplit(b"\n", 1)[-1], (
            f"stream ended without [DONE] or an error event: {tail[-200:]!r} for {where}"
        )
    return status, data, ctype


def _error_code(data: bytes) -> str | None:
    try:
        err = json.loads(data)["error"]
        assert set(err) >= {"message", "type", "code"}, err
        return str(err["code"]) if err["code"] is not None else ""
    except (ValueError, KeyError, TypeError):
        return None
