"""A bare pass-through proxy: the benchmark's baseline (bytes in, bytes out, nothing parsed or recorded).

    python bench/passthrough.py --backend http://127.0.0.1:PORT [--port 0]

Every request is forwarded to the backend with its method, path, query, body and end-to-end headers. A
streamed reply (``text/event-stream``) is relayed chunk by chunk as the bytes arrive; any other reply is read
whole and sent with its length, which is the least a capturing proxy has to do too. It shares the steptap
proxy's stack (aiohttp server + one pooled ``ClientSession``, uvloop where available), so the difference
between the two is what steptap does on top: parsing, patching, capture and the durable log.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import serve

BACKEND = web.AppKey("backend", str)
HTTP = web.AppKey("http", aiohttp.ClientSession)

# RFC 9110 hop-by-hop headers, plus those the client library sets itself.
_DROP_REQUEST = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-connection",
    "proxy-authorization",
}
_KEEP_RESPONSE = ("Content-Type", "Content-Encoding")


async def forward(request: web.Request) -> web.StreamResponse:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
    body = await request.read()
    url = request.app[BACKEND] + request.rel_url.path_qs
    async with request.app[HTTP].request(request.method, url, data=body, headers=headers) as up:
        out_headers = {k: up.headers[k] for k in _KEEP_RESPONSE if k in up.headers}
        if up.headers.get("Content-Type", "").startswith("text/event-stream"):
            resp = web.StreamResponse(status=up.status, headers=out_headers)
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        return web.Response(status=up.status, body=await up.read(), headers=out_headers)


async def _http(app: web.Application) -> AsyncIterator[None]:
    # No pool limit (the load generator bounds concurrency); large read buffer, as for long SSE lines.
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    async with aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        read_bufsize=2**20,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
    ) as http:
        app[HTTP] = http
        yield


def create_app(backend: str) -> web.Application:
    app = web.Application(client_max_size=64 * 1024**2)
    app[BACKEND] = backend.rstrip("/")
    app.cleanup_ctx.append(_http)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", required=True)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    serve(create_app(args.backend), port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
