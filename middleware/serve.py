"""``steptap serve``: flags -> ``ProxyConfig`` -> ``create_app`` -> ``web.run_app``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from steptap.middleware.config import DEFAULT_LOG_DIR, ProxyConfig, generation_defaults, parse_force_sampling


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="steptap serve", description="Run the capture proxy in front of a vLLM server."
    )
    p.add_argument("--backend", action="append", default=[],
                   help="a vLLM server's base URL, e.g. http://127.0.0.1:8000; repeat it for several replicas")
    p.add_argument("--backends-file", default=None, metavar="FILE",
                   help="replica URLs, one a line (# comments); re-read when it changes or on SIGHUP")
    p.add_argument("--health-interval", type=float, default=2.0, metavar="S",
                   help="how often replicas are health-checked (an out replica returns at most this late)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N proxy processes on one port (SO_REUSEPORT), each with its own log and port PORT+1+i")
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set for each worker
    p.add_argument("--worker-port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--refuse-swaps", default=None, help=argparse.SUPPRESS)
    p.add_argument("--swap-drain-timeout", type=float, default=60.0, metavar="S",
                   help="a weight swap waits this long for calls in flight, then cuts them (recorded failed)")
    p.add_argument(
        "--backend-api-key",
        default=None,
        help="the backend's API key (vLLM --api-key; default: $STEPTAP_BACKEND_API_KEY)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--log", default=DEFAULT_LOG_DIR, help="trajectory log: a directory or an fsspec URL")
    p.add_argument(
        "--control-token",
        default=None,
        help="bearer token for control routes (default: $STEPTAP_CONTROL_TOKEN, else generated)",
    )
    p.add_argument("--public-url", default=None, help="base URL handed to agents (default http://HOST:PORT)")
    p.add_argument("--any-model", action="store_true", help="route every model name to the served model")
    p.add_argument(
        "--no-auto-create",
        action="store_true",
        help="an unknown session id in a model call is a 404 instead of opening that session",
    )
    p.add_argument(
        "--force-sampling",
        default="",
        metavar="temperature=1.0,top_p=1.0",
        help="sampling values sent on every call, whatever the agent asked",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="the served model's directory: its generation_config gives the recorded sampling defaults"
        " (as vLLM applies them), and the weight swap reloads it after a failed swap",
    )
    p.add_argument("--metrics-need-token", action="store_true", help="GET /metrics needs the control token")
    p.add_argument(
        "--reward",
        default=None,
        metavar="module:function",
        help="called with each finished Trajectory; returns a reward or per-step rewards",
    )
    p.add_argument("--reward-timeout", type=float, default=30.0, metavar="S")
    p.add_argument(
        "--session-idle-timeout",
        type=float,
        default=None,
        metavar="S",
        help="close sessions idle this long as timed_out (per-session value wins)",
    )
    p.add_argument("--group-timeout", type=float, default=None, metavar="S")
    p.add_argument(
        "--upstream-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="no byte from the backend for this long: 504 (or a cut stream)",
    )
    return p


def config_from_args(argv: list[str]) -> ProxyConfig:
    args = _parser().parse_args(argv)
    if not args.backend and not args.backends_file:
        _parser().error("give --backend URL (repeatable) or --backends-file FILE")
    try:
        force = parse_force_sampling(args.force_sampling)
    except ValueError as exc:
        _parser().error(str(exc))
    token = args.control_token or os.environ.get("STEPTAP_CONTROL_TOKEN", "")
    return ProxyConfig(
        backend=args.backend[0] if args.backend else "",
        backends=args.backend[1:],
        backends_file=args.backends_file,
        health_interval_s=args.health_interval,
        swap_drain_timeout_s=args.swap_drain_timeout,
        reuse_port=args.reuse_port,
        worker_port=args.worker_port,
        refuse_swaps=args.refuse_swaps,
        backend_api_key=args.backend_api_key or os.environ.get("STEPTAP_BACKEND_API_KEY") or None,
        host=args.host,
        port=args.port,
        log=args.log,
        control_token=token,
        public_url=args.public_url,
        any_model=args.any_model,
        auto_create=not args.no_auto_create,
        force_sampling=force,
        reward=args.reward,
        reward_timeout_s=args.reward_timeout,
        session_idle_timeout_s=args.session_idle_timeout,
        group_timeout_s=args.group_timeout,
        upstream_timeout_s=args.upstream_timeout,
        model_dir=args.model_dir,
        sampling_defaults=generation_defaults(args.model_dir) if args.model_dir else {},
        metrics_need_token=args.metrics_need_token,
    )


def main(argv: list[str] | None = None) -> int:
    from aiohttp import web

    from steptap.middleware.app import create_app
    from steptap.middleware.auth import CONTROL_TOKEN_KEY

    argv = sys.argv[1:] if argv is None else argv
    config = config_from_args(argv)
    workers = _parser().parse_args(argv).workers
    if workers > 1:
        from steptap.middleware.workers import run_workers

        return run_workers(config, list(argv), workers)
    logging.basicConfig(
        level=os.environ.get("STEPTAP_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    app = create_app(config)
    token = app[CONTROL_TOKEN_KEY]
    backends = ", ".join(filter(None, [config.backend, *config.backends, config.backends_file]))
    print(f"steptap proxy on {config.base_url()} -> {backends}; log: {config.log}", flush=True)
    if not config.control_token:
        print(f"control token (generated): {token}", flush=True)
    if config.reuse_port or config.worker_port:
        asyncio.run(_serve_worker(app, config))
    else:
        web.run_app(app, host=config.host, port=config.port, print=None, access_log=None)
    return 0


async def _serve_worker(app: Any, config: ProxyConfig) -> None:
    """One worker: the shared port (SO_REUSEPORT) and its own, until SIGTERM/SIGINT."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port).start()
    if config.worker_port:
        await web.TCPSite(runner, config.host, config.worker_port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
