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
"""

from __future__ import annotations

import argparse
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


def create_app(fixtures: Fixture | list[Fixture]) -> web.Application:
    if isinstance(fixtures, Fixture):
        fixtures = [fixtures]
    app = web.Application(client_max_size=64 * 1024**2)
    app[FIXTURE] = fixtures[0]
    app[BY_MAX_TOKENS] = {fx.max_tokens: (fx, fx.stream_events) for fx in fixtures}
    if len(app[BY_MAX_TOKENS]) != len(fixtures):
        raise SystemExit("each fixture needs its own max_tokens (the replay tells calls apart by it)")
    app[STATS] = Counter()
    app.router.add_post("/v1/chat/completions", chat)
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
    args = p.parse_args(argv)
    serve(create_app([load(name) for name in args.fixture or [DEFAULT_FIXTURE]]), port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
