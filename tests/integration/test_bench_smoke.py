"""The proxy benchmark (bench/proxy_overhead.py) in a tiny configuration: it runs, produces numbers for every
target and configuration, and its correctness checks hold. Timing thresholds are not asserted here (this
machine is shared); the benchmark prints PASS/MISS for those itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import recorded


def test_fixture_is_a_real_32_token_reply_with_ids_and_logprobs():
    fx = recorded.load()
    plain = json.loads(fx.reply)
    choice = plain["choices"][0]
    assert len(choice["token_ids"]) == 32
    assert len(choice["logprobs"]["content"]) == 32
    assert plain["prompt_token_ids"] and plain["usage"]["completion_tokens"] == 32
    chunks = [d for d in recorded.sse_data(fx.stream) if isinstance(d, dict)]
    streamed = [t for d in chunks for c in d["choices"] for t in (c.get("token_ids") or [])]
    assert streamed == choice["token_ids"]
    assert recorded.sse_data(fx.stream)[-1] == "[DONE]"
    assert b"".join(fx.stream_events) == fx.stream


def test_checks_catch_leaks_and_accept_stripped_bodies():
    fx = recorded.load()
    # What vLLM itself returns when nothing extra was asked for: nulls in the plain body.
    plain = json.loads(fx.reply)
    plain["prompt_token_ids"] = None
    plain["choices"][0]["logprobs"] = None
    plain["choices"][0]["token_ids"] = None
    assert recorded.same_agent_body(json.dumps(plain).encode(), fx.reply) is None
    # Keys removed instead of nulled, re-encoded compactly: also fine.
    compact = json.dumps(recorded.agent_view(json.loads(fx.reply)), separators=(",", ":")).encode()
    assert recorded.same_agent_body(compact, fx.reply) is None
    # A leak (the agent did not ask for token ids) or a changed content fails.
    assert recorded.same_agent_body(fx.reply, fx.reply) is not None
    plain["choices"][0]["message"]["content"] = "other"
    assert recorded.same_agent_body(json.dumps(plain).encode(), fx.reply) is not None
    # Streams: the recorded stream leaks; the stripped one passes; a lost chunk fails.
    assert recorded.same_agent_stream(fx.stream, fx.stream) is not None
    events = [e if e == "[DONE]" else recorded.agent_view(e) for e in recorded.sse_data(fx.stream)]
    sse = b"".join(
        b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events
    )
    assert recorded.same_agent_stream(sse, fx.stream) is None
    cut = b"".join(
        b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n"
        for e in events[:5] + events[6:]
    )
    assert recorded.same_agent_stream(cut, fx.stream) is not None


@pytest.mark.timeout(300)
def test_benchmark_tiny_run_produces_numbers_and_checks_hold(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(BENCH / "proxy_overhead.py"),
        "--rounds",
        "1",
        "--seconds",
        "20",  # a bound only: each run stops after its 24 calls (a slow shared machine must not cut it short)
        "--requests",
        "24",
        "--warmup",
        "4",
        "--concurrency",
        "1,4",
        "--out",
        str(out),
        "--quiet",
    ]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["problems"] == []
    rows = result["summary"]["configs"]
    assert {(r["mode"], r["concurrency"], r["target"]) for r in rows} == {
        (m, c, t) for m in ("plain", "stream") for c in (1, 4) for t in ("direct", "passthrough", "steptap")
    }
    for r in rows:
        assert r["calls"] == 24, r
        assert r["calls_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"], r
    # Every call through steptap (warm-up included) left exactly one step in its durable log.
    log = result["log"]
    assert log["one_step_per_call"] and log["steps"] == log["calls_sent"] == 4 * (24 + 4)
    assert set(result["summary"]["targets"]) == {"plain c=1", "plain c=4", "stream c=1", "stream c=4"}
    assert "| steptap |" in proc.stdout
