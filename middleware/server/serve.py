"""``steptap serve``: flags -> ``ProxyConfig`` -> ``create_app`` -> ``web.run_app``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

import msgspec

from steptap.middleware.client import read_token_file
from steptap.middleware.config import (
    SECRET_ENV,
    ProxyConfig,
    add_proxy_flags,
    generation_defaults,
    parse_force_sampling,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="steptap serve", description="Run the capture proxy in front of a vLLM server."
    )
    add_proxy_flags(p)
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N proxy processes on one port (SO_REUSEPORT), each with its own log and port "
                        "PORT+1+i")
    return p


def _secret(args: argparse.Namespace, name: str) -> str | None:
    """A secret from its flag, else its file flag, else its environment variable."""
    value = getattr(args, name)
    path = getattr(args, name + "_file")
    if not value and path and os.path.exists(path):  # a missing control token file is written at start
        from steptap.middleware.files import secret_dir

        secret_dir(os.path.dirname(os.path.abspath(path)))  # anyone could have planted it in a shared one
        value = read_token_file(path)
    return value or os.environ.get(SECRET_ENV[name]) or None


def config_from_args(argv: list[str]) -> ProxyConfig:
    parser = _parser()
    args = parser.parse_args(argv)
    values = vars(args)
    try:
        values["force_sampling"] = parse_force_sampling(args.force_sampling)
        values["eval_sampling"] = parse_force_sampling(args.eval_sampling, "--eval-sampling")
        for name in SECRET_ENV:
            values[name] = _secret(args, name)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    values["control_token"] = values["control_token"] or ""
    values["viewer_token"] = values["viewer_token"] or ""
    backends = values.pop("backend") or []  # --backend is repeated: the first, then the other replicas
    if not backends and not args.backends_file:
        parser.error("give --backend URL (repeatable) or --backends-file FILE")
    values["backend"], values["backends"] = (backends[0] if backends else ""), backends[1:]
    if args.model_dir:
        values["sampling_defaults"] = generation_defaults(args.model_dir)
    fields = set(ProxyConfig.__struct_fields__)
    try:
        return msgspec.convert({k: v for k, v in values.items() if k in fields}, ProxyConfig)
    except msgspec.ValidationError as exc:
        parser.error(str(exc))


def args_of(argv: list[str]) -> argparse.Namespace:
    return _parser().parse_args(argv)


def _write_generated_token(path: str | None, config: ProxyConfig) -> str:
    """Where a generated control token goes: ``--control-token-file`` when given, else a 0600 file in a 0700
    directory of the user cache, named for the port."""
    from pathlib import Path

    from steptap.middleware.files import secret_dir
    from steptap.middleware.launch.private_files import write_private

    if path is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "steptap" / "tokens"
        path = str(secret_dir(cache) / f"serve-{config.port or os.getpid()}.token")
    else:
        secret_dir(Path(path).parent)
    write_private(path, config.control_token + "\n")
    return path


class _Refused(Exception):
    """What stops ``steptap serve`` before it serves: printed after ``steptap serve:``, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = config_from_args(argv)
    workers = args_of(argv).workers
    try:
        _check_flags(config, workers)
        sock = _listen(config, workers)
        token_file = _control_token(config, argv)
        if workers > 1:
            from steptap.middleware.server.workers import run_workers

            return run_workers(config, list(argv), workers)
        _make_log_dir(config)
    except _Refused as exc:
        print(f"steptap serve: {exc}", file=sys.stderr)
        return 2
    _serve(config, sock, token_file)
    return 0


def _check_flags(config: ProxyConfig, workers: int) -> None:
    """The flags that cannot go together, or a backend URL that is none."""
    from steptap.middleware.backend.url import problem

    bad = [p for p in map(problem, filter(None, [config.backend, *config.backends])) if p]
    if bad:
        raise _Refused(f"--backend {bad[0]}")
    if workers > 1 and (config.listen_fd is not None or not config.port):
        raise _Refused("--workers share a fixed --port by SO_REUSEPORT (each worker also takes one of the "
                       "next N ports), not --port 0 or an inherited socket")
    if workers <= 1 and config.public_url and ("{i}" in config.public_url or "{port}" in config.public_url):
        raise _Refused("--public-url: {i} and {port} name a worker; they need --workers N")


def _listen(config: ProxyConfig, workers: int) -> Any:
    """The one process's listening socket, bound now (``--port 0``: the kernel's port, into the config); None
    for workers, which bind their own."""
    from steptap.middleware.launch.procs import listener

    if workers > 1 or config.reuse_port or config.worker_port:
        return None
    try:
        sock = listener(config.host, config.port, config.listen_fd)
    except (OSError, OverflowError) as exc:  # in use, not here, or not a port (OverflowError)
        raise _Refused(f"cannot listen on {config.host}:{config.port} (--host, --port): "
                       f"{getattr(exc, 'strerror', None) or exc}") from None
    config.port = sock.getsockname()[1]
    return sock


def _control_token(config: ProxyConfig, argv: list[str]) -> str | None:
    """A control token generated when none was given: kept in a 0600 file, never printed, one for all
    workers; the file's path (None: the token was given)."""
    if config.control_token:
        return None
    from steptap.middleware.auth import generate_token
    from steptap.middleware.files import PrivateDirError

    config.control_token = generate_token()
    try:
        return _write_generated_token(args_of(argv).control_token_file, config)
    except PrivateDirError as exc:
        raise _Refused(str(exc)) from None


def _make_log_dir(config: ProxyConfig) -> None:
    """A local log's directory, made now (a remote log's is the store's)."""
    if "://" in config.log and not config.log.startswith("file://"):
        return
    from steptap.middleware.files import makedirs

    try:
        makedirs(config.log.removeprefix("file://"))
    except OSError as exc:
        raise _Refused(f"--log {config.log}: {exc.strerror or exc}") from None


def _serve(config: ProxyConfig, sock: Any, token_file: str | None) -> None:
    """The one process (or one worker, ``--reuse-port``) serves until stopped."""
    from aiohttp import web

    from steptap.middleware.app import create_app
    from steptap.middleware.auth import CONTROL_TOKEN_KEY
    from steptap.middleware.server import malloc

    logging.basicConfig(
        level=os.environ.get("STEPTAP_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    malloc.tune()  # a long session's growing buffers from the heap, not fresh pages each call
    malloc.tune_gc()  # no collector pass every few calls
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    app = create_app(config)
    assert app[CONTROL_TOKEN_KEY] == config.control_token
    backends = ", ".join(filter(None, [config.backend, *config.backends, config.backends_file]))
    print(f"steptap proxy on {config.base_url()} -> {backends}; log: {config.log}", flush=True)
    if token_file is not None:
        print(f"control token (generated) in {token_file}", flush=True)
    if config.reuse_port or config.worker_port:
        asyncio.run(_serve_worker(app, config))
    else:
        web.run_app(app, sock=sock, print=None, access_log=None, backlog=backlog(config))


def backlog(config: ProxyConfig) -> int:
    """The listen backlog: room for as many connections arriving at once as calls the proxy admits (the
    default, 128, drops the SYNs beyond it: a burst of 256 agents then waits out a 1 s TCP retransmit)."""
    return max(128, config.max_concurrent_calls)


async def _serve_worker(app: Any, config: ProxyConfig) -> None:
    """One worker: the shared port (SO_REUSEPORT) and its own, until SIGTERM/SIGINT."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = config.port
    try:
        await web.TCPSite(runner, config.host, port, reuse_port=config.reuse_port,
                          backlog=backlog(config)).start()
        if config.worker_port:
            port = config.worker_port
            await web.TCPSite(runner, config.host, port, backlog=backlog(config)).start()
    except OSError as exc:  # one line, not a traceback (the launcher then stops the other workers)
        await runner.cleanup()
        print(f"steptap serve: worker cannot listen on {config.host}:{port}: {exc.strerror or exc}",
              file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
