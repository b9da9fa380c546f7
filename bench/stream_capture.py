"""What capturing a streamed chat call costs per event, without HTTP: the relay's per-event work alone.

    .venv/bin/python bench/stream_capture.py [--fixture chat_32_tokens] [--reps 80]

For each event of the recorded stream (bench/fixtures/), as the stream relay (``sse.StreamRelay``) does for an
agent that asked for neither token ids nor logprobs: the JSON decoded to a dict, fed to
``accumulator.ChatStream``, stripped (``capture.strip_chunk``) and re-encoded; then the step built from the
reassembled reply. Prints the median and the fastest of ``--reps`` timings (microseconds per streamed call,
and per stage), hot in one process: a lower bound of what these stages cost in the server, where the
proxy-wide profile (``profile_top.py``) attributes to them also the time its event loop waits for the GIL
there. Exits 1 when the reassembled reply does not give one ok step with a logprob per token.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
from recorded import load

from steptap.middleware.proxy import accumulator, capture
from steptap.middleware.proxy.capture import CHAT, Asked
from steptap.middleware.records import json_encoder

_COMMON = {"model": "tiny", "served_model": "tiny", "backend": "http://x", "started_at": 1.0,
           "latency_s": 0.5}
_NEITHER = Asked(token_ids=False, logprobs=False)


def _payloads(stream: bytes) -> list[bytes]:
    events = (e.removeprefix(b"data:").strip() for e in stream.split(b"\n\n"))
    return [e for e in events if e and e != b"[DONE]"]


def _timed(fn: Callable[[], Any], reps: int, inner: int = 20) -> tuple[float, float]:
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - start) / inner * 1e6)
    runs.sort()
    return runs[len(runs) // 2], runs[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default="chat_32_tokens")
    parser.add_argument("--reps", type=int, default=80)
    args = parser.parse_args()
    payloads = _payloads(load(args.fixture).stream)
    decoded = [msgspec.json.decode(p) for p in payloads]

    def feed() -> accumulator.ChatStream:
        acc = accumulator.ChatStream()
        for chunk in decoded:
            acc.feed(chunk)
        return acc

    def decode_strip_encode() -> None:
        for p in payloads:  # stripping is in place: each run decodes afresh
            chunk = msgspec.json.decode(p)
            if capture.strip_chunk(chunk, _NEITHER, CHAT):
                json_encoder.encode(chunk)

    whole = feed().reply()
    steps = capture.steps_from_reply(whole, CHAT, **_COMMON)
    if len(steps) != 1 or steps[0].status != "ok" or not steps[0].response_token_ids or (
            len(steps[0].response_logprobs) != len(steps[0].response_token_ids)):
        print(f"FAIL: the reassembled reply gives {steps}", file=sys.stderr)
        sys.exit(1)
    stages = {
        "decode": lambda: [msgspec.json.decode(p) for p in payloads],
        "feed": feed,
        "decode + strip + encode": decode_strip_encode,
        "steps": lambda: capture.steps_from_reply(whole, CHAT, **_COMMON),
    }
    print(f"{args.fixture}: {len(payloads)} events, us per streamed call (median, fastest of {args.reps})")
    for name, fn in stages.items():
        med, low = _timed(fn, args.reps)
        print(f"  {name:45s} {med:8.1f} {low:8.1f}")


if __name__ == "__main__":
    main()
