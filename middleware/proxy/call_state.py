"""What the proxy holds for a session between its model calls (``CallState``: its latest token prompt, its
TITO turn's state), in a table the proxy owns keyed by the session (``CallStates``, one per app): the entry
lives as long as the session object (a weak key), so a session closed, evicted, timed out or forgotten
leaves nothing here. Its bytes are counted in the session's (``SessionManager.hold_bytes``); what the
recorder needs of it is handed over in the call's context (``CallState.context``), never read off the
session."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from aiohttp import web

from steptap.middleware.sessions.recording import CallContext

if TYPE_CHECKING:
    from steptap.middleware.delta import Kept
    from steptap.middleware.proxy.tito_plan import State
    from steptap.middleware.sessions.manager import SessionManager
    from steptap.middleware.sessions.prefix import Grown
    from steptap.middleware.sessions.session import LiveSession

POINTER = 8  # bytes a list holds per item (the items are a prompt's own ids, counted with it)

Prompt = tuple[bytes, list[int]]  # a token prompt's raw bytes (its JSON) and its ids
Packed = tuple[list[object], bytes]  # a call's messages and their msgpack (tito_plan.Plan.packed)


class CallState:
    """One session's state between its calls, as the proxy keeps it."""

    __slots__ = ("grown", "kept", "prompt", "prompt_bytes", "tito_base", "tito_packed", "tito_spare",
                 "tito_state")

    def __init__(self) -> None:
        self.tito_state: State | None = None  # what its next TITO turn extends (tito_plan.State)
        self.tito_base: Prompt | None = None  # its latest render of the base conversation (tito.Turn)
        self.tito_packed: Packed | None = None  # the call's messages and their msgpack, for its next state
        # The prompt list its latest turn was built from, and that turn's: dead once the turn is done, it is
        # grown in place into the next turn's list (tito.Turn), so a turn copies and frees no whole prompt
        self.tito_spare: tuple[list[int], list[int]] | None = None
        # Its latest token prompt's raw bytes and ids: the next one is decoded from what is new, and a TITO
        # turn's JSON continues them (proxy/prompts.py; about 5 bytes a token beside the ids the latest call's
        # steps hold)
        self.prompt: Prompt | None = None
        self.prompt_bytes = 0  # what ``prompt`` and ``tito_spare`` hold, as counted in the session's bytes
        # The latest prompt id list the proxy built from the previous step's lists (prefix.Grown): the
        # recorder's continuity check skips what it took from them
        self.grown: Grown | None = None
        self.kept: Kept | None = None  # the call's messages, known to start with the latest step's (delta)

    def hold_prompt(self, manager: SessionManager, session: LiveSession, held: Prompt | None) -> None:
        """Keep ``held`` (the latest token prompt, proxy/prompts.py), its bytes counted in what the session
        and the proxy hold (the ids are the latest call's, counted with it), and so is a TITO session's spare
        list (a pointer an id)."""
        now = (len(held[0]) if held else 0) + (POINTER * len(self.tito_spare[0]) if self.tito_spare else 0)
        size, self.prompt_bytes = now - self.prompt_bytes, now
        self.prompt = held
        manager.hold_bytes(session, size)

    def context(self, chat: list[object] | None = None) -> CallContext:
        """What the recorder takes of this state for the call it records (``grown``, ``kept``: used once,
        dropped here, or they would keep the last prompt alive)."""
        grown, kept, self.grown, self.kept = self.grown, self.kept, None, None
        return CallContext(chat, grown, kept)


class CallStates:
    """The proxy's table of ``CallState`` by session: an entry goes with its session object."""

    __slots__ = ("_by_session",)

    def __init__(self) -> None:
        self._by_session: weakref.WeakKeyDictionary[LiveSession, CallState] = weakref.WeakKeyDictionary()

    def of(self, session: LiveSession) -> CallState:
        """The session's entry (made on first use); an anonymous session's is its one call's, kept nowhere."""
        if session.trajectory.anonymous:
            return CallState()
        state = self._by_session.get(session)
        if state is None:
            state = self._by_session[session] = CallState()
        return state

    def __contains__(self, session: LiveSession) -> bool:
        return session in self._by_session

    def __len__(self) -> int:
        return len(self._by_session)


CALL_STATES_KEY = web.AppKey("steptap_call_states", CallStates)
