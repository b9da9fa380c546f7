"""Opening sessions and finding the one a model call belongs to (``Opener``): ``POST /sessions``'s open
(keys bind sessions), a call's ``resolve`` (by its key, its path or header id, or anonymous: a fresh
one-step session), ``auto:`` sessions pending until a step is recorded (each counted against its address's
share), ``peek`` (the open session a call names, opening nothing), and the side aliases a call may name."""

from __future__ import annotations

import itertools
import uuid
from typing import Any

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import (
    RecordTooLarge,
    SessionExists,
    SessionNotFound,
    UnknownSessionKey,
    WrongSessionKey,
)
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Mode, SessionOpened, TrainOn, Trajectory, msgpack_encoder
from steptap.middleware.sessions.holding import Holder
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.limits import Holdings
from steptap.middleware.sessions.registry import Registry
from steptap.middleware.sessions.session import AUTO_PREFIX, LiveSession, new_key
from steptap.middleware.sessions.writer import Writer


class Opener:
    def __init__(self, config: ProxyConfig, metrics: Metrics, holdings: Holdings, writer: Writer,
                 registry: Registry, holder: Holder) -> None:
        self.config = config
        self.metrics = metrics
        self.holdings = holdings
        self.writer = writer
        self.registry = registry
        self.holder = holder  # a held session's id is taken until it is released
        # An anonymous trajectory's id: this opener's random half, then a count (no system call a call: a
        # uuid4 reads the kernel's random source, and releases the GIL to the log's writer thread meanwhile)
        self._anon_half, self._anon_count = "anon-" + uuid.uuid4().hex[:16], itertools.count()

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
        registry = self.registry
        if sid in registry.sessions or sid in registry.closed or sid in self.holder.held:  # held: waits for
            raise SessionExists(f"session {sid!r} already exists")  # its reward
        self.holdings.check_open(len(registry.sessions) - registry.auto_open)
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
        await self._opened(session, opened)
        return session

    async def _opened(self, session: LiveSession, record: SessionOpened) -> None:
        """Registered before the await (a concurrent open of the same id sees it; the session's next steps
        follow its record), unregistered if the record is not written."""
        self.registry.register(session)
        try:
            await self.writer.append(record)
        except BaseException:
            self.registry.unregister(session)
            raise
        self.metrics.sessions_opened["false"] += 1

    def canonical_id(self, sid: str) -> str:
        """The id a control route means: ``sid`` itself, or the auto-created session of that path id."""
        if self.registry.known(sid) or sid in self.holder.held:
            return sid
        auto = AUTO_PREFIX + sid
        return auto if self.registry.known(auto) or auto in self.holder.held else sid

    async def resolve(self, ident: Identity, peer: str | None = None) -> LiveSession:
        """The session a model call belongs to; anonymous calls get a fresh one-step session; a new id an
        auto session, pending until a step of it is recorded (``peer``: the caller's address, whose share of
        ``max_auto_sessions`` it takes)."""
        if ident.source == "anonymous":
            traj = Trajectory(id=f"{self._anon_half}{next(self._anon_count):016x}", anonymous=True)
            self.metrics.sessions_opened["true"] += 1
            return LiveSession(traj, None)
        registry = self.registry
        if ident.source == "key":
            sid = registry.keys.get(ident.key or "")
            if sid is None:
                raise UnknownSessionKey("unknown steptap session key")
            return registry.get(sid)
        sid = ident.session_id or ""
        if sid in registry.sessions or sid in registry.closed:
            # Opened by POST /sessions: only its key reaches it (the id alone may be guessed or leaked).
            if ident.key is None or registry.keys.get(ident.key) != sid:
                raise WrongSessionKey(
                    f"session {sid!r} was opened with a key: send it as the API key (Authorization: Bearer "
                    "stk-...)"
                )
            return registry.get(sid)
        if ident.key is not None and ident.key in registry.keys:
            raise WrongSessionKey(f"this API key belongs to another session than {sid!r}")
        auto = AUTO_PREFIX + sid
        if auto not in registry.sessions and auto not in registry.closed:
            if not self.config.auto_create:
                raise SessionNotFound(f"no session {sid!r} (sessions are opened with POST /sessions)")
            return self._pending(auto, peer or "")
        return registry.get(auto)

    def peek(self, ident: Identity) -> LiveSession | None:
        """The open session a call names, as ``resolve`` would find it with the same key, or None: opens
        nothing, raises nothing (what the relay reads before the call is admitted: proxy/call_state.py)."""
        if ident.source == "anonymous":
            return None
        sessions, keys = self.registry.sessions, self.registry.keys
        if ident.source == "key":
            sid = keys.get(ident.key or "")
            return None if sid is None else sessions.get(sid)
        sid = ident.session_id or ""
        if sid in sessions:
            return sessions[sid] if ident.key is not None and keys.get(ident.key) == sid else None
        return sessions.get(AUTO_PREFIX + sid)

    def side_aliases(self, ident: Identity) -> list[str]:
        """The side-call model names a call may use that the backend need not serve (routed to its model):
        the proxy's ``side_models`` and those of the open session the call names."""
        session = self.peek(ident)
        return [*self.config.side_models, *(session.line.side_models if session is not None else ())]

    def _pending(self, sid: str, peer: str) -> LiveSession:
        """An auto session not opened yet: it opens (``open_pending``) with its first recorded step, so a
        call the backend refuses opens nothing. Concurrent first calls on one id share it. It counts against
        ``max_auto_sessions`` and its caller's ``max_auto_sessions_per_peer`` from now until it closes, or
        until its calls ended with no step (``drop_pending``; the idle sweep forgets one no call holds)."""
        registry = self.registry
        session = registry.pending.get(sid)
        if session is None:
            peers = registry.auto_peers
            self.holdings.check_auto(registry.auto_open + len(registry.pending), peers.get(peer, 0))
            traj = Trajectory(id=sid, idle_timeout_s=self.config.auto_session_idle_timeout_s)
            session = registry.pending[sid] = LiveSession(traj, None)
            session.pending = True
            session.peer = peer
            registry.auto_peers[peer] = registry.auto_peers.get(peer, 0) + 1
            session.bytes = len(msgpack_encoder.encode(traj))
        return session

    async def open_pending(self, session: LiveSession) -> None:
        """A pending auto session opened by its first recorded step (recording.py)."""
        if self.registry.pending.get(session.id) is not session:  # forgotten meanwhile, its id taken again
            raise SessionExists(f"session {session.id!r} was opened by another call")
        session.pending = False
        self.registry.pending.pop(session.id, None)
        idle = session.trajectory.idle_timeout_s
        await self._opened(session, SessionOpened(trajectory_id=session.id, idle_timeout_s=idle))

    def summary(self, session: LiveSession, origin: str | None = None) -> dict[str, Any]:
        """What an agent needs: its base URL (under ``public_url``, else the address the caller reached us at)
        and its session key."""
        base = self.config.public_url or origin or self.config.base_url()
        return {"id": session.id, "base_url": f"{base.rstrip('/')}/s/{session.id}/v1", "api_key": session.key}
