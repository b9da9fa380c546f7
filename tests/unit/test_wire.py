"""The stream's wire format (shared by server and client): cursors, framing, and non-finite logprobs."""

from __future__ import annotations

import math

import msgspec
import pytest

from steptap.middleware.records import Step, Trajectory
from steptap.middleware.wire import (
    LEN,
    RawTrajectoryMessage,
    StreamMessage,
    decode_envelope,
    decode_trajectory,
    encode_message,
    format_cursor,
    parse_cursor,
)


def test_cursors_round_trip_and_order() -> None:
    assert parse_cursor(format_cursor(3, 1048576)) == (3, 1048576)
    assert parse_cursor("2:9") < parse_cursor("10:8")  # ordered as positions, not as strings


@pytest.mark.parametrize("bad", ["", "3", "3:", ":4", "a:1", "1:-2", "1:2\n", " 1:2", "1:2:3"])
def test_bad_cursors_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_cursor(bad)


def _traj_with(logprobs: list[float]) -> Trajectory:
    return Trajectory(id="t", status="finished",
                      steps=[Step(response_token_ids=list(range(len(logprobs))), response_logprobs=logprobs)])


@pytest.mark.parametrize("fmt", ["ndjson", "msgpack"])
def test_non_finite_logprobs_reach_the_reader_as_nan(fmt: str) -> None:
    """An echoed prompt's first token has no logprob (NaN): JSON writes it as null, and a reader must not
    fail on it. Decoding the NDJSON line with the plain record type did (ValidationError)."""
    traj = _traj_with([math.nan, -0.5, -math.inf, math.inf])
    data = encode_message(StreamMessage(cursor="1:8", trajectory=traj), fmt)  # type: ignore[arg-type]
    body = data[:-1] if fmt == "ndjson" else data[LEN.size:]
    if fmt == "ndjson":
        assert b"[null,-0.5,null,null]" in body
    env = decode_envelope(body, fmt)  # type: ignore[arg-type]
    got = decode_trajectory(env.trajectory, fmt)  # type: ignore[arg-type]
    lps = got.steps[0].response_logprobs
    assert math.isnan(lps[0]) and lps[1] == -0.5
    if fmt == "msgpack":  # msgpack keeps infinities exactly; JSON has no way to
        assert lps[2:] == [-math.inf, math.inf]
    else:
        assert all(math.isnan(v) for v in lps[2:])


def test_a_record_that_is_not_a_trajectory_is_an_error_for_the_reader_to_count() -> None:
    bad = msgspec.to_builtins(_traj_with([-1.0]))
    bad["steps"][0]["model"] = 1
    raw = RawTrajectoryMessage(cursor="1:8", trajectory=msgspec.Raw(msgspec.msgpack.encode(bad)))
    env = decode_envelope(encode_message(raw, "msgpack")[LEN.size:], "msgpack")
    assert env.cursor == "1:8"  # the envelope still reads: the reader can move past the record
    with pytest.raises(msgspec.ValidationError):
        decode_trajectory(env.trajectory, "msgpack")


def test_heartbeats_and_skips_carry_no_trajectory() -> None:
    for msg in (StreamMessage(cursor="1:8", heartbeat=1.0), StreamMessage(cursor="1:8", skipped="bad")):
        for fmt in ("ndjson", "msgpack"):
            data = encode_message(msg, fmt)  # type: ignore[arg-type]
            env = decode_envelope(data[:-1] if fmt == "ndjson" else data[LEN.size:], fmt)  # type: ignore[arg-type]
            assert not env.trajectory and (env.heartbeat, env.skipped) == (msg.heartbeat, msg.skipped)
