"""``create_app(config)``: wiring only. Routes, ``AppKey``s, and one ``cleanup_ctx`` per resource (the
replica pool, the trajectory log with the session manager, the weight swapper, background tasks)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from steptap.middleware.auth import CONTROL_TOKEN_KEY, generate_token
from steptap.middleware.backend.pool import POOL_KEY, ReplicaCollector, ReplicaPool
from steptap.middleware.config import CONFIG_KEY, ProxyConfig
from steptap.middleware.console import routes as console
from steptap.middleware.errors import error_middleware
from steptap.middleware.log import stream
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import METRICS_KEY, Metrics, metrics_handler
from steptap.middleware.proxy import gemini_routes, relay, routes, vision
from steptap.middleware.proxy.call_state import CALL_STATES_KEY, CallStates
from steptap.middleware.proxy.protocols import STORE_KEY
from steptap.middleware.proxy.responses import ResponseStore
from steptap.middleware.proxy.services import SERVICES_KEY, Services
from steptap.middleware.sessions import control
from steptap.middleware.sessions.control import SESSIONS_KEY
from steptap.middleware.sessions.manager import SessionManager
from steptap.middleware.sessions.rewards import RewardFn, load_reward
from steptap.middleware.weights import routes as weights
from steptap.middleware.weights.routes import SWAPPER_KEY
from steptap.middleware.weights.swapper import WeightSwapper

logger = logging.getLogger("steptap.proxy")

TASKS_KEY = web.AppKey("steptap_tasks", set)  # background tasks; shutdown drains them
REWARD_KEY: web.AppKey[RewardFn | None] = web.AppKey("steptap_reward_fn")  # the --reward callback, or None


def create_app(config: ProxyConfig, *, reward_fn: RewardFn | None = None) -> web.Application:
    # A body is recorded in its step: one larger than a log record could never be recorded (aiohttp's default
    # of 1 MiB is far too small for long agent histories); max_request_bytes bounds what one call may decode.
    metrics = Metrics()
    app = web.Application(middlewares=[_call_counter(metrics), error_middleware],
                          client_max_size=config.body_limit)
    app[CONFIG_KEY] = config
    app[CONTROL_TOKEN_KEY] = config.control_token or generate_token()
    app[METRICS_KEY] = metrics
    app[TASKS_KEY] = set()
    app[vision.IMAGE_MEMORY_KEY] = vision.ImageMemory(config.max_image_memory)
    pool = app[POOL_KEY] = ReplicaPool(config)
    app[control.TITO_SUPPORT_KEY] = pool
    # conversations behind previous_response_id (a worker's own: its ids name its port)
    app[STORE_KEY] = ResponseStore(worker_port=config.worker_port,
                                   shared_port=config.port if config.worker_port else None)
    swapper = WeightSwapper(pool.configured(), model_dir=config.model_dir, api_key=config.backend_api_key,
                            drain_timeout_s=config.swap_drain_timeout_s, mode=config.swap_mode)
    swapper.pool = pool
    app[SWAPPER_KEY] = swapper
    app[METRICS_KEY].registry.register(weights.WeightsCollector(swapper))
    app[METRICS_KEY].registry.register(ReplicaCollector(pool))
    app[REWARD_KEY] = (
        reward_fn if reward_fn is not None else (load_reward(config.reward) if config.reward else None)
    )
    app.cleanup_ctx.extend([_upstream_ctx, _log_ctx, _swapper_ctx, _tasks_ctx, _images_ctx])

    r = app.router
    for prefix in ("", "/s/{agent_session}"):
        r.add_post(prefix + "/v1/chat/completions", relay.chat_completions)
        r.add_post(prefix + "/v1/completions", relay.completions)
        r.add_post(prefix + "/v1/responses", relay.responses)
        r.add_post(prefix + "/v1/messages", relay.messages)
        r.add_post(prefix + "/v1/messages/count_tokens", routes.count_tokens)
        r.add_get(prefix + "/v1/models", routes.models)
        gemini_routes.add_routes(r, prefix)  # Google's Gemini API
    r.add_route("HEAD", "/", routes.base_probe)
    r.add_route("HEAD", "/s/{agent_session}", routes.base_probe)
    r.add_route("*", "/s/{agent_session}/{tail:.*}", control.agent_path_forbidden)
    r.add_get("/health", routes.health)
    r.add_get("/metrics", metrics_handler)
    r.add_post("/admin/weights", weights.admin_weights)
    control.add_routes(app)
    stream.add_routes(app)
    console.add_routes(app)
    return app


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    pool = app[POOL_KEY]
    await pool.start()
    yield
    await pool.close()


async def _log_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    log = await TrajectoryLog.open(
        config.log, max_record_bytes=config.max_record_bytes, upload_interval_s=config.log_upload_interval_s,
        durability=config.log_durability,
    )
    try:
        manager = SessionManager(config, log, app[METRICS_KEY], app[REWARD_KEY], app[TASKS_KEY])
        reopened = await manager.rebuild()
        if reopened:
            logger.info("rebuilt %d open sessions from %s", reopened, config.log)
        app[SESSIONS_KEY] = manager
        states = app[CALL_STATES_KEY] = CallStates()  # what the proxy holds for each session between calls
        app[SERVICES_KEY] = Services(  # what a model call uses, looked up once a call
            config, manager, app[POOL_KEY], states, app[SWAPPER_KEY], app[METRICS_KEY],
            app[vision.IMAGE_MEMORY_KEY])
        app[stream.LOG_KEY] = log
        app[METRICS_KEY].watch_log(log)
        yield
    finally:
        await log.close()


async def _swapper_ctx(app: web.Application) -> AsyncIterator[None]:
    swapper = weights.swapper_of(app)
    swapper.log = app[stream.LOG_KEY]  # each new policy version is persisted in the log
    swapper.restore(app[stream.LOG_KEY].last_policy_version)  # the log's latest record: the whole state
    await swapper.start()
    # Each replica is admitted once reconciled with the persisted version (a proxy killed mid-swap can leave
    # vLLM paused, or on new weights under the old version); one that cannot be stays out, named in /health.
    pool = app[POOL_KEY]
    await pool.admit_all(swapper.reconcile)
    why = pool.tito_problem() if app[CONFIG_KEY].tito else None
    if why is not None:
        logger.warning("--tito: %s; its calls take the normal path (counted as no_scale_out)", why)
    loop = asyncio.get_running_loop()
    checker = loop.create_task(pool.health_loop(), name="steptap-replica-health")
    hup = False
    if app[CONFIG_KEY].backends_file:  # SIGHUP re-reads it (it is also re-read when it changes)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(signal.SIGHUP, pool.reload)
            hup = True
    yield
    if hup:
        loop.remove_signal_handler(signal.SIGHUP)
    checker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await checker
    await swapper.close()


async def _tasks_ctx(app: web.Application) -> AsyncIterator[None]:
    tasks = app[TASKS_KEY]
    sweeper = asyncio.get_running_loop().create_task(app[SESSIONS_KEY].sweeper(), name="steptap-sweeper")
    yield
    sweeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sweeper
    # persistence tasks (anonymous closes, failed steps, idle closes) finish before the log closes
    while tasks:
        await asyncio.gather(*list(tasks), return_exceptions=True)


async def _images_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    app[vision.IMAGE_MEMORY_KEY].close()  # its decoding threads (a decode in progress is not waited for)


def _call_counter(metrics: Metrics) -> Middleware:
    """Every request counted by its route and status (the metrics bound here: no app lookup a request)."""

    @web.middleware
    async def count_calls(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            metrics.calls[route, str(status)] += 1

    return count_calls
