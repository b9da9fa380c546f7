"""steptap.adapters: plug existing agents (any OpenAI-compatible client, agent frameworks, any program) into
steptap sessions. Depends on the middleware's client only; each framework is imported lazily."""

from __future__ import annotations

from steptap.adapters.registry import Adapter, bind, entries, get
from steptap.adapters.session import AsyncSession, Session, async_session, session

__all__ = ["Adapter", "AsyncSession", "Session", "async_session", "bind", "entries", "get", "session"]
