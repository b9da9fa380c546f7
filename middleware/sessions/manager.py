"""``SessionManager``: opens sessions, ties model calls to them, appends their steps, rewards and closing
records to the trajectory log, enforces idle timeouts, tracks groups, and rebuilds open sessions from the log
after a restart.

Ordering: a step's ``index`` is given when its reply is complete (completion order), synchronously, so
concurrent calls on one session get consecutive indexes and each step's ``prefix`` is judged against the step
indexed just before it. Every record is durable (``await log.append``) before the call that caused it answers.

Linear space (``delta.py``): a session holds, and logs, its steps in their delta form (a step that extends the
previous call keeps only its new ids and messages), plus the full form of its latest call (what the next one
is judged against); its closing ``Trajectory`` record refers to the logged steps. Readers get full steps
(``GET /sessions/<id>``, the reward callback, the stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any, Protocol

import msgspec

from steptap.middleware.auth import SESSION_KEY_PREFIX
from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import (
    GroupNotFound,
    LogUnavailable,
    RecordTooLarge,
    SessionClosed,
    SessionExists,
    SessionFull,
    SessionNotFound,
    StepNotFound,
    UnknownSessionKey,
    WrongSessionKey,
)
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.limits import RECORD_SLACK, Holdings
from steptap.middleware.metrics import Metrics
from steptap.middleware.sessions.classify import Decision, MainLine, advance
from steptap.middleware.sessions.classify import apply as classify_call
from steptap.middleware.sessions.prefix import classify_after, extends
from steptap.middleware.delta import DeltaError, Expander, compress, full_trajectory
from steptap.middleware.records import (
    LogRecord,
    Mode,
    PolicyVersion,
    RewardAdded,
    SessionOpened,
    Step,
    StepRef,
    Trajectory,
    TrajectoryStatus,
    TrainOn,
    msgpack_encoder,
)
from steptap.middleware.sessions.rewards import RewardFn, run_reward

logger = logging.getLogger("steptap.sessions")

GROUP_RETENTION_S = 3600.0  # complete groups stay visible (GET /groups/<id>) this long
# Closed trajectories kept in memory for GET /sessions/<id> (in their held, delta form); the stream has them all.
RECENT_KEEP = 128
# A session id on the path or in the header that no POST /sessions opened is auto-created under this prefix:
# its own namespace, so an agent can never take an id the environment will open (POST /sessions refuses it).
AUTO_PREFIX = "auto:"


class Log(Protocol):
    async def append(self, record: LogRecord) -> str: ...

    async def append_at(self, record: LogRecord) -> tuple[str, str]: ...  # where it starts, where it ends

    def ensure_writable(self) -> None: ...  # raises while the log cannot write (a 503)

    def located_records(self) -> Any: ...  # (where it starts, record), in log order


class LiveSession:
    """An open session as the proxy holds it: its trajectory so far, its key, and its calls in flight."""

    __slots__ = ("bytes", "closing", "drained", "full", "inflight", "key", "last_active", "late", "lock",
                 "line", "pending", "sealed", "starts", "tito", "tito_state", "trajectory")

    def __init__(self, trajectory: Trajectory, key: str | None) -> None:
        self.tito = False  # token-in-token-out mode (proxy/tito.py), set at open
        self.tito_state: Any = None  # what its next turn extends in that mode
        self.trajectory = trajectory
        self.key = key  # None: auto-created (reached by its path or header id) or anonymous
        self.last_active = time.monotonic()
        self.inflight = 0
        self.drained: asyncio.Event | None = None  # set when the last call in flight ends (a finish waits on it)
        self.closing = False  # takes no new call or reward
        self.sealed = False  # its Trajectory record is being written: a step recorded now is not in it
        self.late = 0  # steps recorded after it was sealed (logged, each with an index of its own)
        self.pending = False  # auto-created, opened only when its first step is recorded (the backend accepted)
        self.bytes = 0  # encoded size of what it holds: its steps as logged (delta form), its metadata
        self.full: dict[int, Step] = {}  # the main line's latest call's ok steps in full form (index -> step):
        # the next call's prefix is judged against them, and a step that extends one is logged as a delta of it
        self.line = MainLine(side_models=frozenset(trajectory.side_models))  # its main line (classify.py)
        self.starts: dict[int, str | asyncio.Task[tuple[str, str]]] = {}  # index -> where its Step record
        # starts (its append while in flight): the closing Trajectory record refers to it
        self.lock = asyncio.Lock()  # serialises rewards and closing: a 200'd reward is in the trajectory

    @property
    def id(self) -> str:
        return self.trajectory.id


class Group:
    __slots__ = ("complete", "completed_at", "id", "members", "opened", "size")

    def __init__(self, group_id: str, size: int | None) -> None:
        self.id = group_id
        self.size = size
        self.members: dict[str, TrajectoryStatus] = {}
        self.opened = time.monotonic()
        self.complete: str | None = None  # None, "full" or "timeout"
        self.completed_at: float | None = None

    def state(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for status in self.members.values():
            counts[status] = counts.get(status, 0) + 1
        return {
            "id": self.id,
            "size": self.size,
            "members": dict(self.members),
            "counts": counts,
            "complete": self.complete is not None,
            "reason": self.complete,
        }


def new_key() -> str:
    return SESSION_KEY_PREFIX + secrets.token_urlsafe(24)


class SessionManager:
    def __init__(
        self,
        config: ProxyConfig,
        log: Log,
        metrics: Metrics,
        reward_fn: RewardFn | None,
        tasks: set[asyncio.Task[Any]],
    ) -> None:
        self.config = config
        self.log = log
        self.metrics = metrics
        self.reward_fn = reward_fn
        self._tasks = tasks  # the app's background tasks, drained at shutdown
        self.sessions: dict[str, LiveSession] = {}  # open named sessions by id
        self.auto_open = 0  # how many of them are auto-created (max_auto_sessions)
        self.pending: dict[str, LiveSession] = {}  # auto sessions whose first call is in flight (not yet opened)
        self.keys: dict[str, str] = {}  # session key -> id (kept after close, to answer 409 not 401)
        self.closed: dict[str, TrajectoryStatus] = {}  # id -> final status
        self.groups: dict[str, Group] = {}
        self.recent: OrderedDict[str, Trajectory] = OrderedDict()
        self.policy_versions: list[PolicyVersion] = []  # found by rebuild(), for the weight swapper
        self.holdings = Holdings(config, metrics)  # calls in flight, steps and bytes held, against the limits
        self.admitted = self.holdings.admitted  # around a model call: a 429 beyond max_concurrent_calls

    # ---- background work --------------------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _append(self, record: LogRecord) -> str:
        return (await self._append_at(record))[1]

    async def _append_at(self, record: LogRecord) -> tuple[str, str]:
        t0 = time.perf_counter()
        cursors = await self.log.append_at(record)
        self.metrics.log_commit.observe(time.perf_counter() - t0)
        return cursors

    # ---- opening and resolving ---------------------------------------------------------------------------

    async def open(
        self,
        *,
        group_id: str | None = None,
        group_size: int | None = None,
        mode: Mode = "train",
        metadata: dict[str, Any] | None = None,
        idle_timeout_s: float | None = None,
        session_id: str | None = None,
        keyed: bool = True,
        train: TrainOn = "main",
        side_models: list[str] | None = None,
    ) -> LiveSession:
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions or sid in self.closed:
            raise SessionExists(f"session {sid!r} already exists")
        self.holdings.check_open(len(self.sessions) - self.auto_open)
        if idle_timeout_s is None:
            idle_timeout_s = self.config.session_idle_timeout_s
        traj = Trajectory(
            id=sid,
            group_id=group_id,
            group_size=group_size,
            mode=mode,
            metadata=metadata or {},
            idle_timeout_s=idle_timeout_s,
            train=train,
            side_models=list(side_models or ()),
        )
        session = LiveSession(traj, new_key() if keyed else None)
        session.bytes = len(msgpack_encoder.encode(traj))
        if session.bytes > self.config.max_session_bytes:  # its Trajectory record could never be written
            raise RecordTooLarge(
                f"session metadata of {session.bytes} bytes exceeds max_session_bytes={self.config.max_session_bytes}"
            )
        self._register(session)  # before the await: a concurrent open of the same id sees it
        try:
            await self._append(
                SessionOpened(
                    trajectory_id=sid,
                    group_id=group_id,
                    group_size=group_size,
                    mode=mode,
                    metadata=traj.metadata,
                    idle_timeout_s=idle_timeout_s,
                    key=session.key,
                    train=train,
                    side_models=traj.side_models,
                )
            )
        except BaseException:
            self._unregister(session)
            raise
        self.metrics.sessions_opened.labels("false").inc()
        return session

    def canonical_id(self, sid: str) -> str:
        """The id a control route means: ``sid`` itself, or the auto-created session of that path id."""
        if sid in self.sessions or sid in self.closed or sid in self.recent:
            return sid
        auto = AUTO_PREFIX + sid
        return auto if auto in self.sessions or auto in self.closed or auto in self.recent else sid

    def _register(self, session: LiveSession) -> None:
        self.sessions[session.id] = session
        self.auto_open += session.id.startswith(AUTO_PREFIX)
        if session.key:
            self.keys[session.key] = session.id
        traj = session.trajectory
        if traj.group_id is not None:
            group = self.groups.get(traj.group_id)
            if group is None:
                group = self.groups[traj.group_id] = Group(traj.group_id, traj.group_size)
                self._prune()
            elif group.size is None:
                group.size = traj.group_size
            group.members[session.id] = traj.status
        self.metrics.sessions_open.set(len(self.sessions))
        self.holdings.hold(len(traj.steps), session.bytes)

    def _unregister(self, session: LiveSession) -> None:
        if self.sessions.pop(session.id, None) is not None:
            self.auto_open -= session.id.startswith(AUTO_PREFIX)
            self.holdings.hold(-len(session.trajectory.steps), -session.bytes)
        self.metrics.sessions_open.set(len(self.sessions))

    def get(self, sid: str) -> LiveSession:
        """An open session (404 when unknown, 409 when already closed)."""
        session = self.sessions.get(sid)
        if session is None:
            if sid in self.closed:
                raise SessionClosed(f"session {sid!r} is {self.closed[sid]}")
            raise SessionNotFound(f"no session {sid!r}")
        return session

    async def resolve(self, ident: Identity) -> LiveSession:
        """The session a model call belongs to; anonymous calls get a fresh one-step session."""
        if ident.source == "anonymous":
            traj = Trajectory(id="anon-" + uuid.uuid4().hex, anonymous=True)
            self.metrics.child(self.metrics.sessions_opened, "true").inc()
            return LiveSession(traj, None)
        if ident.source == "key":
            sid = self.keys.get(ident.key or "")
            if sid is None:
                raise UnknownSessionKey("unknown steptap session key")
            return self.get(sid)
        sid = ident.session_id or ""
        if sid in self.sessions or sid in self.closed:
            # Opened by POST /sessions: only its key reaches it (the id alone may be guessed or leaked).
            if ident.key is None or self.keys.get(ident.key) != sid:
                raise WrongSessionKey(
                    f"session {sid!r} was opened with a key: send it as the API key (Authorization: Bearer stk-...)"
                )
            return self.get(sid)
        if ident.key is not None and ident.key in self.keys:
            raise WrongSessionKey(f"this API key belongs to another session than {sid!r}")
        auto = AUTO_PREFIX + sid
        if auto not in self.sessions and auto not in self.closed:
            if not self.config.auto_create:
                raise SessionNotFound(f"no session {sid!r} (sessions are opened with POST /sessions)")
            return self._pending(auto)
        return self.get(auto)

    def _pending(self, sid: str) -> LiveSession:
        """An auto session not opened yet: it opens (``_open_pending``) with its first recorded step, so a call
        the backend refuses opens nothing. Concurrent first calls on one id share it."""
        session = self.pending.get(sid)
        if session is None:
            self.holdings.check_open(self.auto_open + len(self.pending), auto=True)
            traj = Trajectory(id=sid, idle_timeout_s=self.config.auto_session_idle_timeout_s)
            session = self.pending[sid] = LiveSession(traj, None)
            session.pending = True
            session.bytes = len(msgpack_encoder.encode(traj))
        return session

    async def _open_pending(self, session: LiveSession) -> None:
        session.pending = False
        self.pending.pop(session.id, None)
        self._register(session)  # before the await: the session's next steps follow its SessionOpened record
        try:
            traj = session.trajectory
            await self._append(SessionOpened(trajectory_id=session.id, idle_timeout_s=traj.idle_timeout_s))
        except BaseException:
            self._unregister(session)
            raise
        self.metrics.sessions_opened.labels("false").inc()

    @asynccontextmanager
    async def call(self, session: LiveSession, steps: int = 1, size: int = 0) -> AsyncIterator[None]:
        """Around one model call: a closing or full session takes none, and an idle timeout never closes a
        session while one of its calls is in flight. ``steps`` and ``size`` (the request body) are what the
        call will add at least; ``record`` enforces the exact limits."""
        if session.closing:
            raise SessionClosed(f"session {session.id!r} is closing")
        # Each of the call's steps records its request: n copies in the record (checked before forwarding).
        if not session.trajectory.anonymous:
            self.holdings.check_session_calls(session.id, session.inflight)
            self._check_room(session, steps, steps * size)
        elif steps * size > self.config.max_record_bytes:
            raise RecordTooLarge(
                f"{steps} choices of a {size}-byte request make a record over max_record_bytes="
                f"{self.config.max_record_bytes}"
            )
        session.inflight += 1
        session.last_active = time.monotonic()
        try:
            yield
        finally:
            session.inflight -= 1
            session.last_active = time.monotonic()
            if session.inflight == 0 and session.drained is not None:
                session.drained.set()
            if session.pending and session.inflight == 0:  # its calls ended with no step: never opened
                self.pending.pop(session.id, None)

    # ---- steps ---------------------------------------------------------------------------------------------

    def _check_room(self, session: LiveSession, steps: int, size: int) -> None:
        self.holdings.check_room(session.id, len(session.trajectory.steps), session.bytes, steps, size)

    @property
    def calls_inflight(self) -> int:
        return self.holdings.calls_inflight

    @property
    def steps_held(self) -> int:
        return self.holdings.steps_held

    @property
    def bytes_held(self) -> int:
        return self.holdings.bytes_held

    async def record(self, session: LiveSession, steps: list[Step]) -> None:
        """Index, link and append the steps of one call; returns once they are durable. A named session
        that the steps would take past its limits refuses them (SessionFull) before anything changes."""
        traj = session.trajectory
        if session.pending:
            await self._open_pending(session)
        # Continuity is judged against the main line's latest call's ok steps (a failed step carries no usable
        # ids, a side call is not on the line); the choices of one call share it.
        prev_call = list(session.full.values())
        for step in steps:
            step.prefix = classify_after(prev_call, step)
        line_before = dataclasses.replace(session.line)
        on_main = classify_call(session.line, steps, [s.prefix for s in steps], self.config.side_models)
        forms: list[Step] = []
        for offset, step in enumerate(steps):
            step.trajectory_id = traj.id
            step.group_id = traj.group_id
            step.index = len(traj.steps) + offset
            base = next((p for p in prev_call if extends(p, step)), None) if step.prefix == "extends" else None
            if session.sealed and not traj.anonymous:
                # Past the finish's bounded wait: logged whole under an index no step of the trajectory has.
                step.index = len(traj.steps) + session.late
                session.late += 1
                base = None
            forms.append(step if base is None else compress(step, base))  # what the log and session hold
        size = 0
        if not traj.anonymous and not session.sealed:
            size = self.holdings.size_of(forms)
            try:
                self._check_room(session, len(steps), size)
            except Exception:  # refused (full, too large): the main line stays where it was
                session.line = line_before
                raise
            session.bytes += size
            self.holdings.hold(len(steps), size)
        before = mine = session.full
        if on_main and any(s.status == "ok" for s in steps):
            session.full = mine = {s.index: s for s in steps if s.status == "ok"}
        for step, form in zip(steps, forms):
            if session.sealed and not traj.anonymous:
                logger.warning(
                    "step of session %s arrived after it was closed; logged, not in the trajectory", traj.id
                )
            else:
                traj.steps.append(form)
            m = self.metrics
            m.child(m.steps, step.status, "true" if traj.anonymous else "false").inc()
            m.child(m.prefix, step.prefix).inc()
            m.child(m.call_class, step.call_class, step.call_rule).inc()
            m.prompt_tokens.inc(len(step.prompt_token_ids))
            m.response_tokens.inc(len(step.response_token_ids))
        if traj.anonymous and self.reward_fn is None:
            # A one-step session closes with its step: one record, the finished Trajectory that holds it (its
            # steps are logged nowhere else: ``delta.steps_of`` finds them).
            session.closing = True
            self._finalize(traj, "finished")
            traj.steps_logged = False
            await self._append(traj)
            self._closed(session)
            return
        # Tasks, so the closing Trajectory record can wait for the ones in flight; concurrent appends share one
        # group commit.
        tasks = [asyncio.ensure_future(self._append_at(form)) for form in forms]
        for form, task in zip(forms, tasks):
            session.starts[form.index] = task
        try:
            await asyncio.gather(*tasks)
        except Exception:
            # Not durable (disk full, I/O error): the call fails, so its steps must not stay in the trajectory,
            # nor their bytes in what the session and the proxy hold.
            kept = [s for s in traj.steps if not any(s is x for x in forms)]
            if size:
                session.bytes -= size
                self.holdings.hold(len(kept) - len(traj.steps), -size)
            traj.steps = kept
            for form in forms:
                session.starts.pop(form.index, None)
            if session.full is mine:  # no later call has replaced it
                session.full, session.line = before, line_before
            raise
        for form, task in zip(forms, tasks):
            session.starts[form.index] = task.result()[0]
        if traj.anonymous:  # the reward callback may be slow: it runs after the reply, off the call's path
            self.spawn(self._close_logged(session, "finished"))

    # ---- rewards -----------------------------------------------------------------------------------------

    async def add_reward(
        self, session: LiveSession, value: float, name: str, step: int | str | None
    ) -> RewardAdded:
        """Validate everything first, then log, then apply: an error changes nothing. Under the session's
        lock, so a reward is either in the closing Trajectory record or refused (409)."""
        async with session.lock:
            return await self._add_reward_locked(session, value, name, step)

    async def _add_reward_locked(
        self, session: LiveSession, value: float, name: str, step: int | str | None
    ) -> RewardAdded:
        if session.closing:
            raise SessionClosed(f"session {session.id!r} is closing")
        steps = session.trajectory.steps
        index: int | None = None
        if step == "last":
            if not steps:
                raise StepNotFound("the session has no steps yet")
            index = len(steps) - 1
        elif step is not None:
            index = int(step)
            if not 0 <= index < len(steps):
                raise StepNotFound(f"no step {index} (the session has {len(steps)})")
        record = RewardAdded(trajectory_id=session.id, name=name, value=value, step=index)
        target = session.trajectory.rewards if index is None else steps[index].rewards
        size = 0 if name in target else len(name.encode()) + 16  # a new name grows the Trajectory record
        if session.bytes + size > self.config.max_session_bytes:
            raise SessionFull(
                f"session {session.id!r} holds {session.bytes} bytes; another reward name would pass "
                f"max_session_bytes={self.config.max_session_bytes}"
            )
        await self._append(record)
        self._apply_reward(session.trajectory, record)
        session.bytes += size
        self.holdings.hold(0, size)
        session.last_active = time.monotonic()
        self.metrics.rewards.labels("trajectory" if index is None else "step", "api").inc()
        return record

    @staticmethod
    def _apply_reward(traj: Trajectory, record: RewardAdded) -> None:
        if record.step is None:
            traj.rewards[record.name] = record.value
        elif 0 <= record.step < len(traj.steps):
            traj.steps[record.step].rewards[record.name] = record.value

    # ---- closing -----------------------------------------------------------------------------------------

    async def finish(
        self, session: LiveSession, status: TrajectoryStatus = "finished", reward: float | None = None
    ) -> Trajectory:
        async with session.lock:
            if session.closing:
                raise SessionClosed(f"session {session.id!r} is already closing")
            return await self._close_locked(session, status, None if reward is None else {"reward": reward})

    async def _close(self, session: LiveSession, status: TrajectoryStatus) -> Trajectory:
        async with session.lock:
            return await self._close_locked(session, status)

    async def _close_locked(self, session: LiveSession, status: TrajectoryStatus,
                            rewards: dict[str, float] | None = None) -> Trajectory:
        """Close: no new call, wait (bounded) for the calls in flight so their steps are in the trajectory, then
        one durable Trajectory record. A record the log refuses (degraded: 503) leaves the session as it was,
        open, so the finish can be retried; ``rewards`` (the finish's own) are applied only with the record."""
        session.closing = True
        traj = session.trajectory
        before = (dict(traj.rewards), traj.error)
        try:
            self.log.ensure_writable()  # a 503 before anything changes
            if session.inflight:
                session.drained = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(session.drained.wait(), self.config.finish_drain_timeout_s)
            traj.rewards.update(rewards or {})
            if self.reward_fn is not None:  # the callback sees full steps (they share their rewards with traj's)
                error = await run_reward(self.reward_fn, full_trajectory(traj), self.config.reward_timeout_s)
                if error is not None:
                    traj.error = error
                    self.metrics.reward_errors.labels("timeout" if "timed out" in error else "error").inc()
                    logger.warning("session %s: %s", traj.id, error)
            session.sealed = True
            self._finalize(traj, status)
            await self._append(await self._closing_record(session))
        except BaseException:
            session.closing = session.sealed = False
            traj.status, traj.finished_at = "running", None
            traj.rewards, traj.error = before
            raise
        self._closed(session)
        return traj

    @staticmethod
    async def _closing_record(session: LiveSession) -> Trajectory:
        """The session's Trajectory record: it refers to the steps' records (once their appends are done)."""
        traj = session.trajectory
        pending = [t for t in session.starts.values() if isinstance(t, asyncio.Task)]
        if pending:
            await asyncio.wait(pending)
        refs: list[StepRef] = []
        for step in traj.steps:
            at = session.starts.get(step.index)
            if isinstance(at, asyncio.Task):
                at = None if at.cancelled() or at.exception() is not None else at.result()[0]
            if at is not None:  # else its append failed: not durable, so not in the trajectory
                refs.append(StepRef(at=at, rewards=step.rewards))
        return msgspec.structs.replace(traj, steps=[], step_refs=refs)

    @staticmethod
    def _finalize(traj: Trajectory, status: TrajectoryStatus) -> None:
        traj.status = status
        traj.finished_at = time.time()

    def _closed(self, session: LiveSession) -> None:
        """Bookkeeping once the Trajectory record is durable."""
        traj = session.trajectory
        self.metrics.child(self.metrics.trajectories, traj.status).inc()
        if traj.rewards:
            self.metrics.reward_values.observe(traj.reward)
            self.metrics.reward_sum.inc(traj.reward)
        if not traj.anonymous:
            self.closed[traj.id] = traj.status
            self.recent[traj.id] = traj
            if len(self.recent) > RECENT_KEEP:
                self.recent.popitem(last=False)
            self._unregister(session)
            self._group_member_closed(traj)
            self._prune()

    def _prune(self) -> None:
        """Bound what closed sessions leave behind: their ids (409 rather than 404), keys and groups."""
        cap = self.config.max_closed_sessions
        while len(self.closed) > cap:
            del self.closed[next(iter(self.closed))]
        while len(self.keys) > cap + len(self.sessions):
            key, sid = next(iter(self.keys.items()))
            del self.keys[key]
            if sid in self.sessions:  # still open: kept, moved to the end
                self.keys[key] = sid
        while len(self.groups) > self.config.max_groups:
            done = next((g for g in self.groups.values() if g.complete is not None), None)
            del self.groups[(done or next(iter(self.groups.values()))).id]

    # ---- groups and timeouts -----------------------------------------------------------------------------

    def _group_member_closed(self, traj: Trajectory) -> None:
        if traj.group_id is None or traj.group_id not in self.groups:
            return
        group = self.groups[traj.group_id]
        group.members[traj.id] = traj.status
        closed = sum(1 for s in group.members.values() if s != "running")
        if group.complete is None and group.size is not None and closed >= group.size:
            self._complete(group, "full")

    def _complete(self, group: Group, reason: str) -> None:
        group.complete = reason
        group.completed_at = time.monotonic()
        self.metrics.groups_complete.labels(reason).inc()

    def group(self, group_id: str) -> Group:
        group = self.groups.get(group_id)
        if group is None:
            raise GroupNotFound(f"no group {group_id!r}")
        return group

    def sweep(self) -> None:
        """Close sessions idle past their timeout (``timed_out``, still delivered) and time out groups."""
        now = time.monotonic()
        try:
            self.log.ensure_writable()
        except LogUnavailable:  # idle sessions are closed once their Trajectory record can be written
            writable = False
        else:
            writable = True
        for session in list(self.sessions.values()) if writable else ():
            timeout = session.trajectory.idle_timeout_s
            if (
                timeout is not None
                and not session.closing
                and session.inflight == 0
                and now - session.last_active > timeout
            ):
                session.closing = True  # claimed now, so the next sweep does not close it twice
                self.spawn(self._close_logged(session, "timed_out"))
        gt = self.config.group_timeout_s
        for gid, group in list(self.groups.items()):
            if group.complete is None and gt is not None and now - group.opened > gt:
                self._complete(group, "timeout")
            elif group.completed_at is not None and now - group.completed_at > GROUP_RETENTION_S:
                del self.groups[gid]

    async def _close_logged(self, session: LiveSession, status: TrajectoryStatus) -> None:
        try:
            await self._close(session, status)
        except Exception:
            logger.exception("closing session %s as %s failed", session.id, status)

    async def sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.sweep()

    # ---- restart -----------------------------------------------------------------------------------------

    async def rebuild(self) -> int:
        """Rebuild the open sessions from the log (blocking reads, so in a thread, before serving starts)."""
        return await asyncio.to_thread(self._rebuild_sync)

    def _rebuild_sync(self) -> int:
        expander = Expander()  # the full form of each open session's latest call
        for start, record in self.log.located_records():
            if isinstance(record, SessionOpened):
                if record.anonymous:
                    continue
                traj = Trajectory(
                    id=record.trajectory_id,
                    group_id=record.group_id,
                    group_size=record.group_size,
                    mode=record.mode,
                    metadata=record.metadata,
                    idle_timeout_s=record.idle_timeout_s,
                    created_at=record.at,
                    train=record.train,
                    side_models=record.side_models,
                )
                self.closed.pop(traj.id, None)
                self._register(LiveSession(traj, record.key))
            elif isinstance(record, Step):
                session = self.sessions.get(record.trajectory_id)
                if session is not None and record.index == len(session.trajectory.steps):
                    try:
                        full = expander.full(record)
                    except DeltaError as exc:  # its base is not in the log: the rest of the chain cannot be read
                        logger.error("session %s: step %d left out at rebuild: %s", session.id, record.index, exc)
                        continue
                    session.trajectory.steps.append(record)
                    session.starts[record.index] = start
                    if record.status == "ok":  # the main line as it was: its opening, its branch
                        advance(session.line, Decision(record.call_class, record.call_rule, record.branch), full)
            elif isinstance(record, RewardAdded):
                session = self.sessions.get(record.trajectory_id)
                if session is not None:
                    self._apply_reward(session.trajectory, record)
            elif isinstance(record, PolicyVersion):
                self.policy_versions.append(record)
            elif isinstance(record, Trajectory) and not record.anonymous:
                session = self.sessions.pop(record.id, None)
                expander.forget(record.id)
                self.closed[record.id] = record.status
                if session is not None:
                    self._group_member_closed(record)
        for session in self.sessions.values():
            session.full = expander.last_call(session.id)
            session.bytes = len(msgpack_encoder.encode(session.trajectory)) + RECORD_SLACK * len(session.starts)
        self.holdings.hold(
            sum(len(x.trajectory.steps) for x in self.sessions.values()) - self.steps_held,
            sum(x.bytes for x in self.sessions.values()) - self.bytes_held,
        )
        self.metrics.sessions_open.set(len(self.sessions))
        return len(self.sessions)

    def summary(self, session: LiveSession, origin: str | None = None) -> dict[str, Any]:
        """What an agent needs: its base URL (under ``public_url``, else the address the caller reached us at)
        and its session key."""
        base = self.config.public_url or origin or self.config.base_url()
        return {"id": session.id, "base_url": f"{base.rstrip('/')}/s/{session.id}/v1", "api_key": session.key}



