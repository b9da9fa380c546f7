"""An instant upstream that replays recorded vLLM replies (bench/fixtures/), for the proxy benchmark.

    python bench/replay_upstream.py [--fixture chat_32_tokens] [--port 0]

``POST /v1/chat/completions`` answers with the recorded body: streamed (the recorded SSE events, one write and
flush each) when the request asks for ``"stream": true``, else the recorded JSON. Nothing else in the request
is parsed: the cost on this side is the same whoever calls. ``GET /v1/models`` answers with the recorded model
list, and the vLLM dev-mode routes a proxy may call at start (health, version, pause state) answer as vLLM
does. Any other route is a 404 and is counted (``GET /bench/stats``), so a benchmark sees what it missed.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import serve
from recorded import DEFAULT_FIXTURE, Fixture, load

# Streamed or not is the one thing read from the request; a byte search, not a JSON parse.
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')

FIXTURE = web.AppKey("fixture", Fixture)
STATS = web.AppKey("stats", Counter)
EVENTS = web.AppKey("events", list)  # the recorded SSE events, split once


async def chat(request: web.Request) -> web.StreamResponse:
    fixture = request.app[FIXTURE]
    body = await request.read()
    stats = request.app[STATS]
    if _STREAM_TRUE.search(body):
        stats["chat_stream"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for event in request.app[EVENTS]:
            await resp.write(event)
        await resp.write_eof()
        return resp
    stats["chat"] += 1
    return web.Response(body=fixture.reply, content_type="application/json")


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


def create_app(fixture: Fixture) -> web.Application:
    app = web.Application(client_max_size=64 * 1024**2)
    app[FIXTURE] = fixture
    app[EVENTS] = fixture.stream_events
    app[STATS] = Counter()
    app.router.add_post("/v1/chat/completions", chat)
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
    p.add_argument("--fixture", default=DEFAULT_FIXTURE)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    serve(create_app(load(args.fixture)), port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
