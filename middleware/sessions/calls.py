"""A session's model calls in flight (``CallHolds``): each call checked and counted around its block
(``call``), a pending auto session's first call from its ``resolve`` on (``first_call``), a failed step
recorded after its handler returned (``hold_call``); and what the proxy holds for a session between its
calls, counted in the session's bytes (``hold_bytes``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, contextmanager, nullcontext

from steptap.middleware.exceptions import DomainError, SessionClosed
from steptap.middleware.sessions.limits import Holdings
from steptap.middleware.sessions.registry import Registry
from steptap.middleware.sessions.session import LiveSession

_NOTHING = nullcontext()


class CallHolds:
    def __init__(self, holdings: Holdings, registry: Registry) -> None:
        self.holdings = holdings
        self.registry = registry
        self._drop_pending = registry.drop_pending  # on every call's release: bound once

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
            self._drop_pending(session)
            raise
        session.inflight -= 1

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
                held_steps = len(session.trajectory.steps)
                self.holdings.check_room(session.id, held_steps, session.bytes, steps, size)
            except DomainError:
                self._drop_pending(session)  # a first call refused here opens nothing
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
        self._drop_pending(session)  # its calls ended with no step: never opened

    def hold_bytes(self, session: LiveSession, size: int) -> None:
        """Count ``size`` bytes more (or fewer) that the proxy holds for an open session between its calls
        (its latest token prompt: proxy/call_state.py) in what the session and the proxy hold."""
        # an open session's: its bytes counted by ``register``, given back by ``unregister``
        if session.id in self.registry.sessions and not session.pending:
            session.bytes += size
            self.holdings.hold(0, size)


class _InCall:
    """``CallHolds.call``'s hold, released when the block ends (not a generator: a third of the cost)."""

    __slots__ = ("holds", "session")

    def __init__(self, holds: CallHolds, session: LiveSession) -> None:
        self.holds, self.session = holds, session

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        self.holds.release_call(self.session)
