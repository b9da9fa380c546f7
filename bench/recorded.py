"""Recorded vLLM replies (bench/fixtures/) and what an agent should see of them through the proxy.

A fixture is one JSON file written by ``record_fixtures.py`` (gzipped when large: ``NAME.json.gz``): the
request sent to vLLM, the non-streamed reply body and the streamed reply (raw SSE text), both kept byte for
byte. The benchmark replays them from an instant upstream, so it needs no vLLM.

The agent in the benchmark asks for neither logprobs nor token ids; the proxy adds them upstream and must
strip them from what the agent gets. ``agent_view`` turns a recorded body into the body the agent should see,
and ``same_agent_body`` / ``same_agent_stream`` compare parsed JSON (not bytes: a proxy may re-encode),
treating a stripped key that is absent the same as one that is null (vLLM itself writes ``null`` in plain
replies and leaves the key out of stream chunks).
"""

from __future__ import annotations

import copy
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DEFAULT_FIXTURE = "chat_32_tokens"
LONG_FIXTURE = "chat_1400_tokens"  # a long streamed reply: 1,400 tokens, 1,403 SSE events

# What the proxy adds upstream and must strip before the agent sees the reply.
STRIPPED_TOP = ("prompt_token_ids", "prompt_logprobs")
STRIPPED_CHOICE = ("logprobs", "token_ids")


@dataclass(frozen=True)
class Fixture:
    name: str
    served_model: str
    request: dict[str, Any]  # what was sent to vLLM to record it (logprobs and token ids on)
    agent_request: dict[str, Any]  # what the benchmark's agent sends (neither asked for)
    reply: bytes  # the non-streamed JSON body, exactly as vLLM sent it
    stream: bytes  # the streamed body (SSE), exactly as vLLM sent it
    models: bytes  # vLLM's GET /v1/models body

    @property
    def max_tokens(self) -> int:
        """What tells this fixture's calls apart at the replay upstream (each fixture has its own)."""
        return int(self.agent_request["max_tokens"])

    @property
    def stream_events(self) -> list[bytes]:
        """The SSE events, each with its blank-line terminator, in order (the replay writes one per flush)."""
        return split_sse(self.stream)

    def agent_body(self, stream: bool) -> bytes:
        body = dict(self.agent_request, stream=stream)
        if stream:
            # Ask for the usage chunk, as vLLM's recording did, so the replay and the agent agree.
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body).encode()


def load(name: str = DEFAULT_FIXTURE) -> Fixture:
    plain, packed = FIXTURES / f"{name}.json", FIXTURES / f"{name}.json.gz"
    raw = json.loads(plain.read_bytes() if plain.exists() else gzip.decompress(packed.read_bytes()))
    return Fixture(
        name=name,
        served_model=raw["served_model"],
        request=raw["request"],
        agent_request=raw["agent_request"],
        reply=raw["reply"].encode(),
        stream=raw["stream"].encode(),
        models=raw["models"].encode(),
    )


def split_sse(body: bytes) -> list[bytes]:
    parts = body.split(b"\n\n")
    events = [p + b"\n\n" for p in parts[:-1] if p.strip()]
    if parts[-1].strip():  # an unterminated tail (a cut stream) is kept as it is
        events.append(parts[-1])
    return events


def sse_data(body: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body, parsed (``[DONE]`` kept as the string)."""
    out: list[Any] = []
    for event in split_sse(body):
        for line in event.decode().splitlines():
            if line.startswith("data:"):
                payload = line[5:].strip()
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def agent_view(obj: Any) -> Any:
    """A reply object (body or stream chunk) minus what the agent did not ask for."""
    if not isinstance(obj, dict):
        return obj
    out = copy.deepcopy(obj)
    for key in STRIPPED_TOP:
        out.pop(key, None)
    for choice in out.get("choices") or []:
        for key in STRIPPED_CHOICE:
            choice.pop(key, None)
    return out


def _vllm_would_send(chunk: Any) -> bool:
    """False for a chat chunk that exists only to carry token ids or logprobs (an empty delta, no finish
    reason, no usage: e.g. a token whose text is held back until the next): vLLM sends none when neither is
    asked for, so the agent must not get it either."""
    if not isinstance(chunk, dict) or not chunk.get("choices") or chunk.get("usage"):
        return True
    return any(c.get("delta") or c.get("finish_reason") is not None for c in chunk["choices"])


def _normalize_seen(obj: Any) -> Any:
    """Drop stripped keys only where they are null: a non-null one is a leak and must fail the comparison."""
    if not isinstance(obj, dict):
        return obj
    out = copy.deepcopy(obj)
    for key in STRIPPED_TOP:
        if key in out and out[key] is None:
            del out[key]
    for choice in out.get("choices") or []:
        for key in STRIPPED_CHOICE:
            if key in choice and choice[key] is None:
                del choice[key]
    return out


def same_agent_body(seen: bytes, recorded: bytes) -> str | None:
    """None when ``seen`` is the recorded plain reply as the agent should see it, else what differs."""
    try:
        got = _normalize_seen(json.loads(seen))
    except ValueError as exc:
        return f"not JSON ({exc}): {seen[:200]!r}"
    want = agent_view(json.loads(recorded))
    return None if got == want else _diff(got, want)


def same_agent_stream(seen: bytes, recorded: bytes) -> str | None:
    """None when the streamed body carries the recorded chunks, in order, as the agent should see them."""
    try:
        got = [_normalize_seen(d) for d in sse_data(seen)]
    except ValueError as exc:
        return f"bad SSE ({exc}): {seen[:200]!r}"
    want = [v for v in map(agent_view, sse_data(recorded)) if _vllm_would_send(v)]
    if len(got) != len(want):
        return f"{len(got)} events, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return f"event {i}: {_diff(g, w)}"
    return None


def _diff(got: Any, want: Any) -> str:
    if isinstance(got, dict) and isinstance(want, dict):
        keys = sorted(set(got) | set(want))
        bad = [k for k in keys if got.get(k, "<absent>") != want.get(k, "<absent>")]
        return "; ".join(
            f"{k}: got {str(got.get(k, '<absent>'))[:120]} want {str(want.get(k, '<absent>'))[:120]}"
            for k in bad[:4]
        )
    return f"got {str(got)[:200]} want {str(want)[:200]}"
