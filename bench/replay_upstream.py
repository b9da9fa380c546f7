"""An instant upstream that replays recorded vLLM replies (bench/fixtures/), for the proxy benchmark.

    python bench/replay_upstream.py [--fixture chat_32_tokens [--fixture chat_1400_tokens]] [--port 0]

``POST /v1/chat/completions`` answers with the recorded body: streamed (the recorded SSE events, one write and
flush each) when the request asks for ``"stream": true``, else the recorded JSON. With several fixtures, the
request's ``max_tokens`` picks one (each fixture has its own; the first is the default). Nothing else in the
request is parsed, and those two by a byte search: the cost on this side is the same whoever calls. ``GET
/v1/models`` answers with the recorded model list, ``POST /v1/completions`` echoes the prompt as vLLM does
(``completions``: for ``long_session.py``), and the vLLM dev-mode routes a proxy may call at start
(health, version, pause state) answer as vLLM does. Any other route is a 404 and is counted (``GET
/bench/stats``), so a benchmark sees what it missed.

``--tito``: a chat session in token-in-token-out mode (``long_session.py --chat``) instead of the recorded
chat reply: ``/v1/chat/completions`` renders the messages with a made-up tokenizer (two bytes a token, a
ChatML-like template whose end token is 2) and answers a 2-token reply ending on it, with the prompt ids
echoed; ``chat/completions/render``, ``inference/v1/generate`` and ``chat/completions/derender`` answer as
vLLM's do (a generate request's ids are not read: its cost on this side is a byte search). The proxy's CPU per
TITO turn at a given context, with nothing else in the call's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections import Counter
from pathlib import Path

import msgspec
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import serve
from recorded import DEFAULT_FIXTURE, Fixture, load

# Streamed or not is the one thing read from the request; a byte search, not a JSON parse.
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')
_MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')

FIXTURE = web.AppKey("fixture", Fixture)  # the default (first) fixture
BY_MAX_TOKENS = web.AppKey("by_max_tokens", dict)  # max_tokens -> (fixture, its SSE events split once)
STATS = web.AppKey("stats", Counter)
READ_DELAY = web.AppKey("read_delay", float)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    stats = request.app[STATS]
    table = request.app[BY_MAX_TOKENS]
    m = _MAX_TOKENS.search(body) if len(table) > 1 else None
    entry = table.get(int(m.group(1))) if m else None
    fixture, events = entry or table[request.app[FIXTURE].max_tokens]
    if _STREAM_TRUE.search(body):
        stats[f"chat_stream {fixture.name}"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
        await resp.write_eof()
        return resp
    stats[f"chat {fixture.name}"] += 1
    return web.Response(body=fixture.reply, content_type="application/json")


class _Prompt(msgspec.Struct):
    prompt: msgspec.Raw = msgspec.Raw()


_prompt_of = msgspec.json.Decoder(_Prompt)


async def completions(request: web.Request) -> web.Response:
    """A ``/v1/completions`` reply of 8 tokens that echoes the request's prompt (its raw bytes) as
    ``prompt_token_ids``, as vLLM does with ``return_token_ids``: the proxy's cost per call at a long token
    prompt without vLLM's (``long_session.py --backend`` on this upstream)."""
    body = await request.read()
    request.app[STATS]["completions"] += 1
    prompt = bytes(_prompt_of.decode(body).prompt) or b"[]"
    return web.Response(body=_COMPLETION_HEAD + prompt + _COMPLETION_TAIL, content_type="application/json")


_COMPLETION_HEAD = (
    b'{"id":"cmpl-replay","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,'
    b'"text":"abcdefgh","logprobs":{"text_offset":[0,1,2,3,4,5,6,7],"token_logprobs":[-1.0,-1.0,-1.0,-1.0,'
    b'-1.0,-1.0,-1.0,-1.0],"tokens":["a","b","c","d","e","f","g","h"],"top_logprobs":null},'
    b'"finish_reason":"length","stop_reason":null,"token_ids":[5,6,7,8,9,10,11,12],"prompt_logprobs":null,'
    b'"prompt_token_ids":')
_COMPLETION_TAIL = b'}],"usage":{"prompt_tokens":1,"total_tokens":9,"completion_tokens":8}}'


async def models(request: web.Request) -> web.Response:
    return web.Response(body=request.app[FIXTURE].models, content_type="application/json")


async def ok(request: web.Request) -> web.Response:
    request.app[STATS][request.path] += 1
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": "0.32.0"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": False})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(dict(request.app[STATS]))


async def not_found(request: web.Request) -> web.Response:
    request.app[STATS][f"404 {request.method} {request.path}"] += 1
    return web.json_response(
        {
            "error": {
                "message": f"replay upstream has no {request.path}",
                "type": "NotFoundError",
                "code": 404,
            }
        },
        status=404,
    )


# --- --tito: a made-up tokenizer and template, vLLM's TITO routes' shapes -----------------------------------

_ROLES = {"system": 399, "user": 343, "assistant": 414, "tool": 415}
_END = 2  # the end-of-turn token
_REPLY = [3580, _END]  # every reply: "fandi" and the end token


def _render(messages: list[dict], generation: bool) -> list[int]:
    ids: list[int] = []
    for m in messages:
        text = (m.get("content") or "").encode()
        ids += [1, _ROLES.get(m.get("role"), 343), 201]
        pairs = text + b" " if len(text) % 2 else text
        ids += [100 + (pairs[i] * 31 + pairs[i + 1]) % 3900 for i in range(0, len(pairs), 2)]
        ids += [_END, 201]
    return ids + [1, 414, 201] if generation else ids


def _logprobs(ids: list[int]) -> dict:
    return {"content": [{"token": "fandi" if t != _END else "<|im_end|>", "token_id": t, "logprob": -1.0,
                         "bytes": [], "top_logprobs": []} for t in ids]}


async def tito_chat(request: web.Request) -> web.Response:
    body = msgspec.json.decode(await request.read())
    request.app[STATS]["tito chat"] += 1
    prompt = _render(body["messages"], True)
    return web.Response(body=msgspec.json.encode({
        "id": "chatcmpl-replay", "object": "chat.completion", "created": 1, "model": body.get("model"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "fandi"},
                     "logprobs": _logprobs(_REPLY), "finish_reason": "stop", "stop_reason": None,
                     "token_ids": _REPLY}],
        "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + 2, "completion_tokens": 2},
        "prompt_token_ids": prompt}), content_type="application/json")


async def tito_render(request: web.Request) -> web.Response:
    body = msgspec.json.decode(await request.read())
    request.app[STATS]["tito render"] += 1
    ids = _render(body["messages"], bool(body.get("add_generation_prompt", True)))
    params = {"temperature": 1.0, "max_tokens": body.get("max_tokens") or 131072 - len(ids), "logprobs": 0}
    return web.Response(body=msgspec.json.encode({"request_id": "render-replay", "token_ids": ids,
                                                 "sampling_params": params, "model": body.get("model"),
                                                 "stream": False}), content_type="application/json")


async def _read_late(request: web.Request) -> bytes:
    """The body, read only after ``--read-delay`` seconds: a busy vLLM takes its time to read what it is sent,
    and the proxy's writes wait (and wake) as it drains them."""
    delay = request.app[READ_DELAY]
    if delay:
        await asyncio.sleep(delay)
    return await request.read()


async def tito_generate(request: web.Request) -> web.Response:
    await _read_late(request)
    request.app[STATS]["tito generate"] += 1
    return web.Response(body=msgspec.json.encode({
        "request_id": "generate-replay", "output_mode": "tokens", "choices": [{
            "index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": _REPLY,
            "weight_versions": [{"version": "default", "start": 0, "end": 2}],
            "logprobs": {"content": [{"token_id": t, "logprob": -1.0, "rank": 1, "top_logprobs": []}
                                     for t in _REPLY]}}]}), content_type="application/json")


async def tito_derender(request: web.Request) -> web.Response:
    await _read_late(request)
    request.app[STATS]["tito derender"] += 1
    return web.Response(body=msgspec.json.encode({
        "id": "generate-replay", "object": "chat.completion", "created": 1, "model": "replay",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "fandi"},
                     "logprobs": _logprobs(_REPLY[:-1]), "finish_reason": "stop", "stop_reason": None,
                     "token_ids": _REPLY[:-1]}],
        "usage": {"prompt_tokens": 0, "total_tokens": 1, "completion_tokens": 1}}),
        content_type="application/json")


def create_app(fixtures: Fixture | list[Fixture], tito: bool = False,
               read_delay: float = 0.0) -> web.Application:
    if isinstance(fixtures, Fixture):
        fixtures = [fixtures]
    app = web.Application(client_max_size=64 * 1024**2)
    app[FIXTURE] = fixtures[0]
    app[BY_MAX_TOKENS] = {fx.max_tokens: (fx, fx.stream_events) for fx in fixtures}
    if len(app[BY_MAX_TOKENS]) != len(fixtures):
        raise SystemExit("each fixture needs its own max_tokens (the replay tells calls apart by it)")
    app[STATS] = Counter()
    app[READ_DELAY] = read_delay
    app.router.add_post("/v1/chat/completions", tito_chat if tito else chat)
    if tito:
        app.router.add_post("/v1/chat/completions/render", tito_render)
        app.router.add_post("/inference/v1/generate", tito_generate)
        app.router.add_post("/v1/chat/completions/derender", tito_derender)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", ok)
    app.router.add_get("/ping", ok)
    app.router.add_get("/version", version)
    app.router.add_get("/is_paused", is_paused)
    for path in ("/pause", "/resume", "/reset_prefix_cache"):
        app.router.add_post(path, ok)
    app.router.add_get("/bench/stats", stats)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fixture", action="append", help=f"repeatable; default {DEFAULT_FIXTURE}")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tito", action="store_true", help="answer a chat session's TITO routes (see above)")
    p.add_argument("--read-delay", type=float, default=0.0,
                   help="--tito: wait this long before reading a generate or derender body (a busy receiver)")
    args = p.parse_args(argv)
    serve(create_app([load(name) for name in args.fixture or [DEFAULT_FIXTURE]], args.tito, args.read_delay),
          port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
