"""``SessionManager``: the session domain's composition root. It makes the parts below, each given what it
needs, and is the one object the rest of the proxy holds (``SESSIONS_KEY``): each public method is one part's,
bound here once (no frame of the manager's own on a model call's path), each table one part's.

| part | module | what |
|---|---|---|
| ``Writer`` | writer.py | appends to the log (timed), background tasks |
| ``Registry`` | registry.py | the tables of sessions: open, pending auto, keys, closed ids, recent ones |
| ``Groups`` | groups.py | groups of sessions, complete when full or timed out |
| ``Holder`` | holding.py | trajectories finished with their reward pending, late rewards |
| ``Opener`` | opening.py | open, resolve a call's session, pending auto sessions |
| ``CallHolds`` | calls.py | a session's calls in flight |
| ``Closer`` | closing.py | finish and close: the closing ``Trajectory`` record |
| ``Recorder`` | recording.py | a model call's steps recorded (``record``) |
| ``Rewarder`` | rewarding.py | rewards on an open session |
| ``Sweeper`` | sweep.py | the idle sweep |
| ``Replayer`` | replay.py | open sessions rebuilt from the log after a restart |

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
from typing import Any

from steptap.middleware.config import ProxyConfig
from steptap.middleware.metrics import Metrics
from steptap.middleware.sessions.calls import CallHolds
from steptap.middleware.sessions.closing import Closer
from steptap.middleware.sessions.groups import Groups
from steptap.middleware.sessions.holding import Holder
from steptap.middleware.sessions.limits import Holdings
from steptap.middleware.sessions.opening import Opener
from steptap.middleware.sessions.recording import Recorder
from steptap.middleware.sessions.registry import Registry
from steptap.middleware.sessions.replay import Replayer
from steptap.middleware.sessions.rewarding import Rewarder
from steptap.middleware.sessions.rewards import RewardFn
from steptap.middleware.sessions.session import Log
from steptap.middleware.sessions.sweep import Sweeper
from steptap.middleware.sessions.writer import Writer


class SessionManager:
    def __init__(self, config: ProxyConfig, log: Log, metrics: Metrics, reward_fn: RewardFn | None,
                 tasks: set[asyncio.Task[Any]]) -> None:
        self.config, self.log, self.metrics = config, log, metrics
        self.holdings = holdings = Holdings(config, metrics)  # calls in flight, steps and bytes held
        self.writer = writer = Writer(log, metrics, tasks)
        self.group_table = groups = Groups(config, metrics)
        self.registry = registry = Registry(config, metrics, holdings, groups)
        self.holder = holder = Holder(config, metrics, holdings, writer, registry, groups)
        self.opener = opener = Opener(config, metrics, holdings, writer, registry, holder)
        self.call_holds = CallHolds(holdings, registry)
        self.closer = closer = Closer(config, metrics, reward_fn, writer, registry, groups, holder)
        self.recorder = Recorder(config, metrics, holdings, reward_fn, writer, opener, closer)
        self.rewarder = Rewarder(config, metrics, holdings, writer)
        self.sweeping = Sweeper(config, writer, registry, closer, holder, groups)
        self.replayer = Replayer(log, metrics, holdings, registry, groups, holder)
        self._bind()

    def _bind(self) -> None:
        """The tables and methods the rest of the proxy reads on the manager, each its part's."""
        registry, holder = self.registry, self.holder
        self.sessions, self.pending, self.keys = registry.sessions, registry.pending, registry.keys
        self.closed, self.recent, self.auto_peers = registry.closed, registry.recent, registry.auto_peers
        self.get, self.drop_pending = registry.get, registry.drop_pending
        self.groups, self.group = self.group_table.groups, self.group_table.group
        self.held = holder.held
        self.release, self.late_reward = holder.release, holder.late_reward
        self.pending_state, self.deadline_at = holder.pending_state, holder.deadline_at
        opener = self.opener
        self.open, self.resolve, self.peek, self.canonical_id = (opener.open, opener.resolve, opener.peek,
                                                                 opener.canonical_id)
        self.side_aliases, self.summary = opener.side_aliases, opener.summary
        calls = self.call_holds
        self.first_call, self.call, self.hold_call, self.release_call, self.hold_bytes = (
            calls.first_call, calls.call, calls.hold_call, calls.release_call, calls.hold_bytes)
        self.admitted = self.holdings.admitted  # around a model call: a 429 beyond max_concurrent_calls
        self.spawn = self.writer.spawn
        self.record = self.recorder.record  # the end of every model call: ``record(session, steps, ctx)``
        self.finish = self.closer.finish
        self.add_reward = self.rewarder.add_reward
        self.sweep, self.sweeper = self.sweeping.sweep, self.sweeping.run
        self.rebuild = self.replayer.rebuild

    @property
    def calls_inflight(self) -> int:
        return self.holdings.calls_inflight

    @property
    def steps_held(self) -> int:
        return self.holdings.steps_held

    @property
    def bytes_held(self) -> int:
        return self.holdings.bytes_held
