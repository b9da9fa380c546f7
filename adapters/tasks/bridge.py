"""The runner's end of an episode's network: a unix socket in the episode's private folder, bound into
its sandbox (``launcher.py`` relays the agent's 127.0.0.1:PORT to it), passing on to the proxy only the
requests of the episode's own session URL (``/s/<id>`` and below). Anything else (the control routes, the
console, ``/metrics``, another session) is answered 403 here and never reaches the proxy. Bodies pass
unchanged, both ways, as they arrive (streamed replies too); the agent's own headers go with them, hop-by-hop
ones aside. It counts the model calls that reached the proxy: an agent that dies before its first one is an
infrastructure error, not a failed attempt.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import aiohttp
from aiohttp import web

from steptap.middleware.client import proxy_url as parse_proxy_url

HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                 "transfer-encoding", "upgrade", "host", "content-length"})
# Not passed on either: the path names the session (a header naming another one is the agent's, not ours)
DROPPED = HOP | {"x-steptap-session"}


class Bridge:
    """One episode's socket: ``await start()``, the agent runs, ``await close()``."""

    def __init__(self, socket: Path, proxy_url: str, session_id: str, owner: tuple[int, int] | None) -> None:
        url = parse_proxy_url(proxy_url)  # http(s)://host:port, or unix:PATH (a proxy on a unix socket)
        self.socket, self.proxy, self._proxy_socket = socket, url.base, url.socket
        self.prefix = f"/s/{session_id}"
        self.owner = owner  # (uid, gid) the sandbox runs as: it must be able to connect
        self.calls = 0  # POSTs passed on (model calls)
        self.refused = 0
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 40)  # the proxy applies its own limits
        app.router.add_route("*", "/{tail:.*}", self._forward)
        connector = aiohttp.UnixConnector(path=self._proxy_socket) if self._proxy_socket else None
        self._http = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                           timeout=aiohttp.ClientTimeout(total=None),
                                           read_bufsize=1 << 20)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        await web.UnixSite(self._runner, str(self.socket)).start()
        if self.owner is not None:
            os.chown(self.socket, *self.owner)
        os.chmod(self.socket, 0o600)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path != self.prefix and not path.startswith(self.prefix + "/"):
            self.refused += 1
            return web.json_response({"error": {"message": "this sandbox reaches its own session URL only",
                                                "type": "forbidden", "code": "forbidden"}}, status=403)
        assert self._http is not None
        if request.method == "POST":
            self.calls += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED}
        body = request.content if request.body_exists else None
        out: web.StreamResponse | None = None
        try:
            async with self._http.request(request.method, self.proxy + request.rel_url.raw_path_qs,
                                          headers=headers, data=body, allow_redirects=False) as up:
                out = web.StreamResponse(status=up.status, reason=up.reason, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in HOP})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except aiohttp.ClientError as exc:
            if out is not None:  # cut mid-reply: the agent sees its stream end, as it would from the proxy
                return out
            return web.json_response({"error": {"message": f"the steptap proxy cannot be reached: {exc}",
                                                "type": "server_error", "code": "proxy_unreachable"}},
                                     status=502)
