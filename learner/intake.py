"""The learner's intake: one ``Source`` per proxy (its stream client, cursor and ``Ledger`` of delivered
cursors), and the ``Grouper`` that holds trajectories until their group is complete (daemon.py uses them)."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict

from steptap.learner.config import LearnerConfig
from steptap.middleware.client import Delivery, SteptapClient, delivery_key
from steptap.middleware.records import Trajectory


class Ledger:
    """Delivered cursors in stream order; which are consumed; the acknowledgeable prefix. Keyed by the
    client's ``delivery_key`` (id and ``created_at``): a session id used again later is another trajectory."""

    def __init__(self) -> None:
        self._pending: OrderedDict[str, list] = OrderedDict()  # delivery key -> [cursor, consumed]
        self.acked: str | None = None

    def deliver(self, d: Delivery) -> None:
        self._pending[delivery_key(d.trajectory)] = [d.cursor, False]

    def consume(self, keys: list[str]) -> None:
        for key in keys:
            if key in self._pending:
                self._pending[key][1] = True

    def frontier(self) -> tuple[str | None, list[str]]:
        """(the cursor up to which everything is consumed, keys consumed beyond it); drops the prefix."""
        while self._pending and next(iter(self._pending.values()))[1]:
            _, (cursor, _) = self._pending.popitem(last=False)
            self.acked = cursor
        return self.acked, [key for key, (_, done) in self._pending.items() if done]


class Source:
    """One proxy: its stream client, its own cursor, acknowledgement and ledger (trajectory ids are keyed by
    source: ids chosen in session paths can repeat across proxies)."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.client = SteptapClient(url, token or None)
        self.ledger = Ledger()
        self.cursor: str | None = None
        self.skip: set[str] = set()
        self.unreadable = 0  # stream records the client could not decode and skipped (reported in the notes)


class Grouper:
    """Collects a group's members (``group_id``) until ``group_size`` have arrived, in any final status
    (an aborted member counts toward its group, it does not discard it), or until the group has waited
    ``timeout_s``."""

    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        self.open: dict[tuple[str, str], tuple[float, list[Trajectory]]] = {}
        self.ready: list[list[Trajectory]] = []
        self.counts: Counter = Counter()

    def add(self, traj: Trajectory, source: str = "") -> bool:
        """Hold ``traj`` for its group; False for one not to train on: anonymous (counted here), unless asked;
        an infrastructure error, no member of its group (run again in its place; the rows count it)."""
        if traj.anonymous and not self.cfg.train_anonymous or traj.status == "infra_error":
            self.counts["skipped_anonymous"] += traj.status != "infra_error"
            return False
        key = (source, traj.group_id or f"_single:{traj.id}")  # a group never mixes proxies
        _, members = self.open.setdefault(key, (time.monotonic(), []))
        members.append(traj)
        if traj.group_id is None or len(members) >= (traj.group_size or self.cfg.group_size):
            self.ready.append(self.open.pop(key)[1])
        return True

    def take(self, n: int) -> tuple[list[list[Trajectory]], list[Trajectory]]:
        """Up to ``n`` ready groups, and the members of timed-out groups too small to train on."""
        now, small = time.monotonic(), []
        for key, (since, members) in list(self.open.items()):
            if now - since >= self.cfg.group_timeout_s:
                del self.open[key]
                trainable = [t for t in members if t.status == "finished" or self.cfg.train_aborted]
                if len(trainable) >= self.cfg.min_group_members:
                    self.counts["groups_timed_out"] += 1
                    self.ready.append(members)
                else:
                    self.counts["dropped_small_group"] += len(members)
                    small += members
        out, self.ready = self.ready[:n], self.ready[n:]
        return out, small
