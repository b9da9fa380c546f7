"""The model call's last part: its steps (good or failed) given what the call adds to them (the protocol's
endpoint and notes, the call's notes, its images, its version spans) and appended to its session once,
``manager.record(session, steps, CallContext)``, durable before the reply completes; a failed step's when
the agent is gone, in the background."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from steptap.middleware.proxy import capture, tito, vision

if TYPE_CHECKING:
    from steptap.middleware.proxy.call_state import CallState
    from steptap.middleware.proxy.protocols import Protocol
    from steptap.middleware.proxy.services import Services
    from steptap.middleware.records import Step
    from steptap.middleware.sessions.session import LiveSession
    from steptap.middleware.weights.spans import Spans

logger = logging.getLogger("steptap.relay")


class CallRecorder:
    """One call's steps into its session: ``record`` once (``recorded`` says a step is in), ``failed`` for a
    step that says why the call failed, ``record_later`` when the agent is gone."""

    def __init__(self, services: Services, session: LiveSession, state: CallState, endpoint: str, t0: float,
                 common: dict[str, Any]) -> None:
        self.services = services
        self.manager = services.sessions
        self.session = session
        self.state = state  # what the proxy holds for the session between calls
        self.endpoint = endpoint  # as sent upstream: chat or completions
        self.t0 = t0
        self.common = common  # the fields every step of the call shares (its backend moves with a retry)
        self.recorded = False  # a step (good or failed) of this call is in the trajectory
        self.proto: Protocol | None = None  # Responses / Messages riding on chat completions
        self.notes: list[str] = []  # recorded on this call's steps beside the protocol's
        self.chat: dict[str, Any] = {}  # the chat body sent upstream
        self.pics = vision.NO_IMAGES  # the prompt's images (each step names them)
        self.spans: Spans | None = None  # where a weight swap switched this call's tokens to a newer version
        self.tito = False  # a token-in-token-out turn: the session's next turn extends what it records

    def latency(self) -> float:
        return time.perf_counter() - self.t0

    def count(self, type_: str) -> None:
        self.services.metrics.upstream_errors.labels(type_).inc()

    def steps(self, reply: dict[str, Any]) -> list[Step]:
        """The steps of a whole (or reassembled) reply."""
        return capture.steps_from_reply(reply, self.endpoint, latency_s=self.latency(), **self.common)

    def failed(self, message: str, type_: str, partial: dict[str, Any] | None = None) -> Step:
        self.count(type_)
        return capture.failed_step(self.endpoint, message, type_, partial, latency_s=self.latency(),
                                   **self.common)

    async def record(self, steps: list[Step], stop_reason: Any = None) -> None:
        """Append this call's steps to its session; durable when it returns (before the reply completes).
        ``stop_reason``: vLLM's for a one-choice reply (what a TITO session's next turn may extend)."""
        self.recorded = True
        self.services.swapper.label(steps, self.spans)
        images = self.pics.refs() if self.pics.images else None  # a Step holds none by default
        for step in steps:
            if self.proto is not None:
                step.endpoint = self.proto.endpoint
                step.notes = list(self.proto.notes)
                self.proto.annotate(step)
            if self.notes:
                step.notes = [*step.notes, *self.notes]
            if images is not None:
                step.images = list(images)
        # A translated request's messages as sent upstream (images as references): continuity is judged on
        # them (sessions/prefix.py)
        chat = self.pics.logged(self.chat.get("messages")) if self.proto is not None else None
        async with self.pics.stored():  # the images the steps name: stored only now (the call was accepted)
            await self.manager.record(self.session, steps,
                                      self.state.context(chat if isinstance(chat, list) else None))
        if self.tito:
            tito.end_turn(self.state, self.chat, steps, stop_reason)

    def record_later(self, step: Step) -> None:
        """A failed step recorded in the background (the agent is gone, the handler returns now); the session
        counts it as a call in flight until it is recorded."""
        self.recorded = True
        self.manager.hold_call(self.session)
        self.manager.spawn(self._record_quietly(step))

    async def _record_quietly(self, step: Step) -> None:
        try:
            async with self.pics.stored():  # its request refers to them
                await self.manager.record(self.session, [step], self.state.context())
        except Exception:  # a background task: log it, there is no agent left to tell
            logger.exception("could not record the failed step of session %s", self.session.id)
        finally:
            self.manager.release_call(self.session)
