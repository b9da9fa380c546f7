"""``Holdings``: what the proxy holds against its limits (docs/limits.md): model calls in flight, and the
steps and encoded bytes of open sessions (their steps as logged: a step that extends the previous call counts
only what it adds, so a long session's bytes grow with its new tokens, not with its context times its turns).
It raises the domain errors a limit ends in (``Overloaded``, ``SessionFull``) and keeps the gauges of
``/metrics`` in step, so the session manager only asks."""

from __future__ import annotations

import re

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import Overloaded, RequestTooComplex, SessionFull
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Step, msgpack_encoder

NODE_BYTES = 80  # memory of one decoded JSON value, at most (an empty dict and its list slot: 72)
# Copies of a body a call holds at once, measured: while read (aiohttp's buffer and its bytes), and once in
# (raw, decoded, the upstream body, the step's encoded record and its frame in the writer).
READ_COPIES, CALL_COPIES = 3, 6
RECORD_SLACK = 256  # bytes a step gains when it is indexed and linked (ids, index, prefix), over-estimated
RETRY_AFTER_S = 1.0  # what a 429 tells the caller to wait
# A body this small is charged its worst case (a JSON value per byte: at most 160 KiB of estimate) instead of
# counted: the count would cost a short call about 1 % of its CPU
SMALL_BODY = 2048


class Holdings:
    def __init__(self, config: ProxyConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.calls_inflight = 0  # model calls admitted and not yet answered (max_concurrent_calls)
        self.peer_calls: dict[str, int] = {}  # calls in flight per client address (max_calls_per_peer)
        self.steps_held = 0  # steps of open sessions, in memory
        self.bytes_held = 0  # their encoded size
        self.body_bytes = 0  # estimated memory of the model-call bodies in flight (max_body_memory)
        # The gauges read these counts when /metrics is scraped: nothing is set per call (each set takes the
        # gauge's lock; five a call)
        metrics.calls_inflight.set_function(lambda: self.calls_inflight)
        metrics.body_bytes.set_function(lambda: self.body_bytes)
        metrics.steps_held.set_function(lambda: self.steps_held)
        metrics.bytes_held.set_function(lambda: self.bytes_held)

    def admitted(self, peer: str | None = None) -> Admitted:
        """Around one model call, from its first byte (``with holdings.admitted(peer):``, counted when called,
        given back when the block ends): more than ``max_concurrent_calls`` at once, or more than
        ``max_calls_per_peer`` from one client address, get a 429 with Retry-After (the backend would only
        queue them, each holds memory here, and one peer must not take every slot)."""
        cap = self.config.max_concurrent_calls
        if self.calls_inflight >= cap:
            raise Overloaded(
                f"too many model calls in flight (max_concurrent_calls={cap}); retry later",
                retry_after_s=RETRY_AFTER_S,
            )
        peer = peer or ""  # a unix-socket client has no address: one peer
        mine = self.peer_calls.get(peer, 0)
        if mine >= self.config.max_calls_per_peer:
            raise Overloaded(
                f"too many model calls in flight from this client (max_calls_per_peer="
                f"{self.config.max_calls_per_peer}); retry later",
                retry_after_s=RETRY_AFTER_S,
            )
        self.calls_inflight += 1
        self.peer_calls[peer] = mine + 1
        return Admitted(self, peer)

    def body_memory(self, declared: int | None) -> BodyHold:
        """Around one model call's body, from before it is read (``with holdings.body_memory(n) as hold:``,
        held when called, given back when the block ends): its declared length (or the body limit, when
        chunked) is held against ``max_body_memory`` first, then what it costs once read
        (``BodyHold.read``)."""
        hold = BodyHold(self)
        limit = self.config.body_limit
        hold.resize(READ_COPIES * min(declared if declared is not None else limit, limit))
        return hold

    def check_session_calls(self, sid: str, inflight: int) -> None:
        cap = self.config.max_calls_per_session
        if inflight >= cap:
            raise Overloaded(
                f"session {sid!r} has {inflight} model calls in flight (max_calls_per_session={cap}); retry "
                "later",
                retry_after_s=RETRY_AFTER_S,
            )

    def check_open(self, open_sessions: int, auto: bool = False) -> None:
        """Named sessions (``POST /sessions``) and auto-created ones have caps of their own: an agent's calls
        on made-up ids never take the environment's room."""
        name, cap = ("max_auto_sessions", self.config.max_auto_sessions) if auto else (
            "max_open_sessions", self.config.max_open_sessions)
        if open_sessions >= cap:
            raise Overloaded(
                f"{open_sessions} sessions are open ({name}={cap}): finish some, or retry later",
                retry_after_s=RETRY_AFTER_S,
            )

    def check_auto(self, open_auto: int, peer_auto: int) -> None:
        """A new auto session: within ``max_auto_sessions``, and within its caller's share
        (``max_auto_sessions_per_peer``), so one address cannot keep the table full for every agent."""
        self.check_open(open_auto, auto=True)
        cap = self.config.max_auto_sessions_per_peer
        if peer_auto >= cap:
            raise Overloaded(
                f"this client opened {peer_auto} auto sessions (max_auto_sessions_per_peer={cap}): finish "
                "some, or retry later", retry_after_s=RETRY_AFTER_S,
            )

    def check_room(self, sid: str, held_steps: int, held_bytes: int, steps: int, size: int) -> None:
        """SessionFull unless a session holding ``held_*`` may take ``steps`` steps of ``size`` bytes more."""
        cfg = self.config
        if held_steps + steps > cfg.max_session_steps:
            raise SessionFull(
                f"session {sid!r} holds {held_steps} steps; {steps} more would pass max_session_steps="
                f"{cfg.max_session_steps}: finish it and open a new one"
            )
        if self.bytes_held + size > cfg.max_bytes_held:
            raise Overloaded(
                f"open sessions hold {self.bytes_held} bytes; {size} more would pass max_bytes_held="
                f"{cfg.max_bytes_held}: retry once sessions finish", retry_after_s=RETRY_AFTER_S,
            )
        if held_bytes + size > cfg.max_session_bytes:
            raise SessionFull(
                f"session {sid!r} holds {held_bytes} bytes; {size} more would pass "
                f"max_session_bytes={cfg.max_session_bytes}: finish it and open a new one"
            )

    @staticmethod
    def size_of(steps: list[Step]) -> int:
        """What ``steps`` add to their session, in the form it holds and logs them (delta steps: only what is
        new; one more encode: the exact size, not a guess)."""
        return sum(len(msgpack_encoder.encode(s)) + RECORD_SLACK for s in steps)

    def hold(self, steps: int, size: int) -> None:
        self.steps_held += steps
        self.bytes_held += size


_ALL_BUT_NODES = bytes(range(256)).translate(None, b",{[")  # every byte that opens no value
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_nodes(raw: bytes, cap: int) -> int:
    """An upper bound on the JSON values in ``raw``, counted without decoding: commas and openings; when that
    passes ``cap``, counted again outside strings (braces and commas in text are not values)."""
    quick = len(raw.translate(None, _ALL_BUT_NODES))  # one pass, keeping only ",{[" (0.8x deleting them)
    if quick <= cap:
        return quick
    bare = _JSON_STRING.sub(b"", raw)
    return bare.count(b",") + bare.count(b"{") + bare.count(b"[")


class Admitted:
    """One model call admitted (``Holdings.admitted``), until its block ends: objects, not generators' context
    managers, for what every call enters (a third of the cost)."""

    __slots__ = ("holdings", "peer")

    def __init__(self, holdings: Holdings, peer: str) -> None:
        self.holdings, self.peer = holdings, peer

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        h = self.holdings
        h.calls_inflight -= 1
        left = h.peer_calls[self.peer] - 1
        if left:
            h.peer_calls[self.peer] = left
        else:
            del h.peer_calls[self.peer]  # bounded by the calls in flight


class BodyHold:
    """One call's share of ``max_body_memory``, held until its block ends."""

    def __init__(self, holdings: Holdings) -> None:
        self.holdings = holdings
        self.size = 0

    def __enter__(self) -> BodyHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.resize(0)

    def read(self, raw: bytes) -> None:
        """The body is in: 413 with more values than ``max_json_nodes``, 429 when its estimated memory (raw,
        its copies, and ``NODE_BYTES`` a decoded value; a body up to ``SMALL_BODY`` bytes a value per byte)
        would pass ``max_body_memory``."""
        cfg = self.holdings.config
        size, cap = len(raw), cfg.max_json_nodes
        # a body can hold no more values than bytes: under both bounds, no count and no 413 to find
        nodes = size if size <= SMALL_BODY and size <= cap else json_nodes(raw, cap)
        if nodes > cap:
            raise RequestTooComplex(
                f"request body has more than {cfg.max_json_nodes} JSON values (max_json_nodes)"
            )
        self.resize(CALL_COPIES * size + NODE_BYTES * nodes)

    def resize(self, size: int) -> None:
        h = self.holdings
        if size > self.size and h.body_bytes - self.size + size > h.config.max_body_memory:
            raise Overloaded(
                f"model-call bodies in flight would pass max_body_memory={h.config.max_body_memory} bytes; "
                "retry later", retry_after_s=RETRY_AFTER_S,
            )
        h.body_bytes += size - self.size
        self.size = size
