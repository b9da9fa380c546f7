"""``Registry``: the tables of sessions the manager's parts share, each table written here or by the part
named beside it: the open named sessions (and how many of them are auto-created), the auto sessions whose
first call is in flight (``pending``) and each address's share of them, the session keys, the closed ids
(their final status) and the recent closed trajectories (closing.py, holding.py). What a session holds is
counted against the limits when it is registered and given back when it is unregistered."""

from __future__ import annotations

from collections import OrderedDict

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import SessionClosed, SessionNotFound
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Trajectory, TrajectoryStatus
from steptap.middleware.sessions.groups import Groups
from steptap.middleware.sessions.limits import Holdings
from steptap.middleware.sessions.session import AUTO_PREFIX, LiveSession


class Registry:
    def __init__(self, config: ProxyConfig, metrics: Metrics, holdings: Holdings, groups: Groups) -> None:
        self.config = config
        self.metrics = metrics
        self.holdings = holdings
        self.groups = groups
        self.sessions: dict[str, LiveSession] = {}  # open named sessions by id
        self.auto_open = 0  # how many of them are auto-created (max_auto_sessions)
        # Auto sessions whose first call is in flight (not yet opened: opening.py)
        self.pending: dict[str, LiveSession] = {}
        self.auto_peers: dict[str, int] = {}  # auto sessions (pending or open) by the address opening them
        self.keys: dict[str, str] = {}  # session key -> id (kept after close, to answer 409 not 401)
        self.closed: dict[str, TrajectoryStatus] = {}  # id -> final status (closing.py, holding.py)
        self.recent: OrderedDict[str, Trajectory] = OrderedDict()  # closing.py keeps it bounded

    def register(self, session: LiveSession) -> None:
        self.sessions[session.id] = session
        self.auto_open += session.id.startswith(AUTO_PREFIX)
        if session.key:
            self.keys[session.key] = session.id
        traj = session.trajectory
        if traj.group_id is not None and self.groups.join(traj):
            self.prune()
        self.metrics.sessions_open.set(len(self.sessions))
        self.holdings.hold(len(traj.steps), session.bytes)

    def unregister(self, session: LiveSession) -> None:
        if self.sessions.pop(session.id, None) is not None:
            self.auto_open -= session.id.startswith(AUTO_PREFIX)
            self.release_peer(session)
            self.holdings.hold(-len(session.trajectory.steps), -session.bytes)
        self.metrics.sessions_open.set(len(self.sessions))

    def known(self, sid: str) -> bool:
        """Whether a session of this id is open, closed, recent or waits for its reward (``held``)."""
        return sid in self.sessions or sid in self.closed or sid in self.recent

    def get(self, sid: str) -> LiveSession:
        """An open session (404 when unknown, 409 when already closed)."""
        session = self.sessions.get(sid)
        if session is None:
            if sid in self.closed:
                raise SessionClosed(f"session {sid!r} is {self.closed[sid]}")
            raise SessionNotFound(f"no session {sid!r}")
        return session

    def drop_pending(self, session: LiveSession) -> None:
        """An auto session whose calls all ended with no step recorded: forgotten (it never opened)."""
        if session.pending and session.inflight == 0 and self.pending.get(session.id) is session:
            del self.pending[session.id]
            self.release_peer(session)

    def release_peer(self, session: LiveSession) -> None:
        peer, session.peer = session.peer, None
        if peer is not None:
            left = self.auto_peers[peer] - 1
            if left:
                self.auto_peers[peer] = left
            else:
                del self.auto_peers[peer]  # bounded by the auto sessions

    def prune(self) -> None:
        """Bound what closed sessions leave behind: their ids (409 rather than 404), keys and groups."""
        cap = self.config.max_closed_sessions
        while len(self.closed) > cap:
            del self.closed[next(iter(self.closed))]
        while len(self.keys) > cap + len(self.sessions):
            key, sid = next(iter(self.keys.items()))
            del self.keys[key]
            if sid in self.sessions:  # still open: kept, moved to the end
                self.keys[key] = sid
        self.groups.prune()
