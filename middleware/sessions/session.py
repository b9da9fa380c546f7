"""An open session as the proxy holds it (``LiveSession``), its key, and the log it is written to
(``Log``)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from steptap.middleware.auth import SESSION_KEY_PREFIX
from steptap.middleware.records import (
    LogRecord,
    Step,
    StepError,
    Trajectory,
    msgpack_encoder,
)
from steptap.middleware.sessions.classify import MainLine
from steptap.middleware.sessions.prefix import Norms

logger = logging.getLogger("steptap.sessions")

# A session id on the path or in the header that no POST /sessions opened is auto-created under this prefix:
# its own namespace, so an agent can never take an id the environment will open (POST /sessions refuses it).
AUTO_PREFIX = "auto:"


class Images(Protocol):
    """The image store beside the log (log/images.py), as the relay uses it."""

    async def put(self, images: Iterable[tuple[str, bytes]]) -> None: ...  # durable when it returns

    def hold(self, digests: Iterable[str]) -> AbstractContextManager[None]: ...  # kept from compaction


class Log(Protocol):
    @property
    def images(self) -> Images: ...

    async def append(self, record: LogRecord) -> str: ...

    # where it starts, where it ends; ``alone``: the one model call in flight appends it (synced on the loop)
    async def append_at(self, record: LogRecord, *, alone: bool = False) -> tuple[str, str]: ...

    # ``append_at`` of a record the caller encoded (its msgpack bytes), written as they are
    async def append_encoded(self, payload: bytes, record: LogRecord, *,
                             alone: bool = False) -> tuple[str, str]: ...

    def ensure_writable(self) -> None: ...  # raises while the log cannot write (a 503)

    def located_records(self) -> Any: ...  # (where it starts, record), in log order


class LiveSession:
    """An open session as the proxy holds it: its trajectory so far, its key, and its calls in flight."""

    __slots__ = ("__weakref__", "bytes", "closing", "conversation", "drained", "full", "full_extra",
                 "full_sizes", "inflight", "key", "last_active", "late", "line", "_lock", "norms", "peer",
                 "pending", "sealed", "starts", "tito", "trajectory")

    def __init__(self, trajectory: Trajectory, key: str | None) -> None:
        self.tito = False  # token-in-token-out mode (proxy/tito.py), set at open
        self.trajectory = trajectory
        self.key = key  # None: auto-created (reached by its path or header id) or anonymous
        self.last_active = time.monotonic()
        self.inflight = 0
        # Set when the last call in flight ends (a finish waits on it)
        self.drained: asyncio.Event | None = None
        self.closing = False  # takes no new call or reward
        self.sealed = False  # its Trajectory record is being written: a step recorded now is not in it
        self.late = 0  # steps recorded after it was sealed (logged, each with an index of its own)
        # Auto-created, opened only when its first step is recorded (the backend accepted)
        self.pending = False
        self.peer: str | None = None  # an auto session's: the address whose share it takes (opening.py)
        self.bytes = 0  # encoded size of what it holds: its steps as logged (delta form), its metadata, the
        # full copies of its latest call's delta steps (``full_extra``), and what the proxy holds for it
        # between calls (its latest token prompt: proxy/call_state.py, counted by ``hold_bytes``)
        self.full: dict[int, Step] = {}  # the latest call's ok steps in full form (index -> step): the next
        # call's prefix is judged against them, and a step that extends one is logged as a delta of it
        self.full_sizes: dict[int, tuple[int, int]] = {}  # their sizes, bounded from above (``full_sizes``)
        self.full_extra = 0  # what the full copies of the delta steps among them hold (in ``bytes``)
        # The latest call's messages in chat form, as the relay translated them (Messages, Responses): what
        # the next call's continuity is judged on when it does not extend it (None: its request's own)
        self.conversation: list[object] | None = None
        self.line = MainLine(side_models=frozenset(trajectory.side_models))  # its main line (classify.py)
        self.norms = Norms()  # its latest message lists, normalized (prefix.py)
        self.starts: dict[int, str | asyncio.Task[tuple[str, str]]] = {}  # index -> where its Step record
        # starts (its append while in flight): the closing Trajectory record refers to it
        self._lock: asyncio.Lock | None = None  # made when first taken: an anonymous call never takes it

    @property
    def id(self) -> str:
        return self.trajectory.id

    @property
    def lock(self) -> asyncio.Lock:
        """Serialises rewards and closing: a 200'd reward is in the trajectory."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock


NOT_LOGGED = "log_write_failed"  # the error type of a step whose record is not in the log


def not_logged(trajectory_id: str, index: int, like: Step | None = None) -> Step:
    """What holds the index of a step whose record is not in the log (its append failed) while a later step
    of its session is: a failed step with no tokens, kept out of the finished trajectory (it has no record to
    refer to), so the session's indexes stay its steps' positions and none is given twice."""
    return Step(
        trajectory_id=trajectory_id,
        index=index,
        choice=like.choice if like is not None else 0,
        model=like.model if like is not None else "",
        endpoint=like.endpoint if like is not None else "chat.completions",
        started_at=like.started_at if like is not None else 0.0,
        status="failed",
        error=StepError(message="the step's record could not be written to the trajectory log",
                        type=NOT_LOGGED),
    )


def new_key() -> str:
    return SESSION_KEY_PREFIX + secrets.token_urlsafe(24)


def full_sizes(form: Step, logged: int, base: Step | None, sizes: dict[int, tuple[int, int]]) -> tuple[int,
                                                                                                       int]:
    """Upper bounds of what a step's full form holds (its encoded size; a choice's full form holds its first
    choice's request and prompt, not copies of them) and of what of it a step extending it repeats (its
    prompt and response ids, its request), without encoding the full form (120k ids a call would cost the
    proxy more than the step): a delta's full form is its logged form + what it repeats of its base."""
    if base is None:
        return logged, logged
    shared = sizes[base.index][1]
    enc = msgpack_encoder.encode
    new = len(enc(form.prompt_token_ids)) + len(enc(form.request)) + len(enc(form.response_token_ids))
    if form.delta is not None and form.delta.kind == "choice":
        return logged, shared + new  # its full form holds its first choice's request and prompt, not copies
    return logged + shared, shared + new
