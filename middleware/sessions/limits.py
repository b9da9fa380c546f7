"""``Holdings``: what the proxy holds against its limits (docs/limits.md): model calls in flight, and the steps
and encoded bytes of open sessions (their steps as logged: a step that extends the previous call counts only what
it adds, so a long session's bytes grow with its new tokens, not with its context times its turns). It raises the domain errors a limit ends in (``Overloaded``,
``SessionFull``) and keeps the gauges of ``/metrics`` in step, so the session manager only asks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import Overloaded, SessionFull
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Step, msgpack_encoder

RECORD_SLACK = 256  # bytes a step gains when it is indexed and linked (ids, index, prefix), over-estimated
RETRY_AFTER_S = 1.0  # what a 429 tells the caller to wait


class Holdings:
    def __init__(self, config: ProxyConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.calls_inflight = 0  # model calls admitted and not yet answered (max_concurrent_calls)
        self.steps_held = 0  # steps of open sessions, in memory
        self.bytes_held = 0  # their encoded size

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Around one model call, from its first byte: more than ``max_concurrent_calls`` at once get a 429
        with Retry-After (the backend would only queue them, and each holds memory here)."""
        cap = self.config.max_concurrent_calls
        if self.calls_inflight >= cap:
            raise Overloaded(
                f"too many model calls in flight (max_concurrent_calls={cap}); retry later",
                retry_after_s=RETRY_AFTER_S,
            )
        self.calls_inflight += 1
        self.metrics.calls_inflight.set(self.calls_inflight)
        try:
            yield
        finally:
            self.calls_inflight -= 1
            self.metrics.calls_inflight.set(self.calls_inflight)

    def check_open(self, open_sessions: int) -> None:
        cap = self.config.max_open_sessions
        if open_sessions >= cap:
            raise Overloaded(
                f"{open_sessions} sessions are open (max_open_sessions={cap}): finish some, or retry later",
                retry_after_s=RETRY_AFTER_S,
            )

    def check_room(self, sid: str, held_steps: int, held_bytes: int, steps: int, size: int) -> None:
        """SessionFull unless a session holding ``held_*`` may take ``steps`` steps of ``size`` bytes more."""
        cfg = self.config
        if held_steps + steps > cfg.max_session_steps:
            raise SessionFull(
                f"session {sid!r} holds {held_steps} steps; {steps} more would pass max_session_steps="
                f"{cfg.max_session_steps}: finish it and open a new one"
            )
        if held_bytes + size > cfg.max_session_bytes:
            raise SessionFull(
                f"session {sid!r} holds {held_bytes} bytes; {size} more would pass "
                f"max_session_bytes={cfg.max_session_bytes}: finish it and open a new one"
            )

    @staticmethod
    def size_of(steps: list[Step]) -> int:
        """What ``steps`` add to their session, in the form it holds and logs them (delta steps: only what is new;
        one more encode: the exact size, not a guess)."""
        return sum(len(msgpack_encoder.encode(s)) + RECORD_SLACK for s in steps)

    def hold(self, steps: int, size: int) -> None:
        self.steps_held += steps
        self.bytes_held += size
        self.metrics.steps_held.set(self.steps_held)
        self.metrics.bytes_held.set(self.bytes_held)
