"""Recording one model call's steps in its session (``Recorder``): continuity and the call's class judged,
indexes given, each step's logged form (a delta of what it extends, or of the call's first choice), the
session's and the proxy's bytes counted before anything changes, the appends awaited (one group commit), and
a failed append undone without moving any other step's index. An anonymous call's one record is built and
encoded once (``_record_anonymous``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, NamedTuple

from steptap.middleware.config import ProxyConfig
from steptap.middleware.delta import Kept, compress, compress_choice, compress_prefix
from steptap.middleware.exceptions import RecordTooLarge
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Step, msgpack_encoder
from steptap.middleware.sessions.classify import SUPERSEDES, MainLine, decide, supersede
from steptap.middleware.sessions.classify import apply as classify_call
from steptap.middleware.sessions.closing import Closer, finalize
from steptap.middleware.sessions.limits import Holdings
from steptap.middleware.sessions.opening import Opener
from steptap.middleware.sessions.prefix import Grown, classify_after, extends
from steptap.middleware.sessions.rewards import RewardFn
from steptap.middleware.sessions.session import NOT_LOGGED, LiveSession, full_sizes, not_logged
from steptap.middleware.sessions.writer import Writer

logger = logging.getLogger("steptap.sessions")


class CallContext(NamedTuple):
    """What the proxy knows of a call that the recorder judges its steps with (proxy/call_state.py)."""

    # The call's messages in chat form when the relay translated its request (Messages, Responses):
    # continuity is judged on them, and on the latest call's, held for the next call
    chat: list[Any] | None = None
    grown: Grown | None = None  # the prompt id list the proxy built from the previous step's (prefix.Grown)
    kept: Kept | None = None  # the call's messages, known to start with the latest step's (delta.Kept)


NO_CONTEXT = CallContext()


class _Latest(NamedTuple):
    """A session's latest call as held before a call is recorded (what the next call is judged against),
    put back when the call's appends fail."""

    full: dict[int, Step]
    sizes: dict[int, tuple[int, int]]
    extra: int
    chat: list[object] | None
    line: MainLine


class Recorder:
    def __init__(self, config: ProxyConfig, metrics: Metrics, holdings: Holdings, reward_fn: RewardFn | None,
                 writer: Writer, opener: Opener, closer: Closer) -> None:
        self.config = config
        self.metrics = metrics
        self.holdings = holdings
        self.reward_fn = reward_fn
        self.writer = writer
        self.opener = opener  # a pending auto session opens with its first recorded step
        self.closer = closer  # an anonymous session closes with its step
        # what an anonymous call's record calls, bound once
        self._append_encoded, self._settle = writer.append_encoded, closer.settle

    async def record(self, session: LiveSession, steps: list[Step], ctx: CallContext = NO_CONTEXT) -> None:
        """Index, link and append the steps of one call; returns once they are durable. A named session
        that the steps would take past its limits refuses them (SessionFull) before anything changes.
        ``ctx``: what the proxy knows of the call (``CallContext``)."""
        traj = session.trajectory
        if traj.anonymous and self.reward_fn is None:
            return await self._record_anonymous(session, steps)
        if session.pending:
            await self.opener.open_pending(session)
        # Continuity is judged against the latest call's ok steps (a failed step carries no usable ids); the
        # choices of one call share it.
        prev_call = list(session.full.values())
        line_before = dataclasses.replace(session.line)
        on_main = self._judge(session, steps, prev_call, ctx)
        forms, bases = self._logged_forms(session, steps, prev_call, ctx)
        sizes = [self.holdings.size_of([f]) for f in forms]
        # a main-line call's ok steps are held in full from now (``extra``: what their full copies add);
        # else the latest call stays held
        held, extra = self._held_sizes(session, steps, forms, bases, sizes) if on_main else ({}, 0)
        if not held:
            extra = session.full_extra
        size = self._take_room(session, len(steps), sum(sizes) + extra - session.full_extra, line_before)
        before = _Latest(session.full, session.full_sizes, session.full_extra, session.conversation,
                         line_before)
        if held:
            self._hold_latest(session, steps, held, extra, ctx.chat)
        mine = session.full
        self._add(session, forms)
        self._count(steps, traj.anonymous)
        # Tasks, so the closing Trajectory record can wait for the ones in flight; concurrent appends share
        # one group commit.
        alone = len(forms) == 1 and self.holdings.calls_inflight == 1  # nothing to group it with
        tasks = [asyncio.ensure_future(self.writer.append_at(form, alone=alone)) for form in forms]
        for form, task in zip(forms, tasks, strict=True):
            session.starts[form.index] = task
        try:
            await asyncio.gather(*tasks)
        except Exception:
            self._undo(session, forms, sum(sizes), size, mine, before)
            raise
        for form, task in zip(forms, tasks, strict=True):
            session.starts[form.index] = task.result()[0]
        if steps[0].call_rule == SUPERSEDES:  # durable: the tool-less call it replaced is a side call now
            supersede(traj.steps, steps[0].index)
        if traj.anonymous:  # the reward callback may be slow: it runs after the reply, off the call's path
            self.writer.spawn(self.closer.close_logged(session, "finished"))

    def _judge(self, session: LiveSession, steps: list[Step], prev_call: list[Step],
               ctx: CallContext) -> bool:
        """Each step's ``prefix`` (its continuity with the latest call) and the call's class on the session's
        main line; whether the call is on the main line (the next call is judged against it)."""
        chat, grown = ctx.chat, ctx.grown
        for step in steps:
            step.prefix = classify_after(prev_call, step, session.conversation, chat, grown, session.norms)
        last = (prev_call[0], session.conversation) if prev_call else None  # the main line's last call
        on_main = classify_call(session.line, steps, [s.prefix for s in steps], self.config.side_models, chat,
                                last, session.norms)
        session.norms.settle()
        return on_main

    @staticmethod
    def _logged_forms(session: LiveSession, steps: list[Step], prev_call: list[Step],
                      ctx: CallContext) -> tuple[list[Step], list[Step | None]]:
        """Each step indexed and linked, and its form as the log and the session hold it with the step it is
        a delta of (None: whole): the previous call's step it extends, the call's first choice, or an edited
        history's previous call (most of the prompt is its); a step past the finish's wait is logged whole."""
        traj = session.trajectory
        forms: list[Step] = []
        bases: list[Step | None] = []
        for offset, step in enumerate(steps):
            step.trajectory_id = traj.id
            step.group_id = traj.group_id
            step.index = len(traj.steps) + offset
            base = None
            if step.prefix == "extends":  # one previous choice: classify_after found it extends (no 2nd pass)
                base = (prev_call[0] if len(prev_call) == 1 else
                        next(p for p in prev_call if extends(p, step, ctx.grown)))
            if offset and step.choice and steps[0].choice == 0:
                base = steps[0]  # another choice of this call: its request and prompt are the first's
            if session.sealed and not traj.anonymous:
                # Past the finish's bounded wait: logged whole under an index no step of the trajectory has.
                step.index = len(traj.steps) + session.late
                session.late += 1
                base = None
            form = (step if base is None else compress_choice(step, base) if base is steps[0] else
                    compress(step, base, ctx.kept))
            if (base is None and prev_call and step.status == "ok" and step.call_class != "side"
                    and step.prefix != "first" and not session.sealed
                    and (shares := compress_prefix(step, prev_call[0])) is not None):
                form, base = shares, prev_call[0]  # an edited history: most of the prompt is the last call's
            forms.append(form)
            bases.append(base)
        return forms, bases

    @staticmethod
    def _held_sizes(session: LiveSession, steps: list[Step], forms: list[Step], bases: list[Step | None],
                    sizes: list[int]) -> tuple[dict[int, tuple[int, int]], int]:
        """A main-line call's ok steps' sizes in full (``full_sizes``), and what the full copies of its delta
        steps hold. The latest call is held in full beside its delta form: what the full copies hold counts
        too, or a session's memory would grow with its context while its counted bytes grow only with its new
        tokens. (A side call is not on the main line: nothing is held for it.)"""
        known = dict(session.full_sizes)  # a choice's base is the first choice of this call
        for s, f, b, n in zip(steps, forms, bases, sizes, strict=True):
            known[s.index] = full_sizes(f, n, b, known)
        held = {s.index: known[s.index] for s in steps if s.status == "ok"}
        extra = sum(held[f.index][0] for f in forms if f.delta is not None and f.index in held)
        return held, extra

    def _take_room(self, session: LiveSession, steps: int, size: int, line_before: MainLine) -> int:
        """The call's steps and ``size`` bytes counted in what the session and the proxy hold (0: nothing
        counted: an anonymous session's, or a sealed one's); refused past the limits (SessionFull,
        RecordTooLarge) with the main line where it was."""
        if session.trajectory.anonymous or session.sealed:
            return 0
        try:
            self.holdings.check_room(session.id, len(session.trajectory.steps), session.bytes, steps, size)
        except Exception:
            session.line = line_before
            raise
        session.bytes += size
        self.holdings.hold(steps, size)
        return size

    @staticmethod
    def _hold_latest(session: LiveSession, steps: list[Step], held: dict[int, tuple[int, int]], extra: int,
                     chat: list[Any] | None) -> None:
        """A main-line call becomes the session's latest: its ok steps in full, their sizes, its messages."""
        session.full = {s.index: s for s in steps if s.status == "ok"}
        session.full_sizes, session.full_extra = held, extra
        session.conversation = None if chat is None else list(chat)  # a copy: the list is the relay's

    @staticmethod
    def _add(session: LiveSession, forms: list[Step]) -> None:
        """The call's steps into the trajectory (a sealed session's are logged only)."""
        traj = session.trajectory
        for form in forms:
            if session.sealed and not traj.anonymous:
                logger.warning(
                    "step of session %s arrived after it was closed; logged, not in the trajectory", traj.id
                )
            else:
                traj.steps.append(form)

    def _undo(self, session: LiveSession, forms: list[Step], logged: int, size: int, mine: dict[int, Step],
              before: _Latest) -> None:
        """A call's appends not durable (disk full, I/O error): the call fails, so its steps must not stay in
        the trajectory, nor their bytes in what the session and the proxy hold. Where a later step already
        took a later index, each keeps its index as a failed step with no tokens (``not_logged``): the
        indexes stay the steps' positions (rewards name them), and the next call gets a new one. ``logged``:
        the forms' own bytes; ``size``: what ``_take_room`` counted; ``mine``: the call's full steps as held,
        unless a later call replaced them."""
        traj = session.trajectory
        kept = [s if not any(s is x for x in forms) else not_logged(traj.id, s.index, s) for s in traj.steps]
        while kept and kept[-1].error is not None and kept[-1].error.type == NOT_LOGGED:
            kept.pop()  # nothing after them: the indexes are free again
        if size:
            # a later call that replaced the latest call counted its full copies against these
            size = size if session.full is mine else logged
            session.bytes -= size  # (a not_logged step counts as a step, its few bytes not)
            self.holdings.hold(len(kept) - len(traj.steps), -size)
        traj.steps = kept
        for form in forms:
            session.starts.pop(form.index, None)
        if session.full is mine:  # no later call has replaced it
            session.full, session.full_sizes, session.full_extra, session.conversation, session.line = before

    async def _record_anonymous(self, session: LiveSession, steps: list[Step]) -> None:
        """A call in no session (no reward callback): a one-step session that closes with its step, logged as
        one record, the finished Trajectory that holds its steps (they are logged nowhere else:
        ``delta.steps_of`` finds them). What ``record`` would judge of a session's first call, without what
        only a later call reads (the main line's opening, the held full copies, the session's bytes): each
        step ``first``, ``main`` by ``first`` (``side`` by ``side_model`` for a side alias), a choice after
        the first a delta of it. The record is encoded once: its size checked against ``max_record_bytes``
        and its bytes handed to the log as they are."""
        traj = session.trajectory
        kept = len(traj.steps)
        forms: list[Step] = []
        for offset, step in enumerate(steps):
            if not offset:  # a first call, its line not started: main by first, or side by side_model
                first = decide(session.line, step, "first", self.config.side_models)
            step.prefix, step.call_class, step.call_rule, step.branch = (
                "first", first.call_class, first.rule, first.branch)
            step.trajectory_id, step.group_id, step.index = traj.id, traj.group_id, kept + offset
            # another choice of this call: its request and prompt are the first's
            choice = offset and step.choice and steps[0].choice == 0
            forms.append(compress_choice(step, steps[0]) if choice else step)
        traj.steps.extend(forms)
        finalize(traj, "finished")
        traj.steps_logged = False
        payload = msgpack_encoder.encode(traj)
        if len(payload) > self.config.max_record_bytes:
            del traj.steps[kept:]
            traj.status, traj.finished_at, traj.steps_logged = "running", None, True
            raise RecordTooLarge(f"the call's {len(steps)} steps make a record of {len(payload)} bytes, "
                                 f"above max_record_bytes={self.config.max_record_bytes}")
        self._count(steps, True)
        session.closing = True
        await self._append_encoded(payload, traj, alone=self.holdings.calls_inflight == 1)
        self._settle(session)

    def _count(self, steps: list[Step], anonymous: bool) -> None:
        m = self.metrics
        for step in steps:
            m.steps[step.status, "true" if anonymous else "false"] += 1
            m.prefix[step.prefix] += 1
            m.call_class[step.call_class, step.call_rule] += 1
            m.prompt_tokens[()] += len(step.prompt_token_ids)
            m.response_tokens[()] += len(step.response_token_ids)
            if step.finish_reason == "length":  # cut by max_tokens (the run's health: middleware/health.py)
                m.replies_cut[()] += 1
