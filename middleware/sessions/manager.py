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
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Coroutine, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, contextmanager, nullcontext
from typing import Any

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import (
    DomainError,
    RecordTooLarge,
    SessionClosed,
    SessionExists,
    SessionNotFound,
    UnknownSessionKey,
    WrongSessionKey,
)
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import (
    Held,
    LogRecord,
    Mode,
    SessionOpened,
    TrainOn,
    Trajectory,
    TrajectoryStatus,
    msgpack_encoder,
)
from steptap.middleware.sessions.closing import Closing
from steptap.middleware.sessions.groups import Group, Groups
from steptap.middleware.sessions.holding import Holding
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.limits import Holdings
from steptap.middleware.sessions.recording import Recording
from steptap.middleware.sessions.replay import Replay
from steptap.middleware.sessions.rewarding import Rewarding
from steptap.middleware.sessions.rewards import RewardFn
from steptap.middleware.sessions.session import AUTO_PREFIX, LiveSession, Log, new_key

logger = logging.getLogger("steptap.sessions")

_NOTHING = nullcontext()


class SessionManager(Closing, Groups, Holding, Recording, Replay, Rewarding):
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
        # Auto sessions whose first call is in flight (not yet opened)
        self.pending: dict[str, LiveSession] = {}
        self.auto_peers: dict[str, int] = {}  # auto sessions (pending or open) by the address opening them
        self.keys: dict[str, str] = {}  # session key -> id (kept after close, to answer 409 not 401)
        self.closed: dict[str, TrajectoryStatus] = {}  # id -> final status
        self.groups: dict[str, Group] = {}
        self.recent: OrderedDict[str, Trajectory] = OrderedDict()
        self.held: dict[str, Held] = {}  # finished with the reward pending (holding.py)
        self.held_bytes: dict[str, int] = {}
        self.held_lock = asyncio.Lock()
        self.expiring: set[str] = set()
        self.holdings = Holdings(config, metrics)  # calls in flight, steps and bytes held, against the limits
        self.admitted = self.holdings.admitted  # around a model call: a 429 beyond max_concurrent_calls
        # An anonymous trajectory's id: this manager's random half, then a count (no system call a call: a
        # uuid4 reads the kernel's random source, and releases the GIL to the log's writer thread meanwhile)
        self._anon_half, self._anon_count = "anon-" + uuid.uuid4().hex[:16], itertools.count()

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

    async def _append_encoded(self, payload: bytes, record: LogRecord) -> tuple[str, str]:
        """``_append_at`` of a record already encoded (``payload``: its msgpack bytes, written as is)."""
        t0 = time.perf_counter()
        cursors = await self.log.append_encoded(payload, record)
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
        tito: bool = False,
        train: TrainOn = "main",
        side_models: list[str] | None = None,
    ) -> LiveSession:
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions or sid in self.closed or sid in self.held:  # held: waits for its reward
            raise SessionExists(f"session {sid!r} already exists")
        self.holdings.check_open(len(self.sessions) - self.auto_open)
        if idle_timeout_s is None:
            idle_timeout_s = self.config.session_idle_timeout_s
        opened = SessionOpened(trajectory_id=sid, group_id=group_id, group_size=group_size, mode=mode,
                               metadata=metadata or {}, idle_timeout_s=idle_timeout_s,
                               key=new_key() if keyed else None, tito=tito, train=train,
                               side_models=list(side_models or ()))
        traj = opened.trajectory()
        session = LiveSession(traj, opened.key)
        session.tito = tito
        session.bytes = len(msgpack_encoder.encode(traj))
        if session.bytes > self.config.max_session_bytes:  # its Trajectory record could never be written
            raise RecordTooLarge(
                f"session metadata of {session.bytes} bytes exceeds "
                f"max_session_bytes={self.config.max_session_bytes}"
            )
        self._register(session)  # before the await: a concurrent open of the same id sees it
        try:
            await self._append(opened)
        except BaseException:
            self._unregister(session)
            raise
        self.metrics.sessions_opened.labels("false").inc()
        return session

    def canonical_id(self, sid: str) -> str:
        """The id a control route means: ``sid`` itself, or the auto-created session of that path id."""
        if sid in self.sessions or sid in self.closed or sid in self.recent or sid in self.held:
            return sid
        auto = AUTO_PREFIX + sid
        known = auto in self.sessions or auto in self.closed or auto in self.recent or auto in self.held
        return auto if known else sid

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
            self._release_peer(session)
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

    async def resolve(self, ident: Identity, peer: str | None = None) -> LiveSession:
        """The session a model call belongs to; anonymous calls get a fresh one-step session; a new id an
        auto session, pending until a step of it is recorded (``peer``: the caller's address, whose share of
        ``max_auto_sessions`` it takes)."""
        if ident.source == "anonymous":
            traj = Trajectory(id=f"{self._anon_half}{next(self._anon_count):016x}", anonymous=True)
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
                    f"session {sid!r} was opened with a key: send it as the API key (Authorization: Bearer "
                    "stk-...)"
                )
            return self.get(sid)
        if ident.key is not None and ident.key in self.keys:
            raise WrongSessionKey(f"this API key belongs to another session than {sid!r}")
        auto = AUTO_PREFIX + sid
        if auto not in self.sessions and auto not in self.closed:
            if not self.config.auto_create:
                raise SessionNotFound(f"no session {sid!r} (sessions are opened with POST /sessions)")
            return self._pending(auto, peer or "")
        return self.get(auto)

    def peek(self, ident: Identity) -> LiveSession | None:
        """The open session a call names, as ``resolve`` would find it with the same key, or None: opens
        nothing, raises nothing (what the relay reads before the call is admitted: proxy/call_state.py)."""
        if ident.source == "anonymous":
            return None
        if ident.source == "key":
            sid = self.keys.get(ident.key or "")
            return None if sid is None else self.sessions.get(sid)
        sid = ident.session_id or ""
        if sid in self.sessions:
            return self.sessions[sid] if ident.key is not None and self.keys.get(ident.key) == sid else None
        return self.sessions.get(AUTO_PREFIX + sid)

    def side_aliases(self, ident: Identity) -> list[str]:
        """The side-call model names a call may use that the backend need not serve (routed to its model):
        the proxy's ``side_models`` and those of the open session the call names."""
        session = self.peek(ident)
        return [*self.config.side_models, *(session.line.side_models if session is not None else ())]

    def hold_bytes(self, session: LiveSession, size: int) -> None:
        """Count ``size`` bytes more (or fewer) that the proxy holds for an open session between its calls
        (its latest token prompt: proxy/call_state.py) in what the session and the proxy hold."""
        if session.id in self.sessions and not session.pending:  # what _register counted, _unregister frees
            session.bytes += size
            self.holdings.hold(0, size)

    def _pending(self, sid: str, peer: str) -> LiveSession:
        """An auto session not opened yet: it opens (``_open_pending``) with its first recorded step, so a
        call the backend refuses opens nothing. Concurrent first calls on one id share it. It counts against
        ``max_auto_sessions`` and its caller's ``max_auto_sessions_per_peer`` from now until it closes, or
        until its calls ended with no step (``drop_pending``; the idle sweep forgets one no call holds)."""
        session = self.pending.get(sid)
        if session is None:
            self.holdings.check_auto(self.auto_open + len(self.pending), self.auto_peers.get(peer, 0))
            traj = Trajectory(id=sid, idle_timeout_s=self.config.auto_session_idle_timeout_s)
            session = self.pending[sid] = LiveSession(traj, None)
            session.pending = True
            session.peer = peer
            self.auto_peers[peer] = self.auto_peers.get(peer, 0) + 1
            session.bytes = len(msgpack_encoder.encode(traj))
        return session

    def first_call(self, session: LiveSession) -> AbstractContextManager[None]:
        """From a call's ``resolve`` to its ``call`` (its images read meanwhile): an auto session still
        pending counts the call as in flight (the idle sweep keeps it), and a refusal drops it (any other
        session: nothing, at no cost)."""
        return self._first_call(session) if session.pending else _NOTHING

    @contextmanager
    def _first_call(self, session: LiveSession) -> Iterator[None]:
        session.inflight += 1
        try:
            yield
        except BaseException:
            session.inflight -= 1
            self.drop_pending(session)
            raise
        session.inflight -= 1

    def drop_pending(self, session: LiveSession) -> None:
        """An auto session whose calls all ended with no step recorded: forgotten (it never opened)."""
        if session.pending and session.inflight == 0 and self.pending.get(session.id) is session:
            del self.pending[session.id]
            self._release_peer(session)

    def _release_peer(self, session: LiveSession) -> None:
        peer, session.peer = session.peer, None
        if peer is not None:
            left = self.auto_peers[peer] - 1
            if left:
                self.auto_peers[peer] = left
            else:
                del self.auto_peers[peer]  # bounded by the auto sessions

    async def _open_pending(self, session: LiveSession) -> None:
        if self.pending.get(session.id) is not session:  # forgotten meanwhile, and its id taken again
            raise SessionExists(f"session {session.id!r} was opened by another call")
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

    def call(self, session: LiveSession, steps: int = 1, size: int = 0) -> AbstractAsyncContextManager[None]:
        """Around one model call (``async with manager.call(...)``: checked and counted when called, released
        when the block ends): a closing or full session takes none, and an idle timeout never closes a
        session while one of its calls is in flight. ``steps`` and ``size`` (the request body) are what the
        call will add at least; ``record`` enforces the exact limits."""
        if session.closing:
            raise SessionClosed(f"session {session.id!r} is closing")
        # The call records its request once, however many choices it asks for (delta.compress_choice); an
        # anonymous call's one record is checked against max_record_bytes in ``record``, encoded once, before
        # it is logged.
        if not session.trajectory.anonymous:
            try:
                self.holdings.check_session_calls(session.id, session.inflight)
                self._check_room(session, steps, size)
            except DomainError:
                self.drop_pending(session)  # a first call refused here opens nothing
                raise
        self.hold_call(session)
        return _InCall(self, session)

    def hold_call(self, session: LiveSession) -> None:
        """One more call of ``session`` in flight: ``call``'s, or a failed step recorded after its handler
        returned (a pending auto session is not forgotten, nor a finish drained, before it is recorded)."""
        session.inflight += 1
        session.last_active = time.monotonic()

    def release_call(self, session: LiveSession) -> None:
        session.inflight -= 1
        session.last_active = time.monotonic()
        if session.inflight == 0 and session.drained is not None:
            session.drained.set()
        self.drop_pending(session)  # its calls ended with no step: never opened

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

    def summary(self, session: LiveSession, origin: str | None = None) -> dict[str, Any]:
        """What an agent needs: its base URL (under ``public_url``, else the address the caller reached us at)
        and its session key."""
        base = self.config.public_url or origin or self.config.base_url()
        return {"id": session.id, "base_url": f"{base.rstrip('/')}/s/{session.id}/v1", "api_key": session.key}


class _InCall:
    """``SessionManager.call``'s hold, released when the block ends (not a generator: a third of the cost)."""

    __slots__ = ("manager", "session")

    def __init__(self, manager: SessionManager, session: LiveSession) -> None:
        self.manager, self.session = manager, session

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        self.manager.release_call(self.session)
