"""The backend boundary: what a model call gets back from vLLM, and the one place a failure on the wire
becomes a domain error.

``BackendReply`` is a whole reply (status, body, headers); ``BackendStream`` a streamed one, its body's lines
a list per network read (one async generator per stream: the relay's one read loop, nothing per chunk).
``mapped`` turns aiohttp's, the clock's and the OS's errors into ``exceptions.Backend*`` (as httpx's transport
does, once, below its client): nothing above ``backend/`` holds an aiohttp reply or catches an aiohttp error
(tests/unit/test_backend_boundary.py). ``Backend`` is the client as the proxy uses it: ``BackendClient``
(client.py) is one, and a fault-injecting fake can stand behind it (tests/faults.py, ``FaultBackend``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import aiohttp

from steptap.middleware.exceptions import (
    BackendCut,
    BackendMalformed,
    BackendStatus,
    BackendTimeout,
    BackendUnreachable,
    DomainError,
)

if TYPE_CHECKING:
    from steptap.middleware.backend.capabilities import Capabilities
    from steptap.middleware.backend.client import Parts

# What a call on the wire can raise (aiohttp's timeouts are TimeoutErrors, its OS errors ClientErrors)
WIRE_ERRORS = (TimeoutError, aiohttp.ClientError, OSError)
# Where a call failed: sending it (nothing was answered), reading a whole reply, reading a stream
Stage = Literal["send", "reply", "stream"]


def mapped(name: str, exc: BaseException, timeout_s: float, stage: Stage) -> DomainError:
    """The domain error for ``exc`` (one of ``WIRE_ERRORS``) on a call to backend ``name`` (as configured):
    silence for ``timeout_s`` is ``BackendTimeout``; a call that could not be sent ``BackendUnreachable``
    (nothing reached the backend: the call may move to another replica); a reply broken off ``BackendCut``."""
    if isinstance(exc, TimeoutError):
        return BackendTimeout(f"backend {name} sent nothing for {timeout_s:g}s"
                              + (" mid-stream" if stage == "stream" else ""))
    why = exc or type(exc).__name__
    if stage == "send":
        return BackendUnreachable(f"backend {name} is unreachable: {why}")
    return BackendCut(f"backend {name} cut the {stage}: {why}")


async def read_body(resp: aiohttp.ClientResponse, name: str, timeout_s: float) -> bytes:
    """A reply's whole body. An error status is the answer already: its body is best effort (b"" when it
    cannot be read); a good one's failure is the call's (``mapped``)."""
    try:
        return await resp.read()
    except WIRE_ERRORS as exc:
        if resp.status >= 400:
            return b""
        raise mapped(name, exc, timeout_s, "reply") from None


class BackendReply:
    """A whole reply, read and released: ``status``, ``body``, ``headers``."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        self.status = status
        self.body = body
        self.headers = headers


class BackendStream:
    """A streamed reply: ``status``, ``headers``, and ``batches`` (also ``async for``): the body's lines, a
    list per network read. From the wire (``open_stream``) its failures leave as ``BackendTimeout`` (silence),
    ``BackendCut`` (the body broken off) or ``BackendMalformed`` (an over-long line); a fake gives its own
    ``batches`` and no ``resp``. ``release`` when done (or ``async with``)."""

    __slots__ = ("status", "headers", "batches", "_resp", "_name", "_timeout_s")

    def __init__(self, status: int, batches: AsyncGenerator[list[bytes], None],
                 headers: Mapping[str, str] | None = None, *, resp: aiohttp.ClientResponse | None = None,
                 name: str = "", timeout_s: float = 0.0) -> None:
        self.status = status
        self.batches = batches
        self.headers: Mapping[str, str] = headers if headers is not None else {}
        self._resp = resp
        self._name, self._timeout_s = name, timeout_s

    def __aiter__(self) -> AsyncGenerator[list[bytes], None]:
        return self.batches

    async def __aenter__(self) -> BackendStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    @property
    def answered(self) -> bool:
        """Whether body bytes are in already (the first read then waits on nothing)."""
        return self._resp is not None and self._resp.content.total_bytes > 0

    async def read(self) -> bytes:
        """The whole body (an error status's, instead of ``batches``)."""
        return b"" if self._resp is None else await read_body(self._resp, self._name, self._timeout_s)

    async def raise_for_status(self) -> None:
        """``BackendStatus`` (with the body) on an error status."""
        if self.status >= 400:
            raise BackendStatus(self._name, self.status, await self.read())

    async def finish(self) -> None:
        """Read the body's end after its last event (the blank line and chunked terminator after [DONE]): a
        reply released unread closes its connection instead of returning it to the pool (a connect per
        call). Usually it came with [DONE] (no wait, and no task for wait_for); at most a second, else
        given up."""
        if self._resp is not None and not self._resp.content.is_eof():
            with contextlib.suppress(*WIRE_ERRORS):
                await asyncio.wait_for(self._resp.content.read(), 1.0)

    def release(self) -> None:
        if self._resp is not None:
            self._resp.release()


def open_stream(resp: aiohttp.ClientResponse, name: str, timeout_s: float, limit: int) -> BackendStream:
    """``resp``'s body as a ``BackendStream``; a line over ``limit`` bytes is ``BackendMalformed``."""
    return BackendStream(resp.status, _lines(resp.content, name, timeout_s, limit), resp.headers, resp=resp,
                         name=name, timeout_s=timeout_s)


async def _lines(content: aiohttp.StreamReader, name: str, timeout_s: float,
                 limit: int) -> AsyncGenerator[list[bytes], None]:
    """The lines of a byte stream, as a list per network read (a line cut between reads waits for its end);
    a wire failure leaves ``mapped``."""
    pending = b""
    try:
        async for data in content.iter_any():
            lines = (pending + data).split(b"\n")
            pending = lines.pop()
            if len(pending) > limit:
                raise BackendMalformed(f"backend {name} sent an over-long stream line")
            yield lines
    except WIRE_ERRORS as exc:
        raise mapped(name, exc, timeout_s, "stream") from None
    if pending:
        yield [pending]


@runtime_checkable
class Backend(Protocol):
    """One replica's client as the proxy's model calls use it (``client.BackendClient``; a fake stands behind
    it). ``send``, ``stream`` and ``post_json`` raise only ``exceptions.Backend*`` errors."""

    name: str  # as configured: in every message and record
    caps: Capabilities  # what it serves of what steptap uses (TITO routes, ...)

    async def send(self, endpoint: str, payload: bytes | Parts) -> BackendReply:
        """A model call (``client.ROUTES`` names it), its reply read whole, whatever its status."""
        ...

    async def stream(self, endpoint: str, payload: bytes | Parts) -> BackendStream:
        """A model call whose reply is read as it comes (any status: ``raise_for_status``, ``read``)."""
        ...

    async def post_json(self, endpoint: str, body: Any) -> bytes:
        """A JSON call on a route steptap makes for itself (render, generate, derender): the body of a good
        answer; an error status is ``BackendStatus``."""
        ...
