"""Control routes (who may call them: docs/SECURITY.md): open sessions, read them, rewards, finish, groups.

Every route needs the control token (``auth.require_control``). Bodies are validated completely before
anything changes: an error leaves the session as it was.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

import msgspec
from aiohttp import web

from steptap.middleware.auth import require_control
from steptap.middleware.delta import full_trajectory
from steptap.middleware.errors import ApiError
from steptap.middleware.exceptions import SessionEvicted, SessionNotFound
from steptap.middleware.records import InfraCause, Mode, TaskRun, TrainOn, json_encoder, to_builtins
from steptap.middleware.sessions.closing import Ended
from steptap.middleware.sessions.identity import valid_session_id
from steptap.middleware.sessions.manager import SessionManager
from steptap.middleware.sessions.rewards import finite
from steptap.middleware.sessions.session import AUTO_PREFIX, LiveSession

_encode = json_encoder.encode

SESSIONS_KEY = web.AppKey("steptap_sessions", SessionManager)


class TitoSupport(Protocol):
    """Whether the backends can run token-in-token-out sessions (the replica pool answers)."""

    def tito_problem(self) -> str | None: ...


TITO_SUPPORT_KEY = web.AppKey("steptap_tito_support", TitoSupport)


class OpenBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: str | None = None
    group_id: str | None = None
    group_size: int | None = None
    mode: Mode = "train"
    metadata: dict[str, Any] = {}
    idle_timeout_s: float | None = None
    tito: bool = False  # token-in-token-out mode (vLLM --enable-scale-out)
    train: TrainOn = "main"  # which steps the learner trains on: the main line (and branches) or all
    side_models: Annotated[list[Annotated[str, msgspec.Meta(max_length=256)]],
                           msgspec.Meta(max_length=32)] = []


# A reward's provenance: at most 16 flat entries, short keys and short string values (a judge's model, prompt
# hash, rubric hash, scale): bounded, so it cannot grow a trajectory record by more than a few KiB
_ProvKey = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
_ProvValue = Annotated[str, msgspec.Meta(max_length=512)] | int | float | bool | None
ProvenanceBody = Annotated[dict[_ProvKey, _ProvValue], msgspec.Meta(max_length=16)]


class RewardBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    value: float
    name: str = "reward"
    step: int | Literal["last"] | None = None
    source: Literal["http", "human"] = "http"  # "human": a person's rating (the console, a feedback script)
    provenance: ProvenanceBody = {}  # what made it (a judge: model, prompt and rubric hashes), kept by name


MAX_ERROR = 2000  # characters of a finish's reason
MAX_OUTPUT = 16384  # characters of a task process's output tail


class FinishBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # "pending": the trajectory is held off the stream until its reward arrives or the deadline passes
    reward: float | Literal["pending"] | None = None
    # "infra_error": it failed for a reason that is not the agent's (docs/tasks.md): no reward, never trained
    status: Literal["finished", "aborted", "infra_error"] = "finished"
    deadline_s: float | None = None  # with "pending": seconds from now (default: --reward-deadline-s)
    on_deadline: Literal["drop"] | float = "drop"  # with "pending": drop it, or release it with this reward
    # why it ended as it did (an aborted session: the judge that failed, the grader that crashed; an
    # infra_error's reason), kept on the trajectory
    error: Annotated[str, msgspec.Meta(max_length=MAX_ERROR)] | None = None
    infra_cause: InfraCause | None = None  # with infra_error (default "other")
    task_run: TaskRun | None = None  # a task episode's agent and verifier, as they ended


def _decode(raw: bytes, type_: type[Any], empty_ok: bool = False) -> Any:
    if not raw.strip():
        if empty_ok:
            return type_()
        raise ApiError(400, "request body is empty (a JSON object is expected)", "invalid_body")
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid body: {exc}", "invalid_body") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encode(data), status=status, content_type="application/json")


def _session(request: web.Request) -> LiveSession:
    manager = request.app[SESSIONS_KEY]
    return manager.get(manager.canonical_id(request.match_info["session_id"]))


async def open_session(request: web.Request) -> web.Response:
    require_control(request)
    body: OpenBody = _decode(await request.read(), OpenBody, empty_ok=True)
    if body.id is not None and not valid_session_id(body.id):
        raise ApiError(
            400, "invalid session id (letters, digits, '.', '_', ':', '-'; at most 128)", "invalid_session_id"
        )
    if body.id is not None and body.id.startswith(AUTO_PREFIX):
        raise ApiError(400, f"session ids starting with {AUTO_PREFIX!r} are auto-created ones",
                       "invalid_session_id")
    if body.group_size is not None and body.group_size < 1:
        raise ApiError(400, "group_size must be at least 1", "invalid_body")
    if body.idle_timeout_s is not None and not body.idle_timeout_s > 0:
        raise ApiError(400, "idle_timeout_s must be positive", "invalid_body")
    support = request.app.get(TITO_SUPPORT_KEY)
    why = support.tito_problem() if body.tito and support is not None else None
    if why is not None:  # an older vLLM (backend/capabilities.py): refused now, not turn by turn
        raise ApiError(501, why, "not_supported")
    manager = request.app[SESSIONS_KEY]
    session = await manager.open(
        group_id=body.group_id,
        group_size=body.group_size,
        mode=body.mode,
        metadata=body.metadata,
        idle_timeout_s=body.idle_timeout_s,
        session_id=body.id,
        tito=body.tito,
        train=body.train,
        side_models=body.side_models,
    )
    return _json(manager.summary(session, str(request.url.origin())), status=201)


async def get_session(request: web.Request) -> web.Response:
    require_control(request)
    manager = request.app[SESSIONS_KEY]
    sid = manager.canonical_id(request.match_info["session_id"])
    session = manager.sessions.get(sid)
    traj = session.trajectory if session is not None else manager.recent.get(sid)
    if traj is None and sid in manager.held:  # held, its steps no longer in memory: the record, steps as refs
        data = to_builtins(manager.held[sid].trajectory)
        data["reward_pending"] = manager.pending_state(sid)
        return _json(data)
    if traj is None:
        if sid in manager.closed:
            raise SessionEvicted(f"session {sid!r} is {manager.closed[sid]}; read it from the stream")
        raise SessionNotFound(f"no session {sid!r}")
    data = to_builtins(full_trajectory(traj))  # the session holds delta steps; readers get full ones
    data["reward"] = traj.reward
    pending = manager.pending_state(sid)
    if pending is not None:
        data["reward_pending"] = pending
    if traj.group_id is not None and traj.group_id in manager.groups:
        data["group"] = manager.groups[traj.group_id].state()
    return _json(data)


async def post_reward(request: web.Request) -> web.Response:
    require_control(request)
    manager = request.app[SESSIONS_KEY]
    body: RewardBody = _decode(await request.read(), RewardBody)
    return _json(await give_reward(manager, manager.canonical_id(request.match_info["session_id"]), body))


async def give_reward(manager: SessionManager, sid: str, body: RewardBody) -> dict[str, Any]:
    """A reward on an open session; on a held one (finished with its reward pending) it releases the
    trajectory to the stream; on one already streamed it is recorded as late (never trained). The caller
    checked who asks (the control token here, the console's control role in ``console/routes.py``)."""
    try:
        value = finite(body.value)
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_reward") from None
    if not body.name or len(body.name) > 64:
        raise ApiError(400, "reward name must be 1 to 64 characters", "invalid_body")
    if isinstance(body.step, int) and body.step < 0:
        raise ApiError(400, 'step must be a non-negative index or "last"', "invalid_body")
    if sid in manager.held:
        if body.step is not None:
            raise ApiError(400, "this session's reward is pending: it takes a trajectory-level reward "
                           "(no step)", "invalid_body")
        if await manager.release(sid, value, body.name, body.source, body.provenance) is not None:
            return {"session_id": sid, "name": body.name, "value": value, "step": None, "released": True}
    if sid not in manager.sessions and sid in manager.closed:
        record = await manager.late_reward(sid, value, body.name, body.step, body.source, body.provenance)
        return {"session_id": sid, "name": record.name, "value": record.value, "step": record.step,
                "late": True}
    session = manager.get(sid)
    record = await manager.add_reward(session, value, body.name, body.step, body.source, body.provenance)
    return {"session_id": session.id, "name": record.name, "value": record.value, "step": record.step}


async def finish_session(request: web.Request) -> web.Response:
    require_control(request)
    session = _session(request)
    body: FinishBody = _decode(await request.read(), FinishBody, empty_ok=True)
    manager = request.app[SESSIONS_KEY]
    reward = None
    hold = _hold(body, manager)
    if body.reward is not None and body.reward != "pending":
        try:
            reward = finite(body.reward)
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_reward") from None
    traj = await manager.finish(session, body.status, reward, hold, _ended(body))
    data = {"id": traj.id, "status": traj.status, "steps": len(traj.steps), "rewards": traj.rewards,
            "reward": traj.reward, "error": traj.error, "infra_cause": traj.infra_cause}
    pending = manager.pending_state(traj.id)
    if pending is not None:
        data["reward_pending"] = pending
    return _json(data)


def _ended(body: FinishBody) -> Ended | None:
    """A finish's reason, infrastructure cause and task run, checked; None when it gives none."""
    if body.status == "infra_error":
        if body.reward is not None:
            raise ApiError(400, "an infrastructure error has no reward (it is never trained)", "invalid_body")
        if not body.error:
            raise ApiError(400, 'status "infra_error" needs its reason in "error"', "invalid_body")
    elif body.infra_cause is not None:
        raise ApiError(400, 'infra_cause goes with "status": "infra_error"', "invalid_body")
    elif body.error is not None and body.status == "finished":
        raise ApiError(400, 'error goes with "status": "aborted" or "infra_error"', "invalid_body")
    run = body.task_run
    for end in (run.agent, run.verifier) if run is not None else ():
        if end is not None and len(end.output) > MAX_OUTPUT:
            raise ApiError(400, f"a task process's output is at most {MAX_OUTPUT} characters (its tail)",
                           "invalid_body")
    if body.error is None and run is None:
        return None
    cause = (body.infra_cause or "other") if body.status == "infra_error" else None
    return Ended(error=body.error, infra_cause=cause, task_run=run)


def _hold(body: FinishBody, manager: SessionManager) -> tuple[float, float | Literal["drop"]] | None:
    """A pending finish's deadline (unix seconds) and what it does, checked; None for any other finish."""
    if body.reward != "pending":
        if body.deadline_s is not None or body.on_deadline != "drop":
            raise ApiError(400, 'deadline_s and on_deadline go with "reward": "pending"', "invalid_body")
        return None
    if body.status != "finished":
        raise ApiError(400, 'an aborted session has no pending reward ("reward": "pending" needs '
                       '"status": "finished")', "invalid_body")
    cap = manager.config.max_reward_deadline_s
    if body.deadline_s is not None and not 0 < body.deadline_s <= cap:
        raise ApiError(400, f"deadline_s must be positive and at most {cap:g} (max_reward_deadline_s)",
                       "invalid_body")
    on_deadline = body.on_deadline
    if on_deadline != "drop":
        try:
            on_deadline = finite(on_deadline)
        except ValueError as exc:
            raise ApiError(400, f"on_deadline: {exc}", "invalid_reward") from None
    return manager.deadline_at(body.deadline_s), on_deadline


async def get_group(request: web.Request) -> web.Response:
    require_control(request)
    return _json(request.app[SESSIONS_KEY].group(request.match_info["group_id"]).state())


async def agent_path_forbidden(request: web.Request) -> web.Response:
    """Anything under an agent's session URL that is not a model route: the agent holds no control rights (an
    unknown ``v1/`` route is a plain 404: it is a model route this proxy does not serve)."""
    if request.match_info.get("tail", "").startswith("v1/"):
        raise ApiError(404, f"no route {request.method} /{request.match_info['tail']}", "not_found")
    raise ApiError(403, "an agent session URL can make model calls only", "forbidden")


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/sessions", open_session)
    r.add_get("/sessions/{session_id}", get_session)
    r.add_post("/sessions/{session_id}/rewards", post_reward)
    r.add_post("/sessions/{session_id}/finish", finish_session)
    r.add_get("/groups/{group_id}", get_group)
