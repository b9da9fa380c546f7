"""The benchmarks in their smallest form, so that they cannot rot: the proxy benchmark
(bench/proxy_overhead.py, the long streamed reply included), the end-to-end one on the real vLLM
(bench/end_to_end.py), the learner's throughput (bench/learner_throughput.py), the log's commit rate, the
record path alone (bench/record_path.py), the loop's calls a call (bench/call_counts.py) and the model
call's trace (bench/call_trace.py). Each runs, produces numbers, and its own correctness checks hold. Timing
thresholds are not asserted here (the machine is shared); the benchmarks print PASS/MISS themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import recorded  # noqa: E402 - from bench/, put on sys.path above
from overhead_report import verdicts  # noqa: E402


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


def test_long_fixture_is_a_real_1400_token_stream():
    fx = recorded.load(recorded.LONG_FIXTURE)
    plain = json.loads(fx.reply)
    ids = plain["choices"][0]["token_ids"]
    assert len(ids) == fx.max_tokens == 1400 and plain["usage"]["completion_tokens"] == 1400
    chunks = [d for d in recorded.sse_data(fx.stream) if isinstance(d, dict)]
    assert [t for d in chunks for c in d["choices"] for t in (c.get("token_ids") or [])] == ids
    assert fx.max_tokens != recorded.load().max_tokens  # the replay tells the two apart by it
    # Chunks that only carry a held-back token's id and logprob: vLLM sends none when neither is asked for, so
    # the agent must not get them either; a proxy that relayed them (stripped) fails the check.
    views = [e if e == "[DONE]" else recorded.agent_view(e) for e in recorded.sse_data(fx.stream)]
    assert any(isinstance(v, dict) and v["choices"] and v["choices"][0]["delta"] == {} for v in views)
    relayed = b"".join(b"data: " + (v if isinstance(v, str) else json.dumps(v)).encode() + b"\n\n"
                       for v in views)
    assert recorded.same_agent_stream(relayed, fx.stream) is not None
    kept = [v for v in views if not (isinstance(v, dict) and v["choices"] and v["choices"][0]["delta"] == {}
                                     and v["choices"][0]["finish_reason"] is None and not v.get("usage"))]
    sse = b"".join(b"data: " + (v if isinstance(v, str) else json.dumps(v)).encode() + b"\n\n" for v in kept)
    assert recorded.same_agent_stream(sse, fx.stream) is None


def test_verdicts_judge_each_measured_target():
    def figures(ratio: float, p99: float, added: float, cpu: float) -> dict[str, float]:
        return {"ratio_calls_per_s": ratio, "ratio_p99": p99, "added_p50_ms": added, "ratio_cpu": cpu,
                "added_cpu_ms_per_call": 0.0}

    got = verdicts({
        "plain c=32": figures(0.81, 9.0, 9.0, 2.5),
        "stream c=256": figures(0.69, 1.4, 9.0, float("nan")),
        "stream c=1": figures(0.1, 9.0, 0.5, 2.0),
        "long c=32": figures(0.1, 9.0, 9.0, 1.0),
    })
    assert {k: v["pass"] for k, v in got.items()} == {
        "plain c=32: calls/s, steptap / pass-through >= 0.8": True,
        "plain c=32: proxy CPU per call, steptap / pass-through <= 2.0": False,
        "stream c=256: calls/s, steptap / pass-through >= 0.7": False,
        "stream c=256: p99, steptap / pass-through <= 1.5": True,
        "stream c=256: proxy CPU per call, steptap / pass-through <= 2.0": None,  # no figure: not judged
        "stream c=1: added p50 ms, steptap - pass-through <= 0.5": True,
        "stream c=1: proxy CPU per call, steptap / pass-through <= 2.0": True,
        "long c=32: proxy CPU per call, steptap / pass-through <= 2.0": True,
    }


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
        "--long-concurrency",
        "1",
        "--out",
        str(out),
        "--quiet",
    ]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["problems"] == []
    rows = result["summary"]["configs"]
    targets = ("direct", "passthrough", "steptap")
    assert {(r["mode"], r["concurrency"], r["target"]) for r in rows} == {
        (m, c, t) for m in ("plain", "stream") for c in (1, 4) for t in targets
    } | {("long", 1, t) for t in targets}
    for r in rows:
        assert r["calls"] == 24, r
        assert r["calls_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"], r
    # Every call through steptap (warm-up included) left exactly one step in its durable log.
    log = result["log"]
    assert log["one_step_per_call"] and log["steps"] == log["calls_sent"] == 5 * (24 + 4)
    assert set(result["summary"]["targets"]) == {"plain c=1", "plain c=4", "stream c=1", "stream c=4",
                                                 "long c=1"}
    # The replay served the long reply to the long rows only: 3 targets x (24 + 4) streamed calls.
    assert result["replay_stats"][f"chat_stream {recorded.LONG_FIXTURE}"] == 3 * (24 + 4)
    assert "| steptap |" in proc.stdout


@pytest.mark.timeout(300)
def test_benchmark_runs_an_older_ref_side_by_side(tmp_path):
    """``--baseline REF``: the proxy at a git ref (here this checkout's HEAD, exported) served beside this
    checkout's, its own log counted by its own reader, its bodies checked, its ratios to the same pass-through
    and steptap's to it in the summary. Two rounds with ``--fresh-proxies``: each proxy restarted once, its
    log kept across the restart (every call sent is a step in it)."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(BENCH / "proxy_overhead.py"), "--baseline", "HEAD",
           "--targets", "passthrough,steptap,baseline", "--rounds", "2", "--fresh-proxies", "--seconds", "20",
           "--requests", "12", "--warmup", "2", "--concurrency", "1,2", "--modes", "plain,stream",
           "--long-concurrency", "", "--out", str(out), "--quiet", "--budget", str(tmp_path / "none.json")]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["problems"] == [] and result["baselines"] == {"baseline": "HEAD"}
    rows = {(r["mode"], r["concurrency"], r["target"]): r for r in result["summary"]["configs"]}
    assert {t for _, _, t in rows} == {"passthrough", "steptap", "baseline"}
    assert all(r["calls"] == 2 * 12 for r in rows.values()), rows  # both rounds
    for name in ("steptap", "baseline"):  # each its own log: one step per call sent to it
        log = result["logs"][name]
        assert log["one_step_per_call"] and log["steps"] == log["calls_sent"] == 2 * 4 * (12 + 2), log
    assert result["restarts"] == {"steptap": 1, "baseline": 1}, result.get("restarts")
    keys = {"plain c=1", "plain c=2", "stream c=1", "stream c=2"}
    assert set(result["summary"]["baselines"]["baseline"]) == keys
    assert set(result["summary"]["vs_baseline"]["baseline"]) == keys
    assert "steptap / baseline (HEAD)" in proc.stdout and "CPU per call" in proc.stdout


@pytest.mark.timeout(300)
def test_end_to_end_smallest_run_on_the_real_vllm(vllm_server, tmp_path):
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(BENCH / "end_to_end.py"), "--backend", vllm_server.url, "--pairs", "1",
           "--turns", "2", "--max-tokens", "4", "--out", str(out), "--quiet"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["problems"] == []
    # One warm-up call and one 2-call episode through steptap, each a step in its log.
    assert result["log"]["steps"] == result["log"]["calls_sent"] == 3 and result["log"]["failed_steps"] == 0
    (rnd,) = result["pairs"]
    for path in ("direct", "direct_lp", "steptap"):
        assert rnd[path]["calls"] == 2 and 0 < rnd[path]["wall_s"], rnd
    assert result["summary"]["rounds"] == 1 and "steptap / direct" in proc.stdout


@pytest.mark.timeout(300)
def test_learner_throughput_smallest_run(tiny_model_dir, tmp_path):
    out = tmp_path / "learner.json"
    # 4 rows of 24 tokens, a 48-token budget: 2 micro-batches, so accumulation is exercised on both sides.
    cmd = [sys.executable, str(BENCH / "learner_throughput.py"), "--model-dir", str(tiny_model_dir),
           "--groups", "2", "--members", "2", "--prompt-tokens", "16", "--response-tokens", "8",
           "--micro-batch-tokens", "48", "--pairs", "1", "--threads", "1", "--out", str(out), "--quiet"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["problems"] == []
    s = result["summary"]
    assert (s["rows"], s["seq_tokens"], s["trained_tokens"], s["micro_batches"]) == (4, 96, 32, 2)
    assert s["bare_tokens_per_s"] > 0 and s["engine_tokens_per_s"] > 0 and len(result["pairs"]) == 1


def test_wal_commit_rate_smallest_run(tmp_path):
    """The log's commit-rate benchmark (moved out of tests/unit): a short run prints its figures and its
    syncs-per-append checks hold."""
    cmd = [sys.executable, str(BENCH / "wal_commit_rate.py"), "--dir", str(tmp_path), "--seconds", "0.3"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["concurrency 1", "concurrency 64"], proc.stdout
    assert "1.000 syncs/append" in lines[0]


def test_record_path_smallest_run(tmp_path):
    """The record path alone (bench/record_path.py): a short run prints its CPU a call, and the log holds one
    one-step anonymous trajectory per call it made (warm-up included)."""
    cmd = [sys.executable, str(BENCH / "record_path.py"), "--dir", str(tmp_path), "--calls", "64",
           "--concurrency", "4"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "us CPU a call" in proc.stdout and "NOT one per call" not in proc.stdout, proc.stdout
    assert "log: 144 one-step anonymous trajectories" in proc.stdout, proc.stdout  # 16 x 4 + 20 x 4 to warm


@pytest.mark.parametrize("mode", ["calls", "opcodes"])
def test_call_counts_smallest_run(tmp_path, mode):
    """The loop's Python calls a call (bench/call_counts.py), or every thread's bytecodes (``--opcodes``): the
    difference of two profiled runs, per call, enters steptap's proxy and aiohttp, and the table prints the
    total the JSON holds. Bytecodes are counted in the log's writer thread too."""
    out, scratch = tmp_path / "counts.json", tmp_path / "tmp"
    scratch.mkdir()
    cmd = [sys.executable, str(BENCH / "call_counts.py"), "--calls", "20", "--json", str(out)]
    proc = subprocess.run(cmd + (["--opcodes"] if mode == "opcodes" else []), check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not any(scratch.iterdir()), list(scratch.iterdir())  # its profiles and logs removed
    counts = json.loads(out.read_text())["steptap"]
    least = 10 if mode == "calls" else 1000
    assert sum(n for f, n in counts.items() if f.startswith("middleware/proxy/")) >= least, counts
    assert sum(n for f, n in counts.items() if f.startswith("aiohttp/")) >= least, counts
    assert f"| all | {sum(counts.values()):.0f} |" in proc.stdout, proc.stdout
    if mode == "opcodes":
        assert counts.get("middleware/log/writer.py:CommitThread._run", 0) > 0, counts


def test_stream_capture_smallest_run():
    """A streamed call's capture alone (bench/stream_capture.py): a short run prints each stage's figure, and
    its check (one ok step, a logprob per token) passes on the recorded stream."""
    cmd = [sys.executable, str(BENCH / "stream_capture.py"), "--reps", "2"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "chat_32_tokens: 34 events" in proc.stdout, proc.stdout
    for stage in ("decode", "feed", "decode + strip + encode", "steps"):
        assert any(line.strip().startswith(stage) for line in proc.stdout.splitlines()), proc.stdout


def test_call_trace_on_the_real_vllm(vllm_server, tmp_path):
    """The newcomer's trace (bench/call_trace.py): both calls traced, each through its own modules, and the
    figures from the source printed."""
    out = tmp_path / "trace.json"
    cmd = [sys.executable, str(BENCH / "call_trace.py"), "--backend", vllm_server.url, "--json", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    chat, tito = result["calls"]["streamed chat"], result["calls"]["streamed Messages, TITO"]
    assert {"proxy.relay", "sessions.recording", "log.wal"} <= set(chat["modules"]), chat["modules"]
    assert {"proxy.tito", "proxy.messages"} <= set(tito["modules"]) - set(chat["modules"]), tito["modules"]
    for call in (chat, tito):
        assert set(call["back_edges"]) <= set(call["pairs"]) and len(call["two_way"]) * 2 == len(
            call["back_edges"])
    assert result["source"]["largest_module"]["lines"] > 0 and "| streamed chat |" in proc.stdout
