"""Processes for the benchmark: each server runs in its own process and says on stdout where it listens.

A server started with ``serve(app)`` binds port 0 and prints one JSON line ``{"ready": true, "port": N}``; the
orchestrator reads that line (no bind-close-rebind race) and stops the process by its pid when done.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
from typing import Any

from aiohttp import web


def use_uvloop() -> str:
    """Install uvloop's policy where it is available (as the proxy does), so no side gets an unfair loop."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def serve(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
    """Run ``app`` until SIGTERM/SIGINT, announcing the bound port on stdout."""
    loop_kind = use_uvloop()

    async def _main() -> None:
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=1024)
        await site.start()
        bound = runner.addresses[0][1]
        print(json.dumps({"ready": True, "port": bound, "pid": os.getpid(), "loop": loop_kind}), flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(_main())


def free_port() -> int:
    """A free port for a server that cannot bind port 0 and report it (the steptap CLI); racy but brief."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A child server process; ``start()`` waits for its ready line, ``stop()`` ends it by pid."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None, log: str | None = None):
        self.name, self.cmd, self.env, self.log = name, cmd, env, log
        self.proc: subprocess.Popen[str] | None = None
        self.port: int | None = None
        self.info: dict[str, Any] = {}

    def start(self, timeout: float = 30.0) -> Server:
        # imported here: a baseline tree's steptap (``--baseline REF``) comes first on the path of the
        # processes that import this module to read its log, and an older tree may not have it
        from steptap.middleware.launch.lifetime import die_with_parent

        stderr = open(self.log, "w") if self.log else subprocess.DEVNULL  # noqa: SIM115 (kept for the child)
        # die_with_parent: a bench killed hard (Ctrl-C twice, a timeout) takes its servers with it
        self.proc = subprocess.Popen(  # noqa: PLW1509 - benches start their servers from the main thread
            self.cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, **(self.env or {})}, preexec_fn=die_with_parent(),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("ready"):
                self.info, self.port = msg, int(msg["port"])
                return self
        self.stop()
        raise RuntimeError(f"{self.name} did not start: {' '.join(self.cmd)} (see {self.log})")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def python_cmd(script: str, *args: str) -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    return [sys.executable, os.path.join(here, script), *args]
