"""The console's routes (docs/console.md): the page (``/console/``, static files shipped in the wheel), the
JSON it polls (``/console/api/...``), curation (``POST /sessions/<id>/curation``, also under the console's
path for the page), a person's rating (the rewards route's, under the console's path) and the learner's
lookup of marks (``POST /curation/lookup``).

Nothing here renders what an agent sent: the page builds the DOM with ``textContent`` only, and every
response forbids inline scripts (``Content-Security-Policy``), so a ``<script>`` in a message stays text."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from steptap.middleware.console import vitals
from steptap.middleware.console.access import (
    ACCESS_KEY,
    Access,
    Role,
    require_act,
    require_view,
    role_of,
    set_cookie,
    token_role,
)
from steptap.middleware.console.index import RunIndex
from steptap.middleware.console.summary import Rate, dump, run_summary
from steptap.middleware.curation import CurationBody, LookupBody, fold
from steptap.middleware.delta import full_trajectory
from steptap.middleware.errors import ApiError
from steptap.middleware.log.stream import LOG_KEY
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.records import Curation, Trajectory, to_builtins
from steptap.middleware.sessions.control import SESSIONS_KEY, RewardBody, give_reward

logger = logging.getLogger("steptap.console")

STATIC = Path(__file__).parent / "static"
FILES = {"index.html": "text/html", "console.js": "text/javascript", "console.css": "text/css"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
                               "base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}
INDEX_KEY = web.AppKey("steptap_console_index", RunIndex)
RATE_KEY = web.AppKey("steptap_console_rate", Rate)


class LoginBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    code: str | None = None
    token: str | None = None


class CodeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Role = "viewer"


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=dump(data), status=status, content_type="application/json", headers=HEADERS)


def _decode(raw: bytes, type_: type[Any]) -> Any:
    try:
        return msgspec.json.decode(raw or b"{}", type=type_)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid body: {exc}", "invalid_body") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None


# ---- the page ----------------------------------------------------------------------------------------------

async def page(request: web.Request) -> web.StreamResponse:
    name = request.match_info.get("name") or "index.html"
    if name not in FILES:
        raise ApiError(404, f"no console file {name[:64]!r}", "not_found")
    return web.Response(body=(STATIC / name).read_bytes(), content_type=FILES[name], headers=HEADERS)


async def to_page(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/console/")


async def login(request: web.Request) -> web.Response:
    body: LoginBody = _decode(await request.read(), LoginBody)
    access = request.app[ACCESS_KEY]
    role = access.redeem(body.code) if body.code else token_role(request, body.token)
    if role is None:
        raise ApiError(401, "that code is spent, expired or unknown (or the token is wrong)", "unauthorized")
    response = _json({"role": role})
    set_cookie(request, response, access.open_session(role))
    return response


async def logout(request: web.Request) -> web.Response:
    request.app[ACCESS_KEY].close_session(request.cookies.get("steptap_console", ""))
    response = _json({"role": None})
    response.del_cookie("steptap_console", path="/console")
    return response


async def me(request: web.Request) -> web.Response:
    return _json({"role": require_view(request)})


async def mint_code(request: web.Request) -> web.Response:
    """A one-time login code (the control token only: ``steptap up`` prints a link with one)."""
    require_act(request)
    body: CodeBody = _decode(await request.read(), CodeBody)
    code = request.app[ACCESS_KEY].mint_code(body.role)
    return _json({"role": body.role, "code": code, "path": f"/console/#code={code}"}, status=201)


# ---- the JSON it polls -------------------------------------------------------------------------------------

async def summary(request: web.Request) -> web.Response:
    require_view(request)
    await request.app[INDEX_KEY].current()
    return _json(await run_summary(request.app, request.app[INDEX_KEY], request.app[RATE_KEY]))


def _number(q: Any, key: str) -> float | None:
    value = q.get(key)
    if value in (None, ""):
        return None
    try:
        return float(value)
    except ValueError:
        raise ApiError(400, f"{key!r} must be a number", "invalid_parameter") from None


async def sessions(request: web.Request) -> web.Response:
    require_view(request)
    q = request.query
    limit = int(_number(q, "limit") or 100)
    if not 1 <= limit <= 1000:
        raise ApiError(400, "'limit' must be 1 to 1000", "invalid_parameter")
    excluded = {"1": True, "0": False}.get(q.get("excluded", ""))
    status, text = q.get("status") or None, q.get("q") or None
    manager, index = request.app[SESSIONS_KEY], request.app[INDEX_KEY]
    await index.current()
    rows = []
    if excluded is None and not q.get("tag"):
        # open sessions, then held ones (finished, their reward pending: not in the index until released)
        live = [(t, "running") for t in (s.trajectory for s in manager.sessions.values())]
        held = [(h.trajectory, "pending") for h in manager.held.values()]
        for t, shown in (live if status in (None, "running") else [])[-limit:] + (
                held if status in (None, "pending") else [])[-limit:]:
            if (q.get("group") and t.group_id != q["group"]) or (text and text.lower() not in t.id.lower()):
                continue
            rows.append({"id": t.id, "group_id": t.group_id, "status": shown, "mode": t.mode,
                         "reward": t.reward, "steps": len(t.step_refs) or len(t.steps),
                         "created_at": t.created_at, "curation": to_builtins(index.state(t.id))})
    rows += index.query(
        group=q.get("group") or None, status=status, mode=q.get("mode") or None,
        min_reward=_number(q, "min_reward"), max_reward=_number(q, "max_reward"), text=text,
        tag=q.get("tag") or None, excluded=excluded, limit=limit)
    return _json({"sessions": rows[:limit]})


async def _trajectory(request: web.Request, sid: str) -> Trajectory:
    manager = request.app[SESSIONS_KEY]
    live = manager.sessions.get(sid)
    if live is not None:
        return full_trajectory(live.trajectory)
    # Just finished: in memory (the index reads its record from the log on the next read)
    done = manager.recent.get(sid)
    if done is not None:
        return full_trajectory(done)
    held = manager.held.get(sid)
    if held is not None:  # its reward pending, no longer in memory: its steps from the log
        try:
            return await asyncio.to_thread(request.app[LOG_KEY].with_steps, held.trajectory)
        except (ValueError, msgspec.DecodeError):
            raise ApiError(404, f"trajectory {sid[:128]!r} is held but its steps are gone",
                           "not_found") from None
    await request.app[INDEX_KEY].current()
    traj = await request.app[INDEX_KEY].trajectory(sid)
    if traj is None:
        raise ApiError(404, f"no trajectory {sid[:128]!r} in this proxy's log", "not_found")
    return traj


async def tasks(request: web.Request) -> web.Response:
    """The task solve grid (``steptap tasks`` episodes, by their metadata's task identity)."""
    require_view(request)
    await request.app[INDEX_KEY].current()
    return _json(request.app[INDEX_KEY].task_grid())


async def trajectory(request: web.Request) -> web.Response:
    require_view(request)
    sid = request.app[SESSIONS_KEY].canonical_id(request.match_info["session_id"])
    traj = await _trajectory(request, sid)
    data = to_builtins(traj)
    data["reward"] = traj.reward
    index = request.app[INDEX_KEY]
    data["curation"] = to_builtins(index.state(sid))
    data["marks"] = msgspec.to_builtins(index.marks.get(sid, []))
    data["pending"] = request.app[SESSIONS_KEY].pending_state(sid)  # its reward awaited (null: not held)
    return _json(data)


async def rate(request: web.Request) -> web.Response:
    """A person's rating from the page: the rewards route's, always with ``source: "human"`` (on a held
    trajectory it releases it to the learner)."""
    require_act(request)
    manager = request.app[SESSIONS_KEY]
    body: RewardBody = _decode(await request.read(), RewardBody)
    body = msgspec.structs.replace(body, source="human")
    return _json(await give_reward(manager, manager.canonical_id(request.match_info["session_id"]), body))


# ---- curation ----------------------------------------------------------------------------------------------

async def curate(request: web.Request) -> web.Response:
    require_act(request)
    manager, index = request.app[SESSIONS_KEY], request.app[INDEX_KEY]
    sid = manager.canonical_id(request.match_info["session_id"])
    body: CurationBody = _decode(await request.read(), CurationBody)
    why = body.check()
    if why:
        raise ApiError(400, why, "invalid_body")
    live = manager.sessions.get(sid)
    await index.current()
    known = index.summaries.get(sid)
    if live is None and known is None and sid not in manager.closed:
        raise ApiError(404, f"no session {sid[:128]!r}", "not_found")
    steps = len(live.trajectory.steps) if live is not None else known.steps if known is not None else None
    if body.step is not None and steps is not None and body.step >= steps and live is None:
        raise ApiError(400, f"step {body.step} is beyond the trajectory's {steps} steps", "invalid_body")
    if not index.room_for_mark(sid):
        raise ApiError(409, "this trajectory has too many marks already", "too_many_marks")
    _, by_cookie = role_of(request)
    mark = Curation(trajectory_id=sid, step=body.step, action=body.action, value=body.value, name=body.name,
                    tags=body.tags, reason=body.reason, by="console" if by_cookie else "api")
    await request.app[LOG_KEY].append(mark)  # durable before it counts
    index.add_mark(mark)
    metrics = request.app[METRICS_KEY]
    metrics.child(metrics.curation_marks, body.action, "trajectory" if body.step is None else "step").inc()
    return _json({"trajectory_id": sid, "mark": to_builtins(mark), "curation": to_builtins(index.state(sid))},
                 status=201)


async def lookup(request: web.Request) -> web.Response:
    """The marks of the trajectories the learner is about to train (and what they fold into)."""
    require_act(request)
    body: LookupBody = _decode(await request.read(), LookupBody)
    index = request.app[INDEX_KEY]
    marks = {tid: index.marks[tid] for tid in body.ids if tid in index.marks}
    return _json({"marks": {tid: msgspec.to_builtins(m) for tid, m in marks.items()},
                  "state": {tid: to_builtins(fold(m)) for tid, m in marks.items()}})


# ---- wiring ------------------------------------------------------------------------------------------------

async def _index_ctx(app: web.Application) -> AsyncIterator[None]:
    index = app[INDEX_KEY] = RunIndex(app[LOG_KEY])
    await asyncio.to_thread(index.load)  # then brought up to date on each read (RunIndex.current)
    yield


def add_routes(app: web.Application) -> None:
    """Call after the cleanup_ctx that opens the log is registered (the index reads it)."""
    app[ACCESS_KEY] = Access()
    app[RATE_KEY] = Rate()
    app[vitals.TAIL_KEY] = vitals.LearnerTail()
    app[METRICS_KEY].registry.register(vitals.HealthCollector(app))  # the run's health in /metrics
    app.cleanup_ctx.append(_index_ctx)
    r = app.router
    r.add_get("/console", to_page)
    r.add_get("/console/", page)
    r.add_get("/console/static/{name}", page)
    r.add_post("/console/api/login", login)
    r.add_post("/console/api/logout", logout)
    r.add_get("/console/api/me", me)
    r.add_post("/console/api/codes", mint_code)
    r.add_get("/console/api/summary", summary)
    r.add_get("/console/api/sessions", sessions)
    r.add_get("/console/api/tasks", tasks)
    r.add_get("/console/api/sessions/{session_id}", trajectory)
    r.add_post("/console/api/sessions/{session_id}/curation", curate)
    r.add_post("/console/api/sessions/{session_id}/rewards", rate)
    r.add_post("/sessions/{session_id}/curation", curate)
    r.add_post("/curation/lookup", lookup)
