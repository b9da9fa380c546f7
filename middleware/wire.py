"""The trajectory stream's wire format, shared by the server (``log/stream.py``) and the client
(``client/stream.py``): cursors, the message struct, and the two framings.

**Cursors** name the position just after a log record: ``"SEGNO:OFFSET"`` (``"3:1048576"``). Clients treat
them as opaque and only hand back what they were given; ordering them is the one thing both sides do.

**Messages** (``StreamMessage``): ``{"cursor": C, "trajectory": {...}, "steps": [...]}``, ``{"cursor": C,
"heartbeat": T}``, ``{"cursor": C, "end": true}`` (a non-following stream caught up) or ``{"cursor": C,
"skipped": REASON}`` (a record the server could not decode was skipped; the cursor moves past it).

**A trajectory message is the trajectory as logged**, in both framings: ``trajectory`` is its record, which
refers to its steps (``step_refs``: where each Step record starts, and its rewards at the finish), and
``steps`` holds those Step records in ``step_refs`` order, each as logged: a step that extends an earlier one
of its trajectory is a delta (``Step.delta``: only its new prompt ids and request items). A long session thus
costs its new tokens once, not its whole context per step. ``decode_trajectory`` resolves the pair into full
steps (``delta.resolve``). A message written before the stream carried steps (or a trajectory whose record
embeds its steps) has no ``steps`` and full ``trajectory.steps``; readers take both.

**Framing**: ``ndjson`` is one JSON object per line; ``msgpack`` is a 4-byte big-endian length, then the
message as msgpack.

**Non-finite floats.** JSON has no NaN or infinity, so the JSON encoder writes them as ``null`` (logprobs of
``echo``ed prompt tokens are NaN). A reader of the NDJSON stream gets such a logprob back as NaN
(``decode_trajectory`` does this); msgpack carries them unchanged.
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec

from steptap.middleware.delta import resolve
from steptap.middleware.records import (
    Step,
    Trajectory,
    json_encoder,
    msgpack_encoder,
    step_json_decoder,
    step_msgpack_decoder,
    trajectory_json_decoder,
    trajectory_msgpack_decoder,
)

Format = Literal["ndjson", "msgpack"]
FORMATS = ("ndjson", "msgpack")
NDJSON = "application/x-ndjson"
MSGPACK = "application/x-msgpack"
LEN = struct.Struct(">I")  # the msgpack framing's length prefix
MAX_MESSAGE = 1 << 30  # a length prefix above this is a broken stream, not a message


# ---- cursors -----------------------------------------------------------------------------------------------


def format_cursor(segno: int, offset: int) -> str:
    return f"{segno}:{offset}"


def parse_cursor(cursor: str) -> tuple[int, int]:
    """``"SEGNO:OFFSET"`` -> ints (they order like positions in the log); ``ValueError`` for anything else."""
    seg, sep, off = str(cursor).partition(":")
    if not sep or not seg.isdigit() or not off.isdigit():
        raise ValueError(f"bad cursor {cursor!r}: expected SEGNO:OFFSET as returned by the log")
    return int(seg), int(off)


def cursor_key(segno: int, offset: int) -> int:
    return (segno << 40) | offset  # one sortable int (segments stay far below 1 TiB)


# ---- messages ----------------------------------------------------------------------------------------------


class StreamMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message of the stream: a trajectory, a heartbeat, a skipped record or the end of the stream."""

    cursor: str
    trajectory: Trajectory | None = None
    steps: list[Step] = []  # the logged steps ``trajectory.step_refs`` refers to (delta steps stay deltas)
    heartbeat: float | None = None
    end: bool = False
    skipped: str | None = None  # why the record before ``cursor`` was not sent


class RawTrajectoryMessage(msgspec.Struct, kw_only=True):
    """A trajectory message whose record is passed through as the log's msgpack bytes (no decode, re-encode),
    with the Step records it refers to (``Trajectory.step_refs``), as logged."""

    cursor: str
    trajectory: msgspec.Raw
    steps: list[msgspec.Raw] = []


class Envelope(msgspec.Struct, kw_only=True):
    """The reader's view of a message: the trajectory stays undecoded (``decode_trajectory``), so one bad
    record is skipped and counted without losing the cursor that moves past it."""

    cursor: str
    trajectory: msgspec.Raw = msgspec.Raw()  # empty (falsy) when the message carries none
    steps: list[msgspec.Raw] = []  # the logged steps it refers to
    heartbeat: float | None = None
    end: bool = False
    skipped: str | None = None


# The envelope's codecs are made here, its owner; the records' (and the one encoder) in records.py.
_env_json = msgspec.json.Decoder(Envelope)
_env_mp = msgspec.msgpack.Decoder(Envelope)


def encode_message(msg: StreamMessage | RawTrajectoryMessage, fmt: Format) -> bytes:
    if fmt == "ndjson":
        return json_encoder.encode(msg) + b"\n"
    body = msgpack_encoder.encode(msg)
    return LEN.pack(len(body)) + body


def decode_envelope(body: bytes, fmt: Format) -> Envelope:
    return _env_json.decode(body) if fmt == "ndjson" else _env_mp.decode(body)


def decode_trajectory(raw: bytes | msgspec.Raw, fmt: Format,
                      steps: list[msgspec.Raw] | None = None) -> Trajectory:
    """A message's trajectory, with full steps (``steps``: the logged steps it refers to);
    ``msgspec.ValidationError``/``DecodeError`` (or ``delta.DeltaError``) when it is not one. In JSON, a
    ``null`` logprob (how JSON carries NaN) is read back as NaN."""
    return resolve(*decode_logged(raw, fmt, steps))


def decode_logged(raw: bytes | msgspec.Raw, fmt: Format,
                  steps: list[msgspec.Raw] | None = None) -> tuple[Trajectory, list[Step]]:
    """A message's trajectory record and its logged steps, unresolved (``delta.resolve`` joins them)."""
    if fmt == "msgpack":
        return trajectory_msgpack_decoder.decode(raw), [step_msgpack_decoder.decode(s) for s in steps or ()]
    return _json_nan(raw, trajectory_json_decoder, Trajectory, "steps"), [
        _json_nan(s, step_json_decoder, Step, None) for s in steps or ()]


def _json_nan(raw: bytes | msgspec.Raw, dec: Any, kind: type[Any], steps_key: str | None) -> Any:
    """``raw`` decoded as ``kind``; a ``null`` logprob (JSON's NaN) read back as NaN."""
    try:
        return dec.decode(raw)
    except msgspec.ValidationError:
        obj = msgspec.json.decode(raw)
        if not isinstance(obj, dict):
            raise
        found = obj.get(steps_key) if steps_key else [obj]
        if not _nulls_to_nan(found):
            raise
        return msgspec.convert(obj, kind)


def _nulls_to_nan(steps: Any) -> bool:
    """Replace ``null`` logprobs in decoded steps with NaN; whether any was replaced."""
    changed = False
    for step in steps if isinstance(steps, list) else ():
        lps = step.get("response_logprobs") if isinstance(step, dict) else None
        if isinstance(lps, list) and None in lps:
            step["response_logprobs"] = [math.nan if v is None else v for v in lps]
            changed = True
    return changed


# ---- framing (reading) -------------------------------------------------------------------------------------


class StreamCut(Exception):
    """The stream ended inside a message (the connection dropped mid-frame)."""


async def read_frames(content: Any, fmt: Format, max_line: int = MAX_MESSAGE) -> AsyncIterator[bytes]:
    """The message bodies of a stream (``content``: an ``aiohttp.StreamReader``), in order."""
    if fmt == "ndjson":
        buf = b""
        async for chunk in content.iter_any():
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.strip():
                    yield line
            if len(buf) > max_line:
                raise StreamCut("an NDJSON line longer than any message")
        if buf.strip():
            raise StreamCut("stream cut inside a line")
        return
    while True:
        try:
            head = await content.readexactly(LEN.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise StreamCut("stream cut inside a frame header") from None
            return
        (n,) = LEN.unpack(head)
        if n > MAX_MESSAGE:
            raise StreamCut(f"a frame length of {n} bytes: not a steptap stream")
        try:
            yield await content.readexactly(n)
        except asyncio.IncompleteReadError:
            raise StreamCut("stream cut inside a frame") from None


__all__ = [
    "FORMATS", "LEN", "MSGPACK", "NDJSON", "Envelope", "Format", "RawTrajectoryMessage", "StreamCut",
    "StreamMessage", "cursor_key", "decode_envelope", "decode_logged", "decode_trajectory", "encode_message",
    "format_cursor", "parse_cursor", "read_frames",
]
