"""The gate every model call passes (``WeightSwapper.gate``), the drain bound's cut, and keep mode's
bookkeeping of the calls in flight (version spans, the calls on each LoRA adapter, tokens per version)."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Iterable
from typing import Any

import msgspec

from steptap.middleware.exceptions import SwapUnavailable
from steptap.middleware.weights.lora import Adapters
from steptap.middleware.weights.policy import Served
from steptap.middleware.weights.spans import Spans

logger = logging.getLogger("steptap.weights")

_VERSIONS_KEPT = 16  # tokens_by_version keeps the latest this many versions
_CUT_GRACE_S = 10.0  # after cutting the calls that outlasted the drain bound, how long they get to unwind
CUT_WRITE_S = 2.0  # how long a cut call's error event may wait for its reader (it may be the slow one)
CUT_MESSAGE = "cut by a weight swap: the call outlasted the swap's drain bound (--swap-drain-timeout)"


class Ticket(msgspec.Struct, frozen=True):
    """What a call learns as it passes the gate: the version that will sample it, and the model name to send
    upstream (a LoRA adapter's name), or None to forward the agent's model unchanged."""

    version: int
    served_model: str | None = None
    spans: Spans | None = None  # where a keep swap switched this call's tokens to a newer version


class Gate:
    """The gate every model call passes, and the bookkeeping of the calls through it: reads the version (and
    the adapter to route to) ``served`` holds as each call passes, and tells ``adapters`` which adapter each
    call holds."""

    def __init__(self, served: Served, adapters: Adapters, *, drain_timeout_s: float) -> None:
        self.served = served
        self.adapters = adapters
        self.drain_timeout_s = drain_timeout_s
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0
        self.held = 0  # calls waiting at the gate now
        self.held_wait = 0.0  # the longest wait of a call held during the last closing
        self._first_held_at: float | None = None
        self._calls: set[asyncio.Task[Any]] = set()  # the tasks of calls through the gate
        self._cut: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()  # those the drain bound cancelled
        self.cut_calls = 0
        self.spans: set[Spans] = set()  # of the calls through the gate (keep mode's marks)
        self.spanning_calls = 0
        self.unsplit_calls = 0
        self.tokens_by_version: dict[int, int] = {}

    @property
    def holding(self) -> bool:
        """Whether new calls wait (from ``close`` to ``reopen``)."""
        return not self._open.is_set()

    def close(self) -> None:
        """From here new calls wait in the proxy (a swap runs)."""
        self.held_wait = 0.0
        self._open.clear()

    def reopen(self) -> None:
        """Held calls go now; ``held_wait`` is the longest wait, that of the first call held."""
        self._open.set()
        if self._first_held_at is not None:
            self.held_wait = time.monotonic() - self._first_held_at
            self._first_held_at = None

    async def idle(self) -> None:
        """Until no call is through the gate."""
        await self._idle.wait()

    def gate(self) -> Pass:
        """Around every model call (``async with gate.gate() as ticket``): waits while a swap runs, then
        yields the version that samples it."""
        return Pass(self)

    def mark(self, version: int) -> None:
        """Every call in flight: its tokens from here on are ``version``'s (vLLM is paused: none is
        sampled)."""
        for spans in self.spans:
            spans.mark(version)

    def label(self, steps: Iterable[Any], spans: Spans | None) -> None:
        """Give each step of a call its version spans; count the tokens each version sampled."""
        unsplit = False
        for step in steps:
            if spans is not None:
                step.version_spans = spans.of(step.choice)
                unsplit |= bool(spans.marks) and not step.version_spans  # spanned, split unknown (spans.py)
            n = len(step.response_token_ids)
            if not step.version_spans:  # one version sampled them all (every call but a keep swap's): a sum
                if n:
                    self.tokens_by_version[step.policy_version] = (
                        self.tokens_by_version.get(step.policy_version, 0) + n)
                continue
            for v in step.token_versions():
                self.tokens_by_version[v] = self.tokens_by_version.get(v, 0) + 1
        self.unsplit_calls += unsplit
        while len(self.tokens_by_version) > _VERSIONS_KEPT:  # bounded: the latest versions only
            del self.tokens_by_version[min(self.tokens_by_version)]

    async def drain(self) -> None:
        """Wait for the calls through the gate; past the bound, cut them (each is recorded as a failed step:
        relay asks ``was_cut``) so one slow reader cannot hold every agent for long."""
        try:
            await asyncio.wait_for(self._idle.wait(), self.drain_timeout_s)
            return
        except TimeoutError:
            pass
        slow = [t for t in self._calls if not t.done()]
        for task in slow:
            self._cut.add(task)
            task.cancel()
        self.cut_calls += len(slow)
        logger.warning("cut %d model calls still running after %.1f s to swap weights", len(slow),
                    self.drain_timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), _CUT_GRACE_S)
        except TimeoutError:
            raise SwapUnavailable(
                f"{self.in_flight} model calls still running after {self.drain_timeout_s:g} s and a cut; "
                "swap abandoned, old weights kept",
                "swap_drain_timeout",
            ) from None

    def was_cut(self, task: asyncio.Task[Any] | None) -> bool:
        """Whether the swap's drain bound cancelled this call's task."""
        return task is not None and task in self._cut

    def take_cut(self) -> bool:
        """Called by a call as its task sees the cancellation: when it is this swap's cut (not the agent
        hanging up), the cancellation is taken back so the call can end as the protocol's error (an error
        body, or an error event once the stream has begun) and record its step, within ``_CUT_GRACE_S``."""
        task = asyncio.current_task()
        if task is None or task not in self._cut:
            return False
        self._cut.discard(task)  # once: a second cancellation (the server shutting down) is a real one
        task.uncancel()
        return True


class Pass:
    """One call through the gate (``Gate.gate``), until its block ends: an object, not a generator's context
    manager (every model call enters one: a third of the cost, and no generator frame resumed twice)."""

    __slots__ = ("adapter", "gate", "spans", "task")

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def __aenter__(self) -> Ticket:
        gate = self.gate
        if not gate._open.is_set():
            gate.held += 1
            if gate._first_held_at is None:
                gate._first_held_at = time.monotonic()
            try:
                while not gate._open.is_set():  # another swap may start before this task runs again
                    await gate._open.wait()
            finally:
                gate.held -= 1
        # No await between the check above and this increment: a swap cannot slip in between.
        gate.in_flight += 1
        gate._idle.clear()
        task = self.task = asyncio.current_task()
        if task is not None:
            gate._calls.add(task)
        version, adapter = gate.served.version, gate.served.lora_name
        spans = self.spans = Spans(version, labelled=adapter is None)
        gate.spans.add(spans)
        self.adapter = adapter
        if adapter is not None:
            gate.adapters.hold(adapter)
        return Ticket(version, adapter, spans)

    async def __aexit__(self, *exc: object) -> None:
        gate, spans = self.gate, self.spans
        gate.spans.discard(spans)
        gate.spanning_calls += bool(spans.marks)
        if self.adapter is not None:
            gate.adapters.release(self.adapter)
        gate._calls.discard(self.task)
        gate.in_flight -= 1
        if gate.in_flight == 0:
            gate._idle.set()
