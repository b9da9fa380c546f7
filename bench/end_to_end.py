"""What steptap adds to an agent's wall time on real generation: the same agent episodes straight to vLLM and
through ``steptap serve``, interleaved.

    .venv/bin/python bench/end_to_end.py --backend http://127.0.0.1:18000 --out runs/bench-e2e.json

An episode is agent-shaped: a system prompt and a task, then ``--turns`` chat calls, each answer followed by a
tool result appended as the next user turn (the conversation grows as an agent's does). Every call generates
exactly ``--max-tokens`` tokens (``ignore_eos``, greedy), so every path asks vLLM for the same tokens. Three
paths, in an order that rotates each round so that all see the same load on a shared server:

- ``direct``: the agent's calls straight to vLLM;
- ``direct_lp``: the same calls straight to vLLM, asking for what steptap adds upstream (``logprobs`` and
  ``return_token_ids``): what recording costs vLLM itself, apart from the proxy;
- ``steptap``: through ``steptap serve``, one session per episode (``/s/<id>/v1``, the path an agent framework
  is pointed at).

It reports each path's median episode wall time, the medians over rounds of steptap / direct (what an agent
pays in all) and steptap / direct_lp (the proxy's own part), and the median added time per call.

Correctness, checked on every call: HTTP 200, exactly ``--max-tokens`` generated, and through steptap no token
ids or logprobs in what the agent got (it asked for neither); after steptap stops, its log holds one step per
call it served. Any problem is listed and makes the exit status 1. It never swaps weights or loads adapters,
so a shared vLLM server is fine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import free_port
from proxy_overhead import Steptap, _git_head, count_log, steptap_cmd

SYSTEM = (
    "You are a coding agent in a terminal. Use the tools by writing one command per turn; read each tool "
    "result before the next command. Keep answers short. Say DONE when the task is complete."
)
PATHS = ["direct", "direct_lp", "steptap"]
TASK = "The unit tests in tests/test_parse.py fail after the last commit. Find out why and fix it."
TOOL_RESULTS = [
    "$ pytest -q tests/test_parse.py\nF.F\nE  AssertionError: parse('1,2') == [1, 2] got ['1', '2']\n2 "
    "failed",
    "$ sed -n 1,20p src/parse.py\ndef parse(text):\n    return [x.strip() for x in text.split(',')]",
    "$ git log -1 -p src/parse.py\n-    return [int(x) for x in text.split(',')]\n+    return [x.strip() "
    "...]",
    "$ pytest -q tests/test_parse.py\n...\n3 passed in 0.02s",
]


def call_body(messages: list[dict[str, str]], model: str, max_tokens: int, record: bool) -> dict[str, Any]:
    extra = {"logprobs": True, "return_token_ids": True} if record else {}  # what steptap asks vLLM for
    return {
        **extra,
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # the same work on both paths: exactly max_tokens generated
    }


async def episode(
    http: aiohttp.ClientSession,
    base: str,
    model: str,
    turns: int,
    max_tokens: int,
    problems: list[str],
    record: bool = False,
) -> dict[str, Any]:
    """One agent episode against ``base`` (``.../v1``): wall time and each call's latency, in seconds."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    latencies = []
    t0 = time.perf_counter()
    for turn in range(turns):
        c0 = time.perf_counter()
        async with http.post(f"{base}/chat/completions",
                             json=call_body(messages, model, max_tokens, record)) as r:
            data = await r.read()
            status = r.status
        latencies.append(time.perf_counter() - c0)
        if status != 200:
            problems.append(f"{base} turn {turn}: HTTP {status}: {data[:300]!r}")
            break
        reply = json.loads(data)
        choice = reply["choices"][0]
        if reply["usage"]["completion_tokens"] != max_tokens:
            problems.append(f"{base} turn {turn}: {reply['usage']['completion_tokens']} tokens, not "
                            f"{max_tokens}")
        leaked = choice.get("token_ids") or choice.get("logprobs") or reply.get("prompt_token_ids")
        if not record and leaked:
            problems.append(f"{base} turn {turn}: token ids or logprobs the agent did not ask for")
        if record and len(choice.get("token_ids") or ()) != max_tokens:
            problems.append(f"{base} turn {turn}: asked for token ids, got {choice.get('token_ids')!r:.100}")
        messages.append({"role": "assistant", "content": choice["message"]["content"] or ""})
        messages.append({"role": "user", "content": TOOL_RESULTS[turn % len(TOOL_RESULTS)]})
    return {"wall_s": time.perf_counter() - t0, "call_s": latencies, "calls": len(latencies)}


async def run_pairs(
    args: argparse.Namespace, steptap_url: str, problems: list[str]
) -> tuple[list[dict[str, Any]], int]:
    """The episode pairs, and how many calls went to steptap (warm-up included)."""
    timeout = aiohttp.ClientTimeout(total=args.call_timeout)
    pairs = []
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.get(f"{args.backend}/v1/models") as r:
            model = args.model or (await r.json())["data"][0]["id"]
        # One untimed episode each: connections open, steptap's first-call work done.
        await episode(http, f"{args.backend}/v1", model, 1, args.max_tokens, problems)
        warm = await episode(http, f"{steptap_url}/s/e2e-warmup/v1", model, 1, args.max_tokens, problems)
        sent = warm["calls"]
        for i in range(args.pairs):
            paths = {
                "direct": f"{args.backend}/v1",
                "direct_lp": f"{args.backend}/v1",
                "steptap": f"{steptap_url}/s/e2e-{i}/v1",
            }
            order = PATHS[i % 3 :] + PATHS[: i % 3]
            pair: dict[str, Any] = {"pair": i, "order": order}
            for name in order:
                pair[name] = await episode(
                    http, paths[name], model, args.turns, args.max_tokens, problems,
                    record=name == "direct_lp"
                )
            sent += pair["steptap"]["calls"]
            pairs.append(pair)
            if not args.quiet:
                d, lp, s = (pair[k]["wall_s"] for k in PATHS)
                print(f"round {i}: direct {d:.3f} s  direct_lp {lp:.3f} s  steptap {s:.3f} s", flush=True)
    return pairs, sent


def summarize(pairs: list[dict[str, Any]], turns: int) -> dict[str, Any]:
    med = statistics.median
    wall = {k: [p[k]["wall_s"] for p in pairs] for k in PATHS}

    def added_call_ms(base: str) -> float:
        return med([1000.0 * (s - d) for p in pairs for s,
                    d in zip(p["steptap"]["call_s"], p[base]["call_s"], strict=False)])

    return {
        "rounds": len(pairs),
        "calls_per_episode": turns,
        **{f"{k}_wall_s": med(wall[k]) for k in PATHS},
        "ratio_wall": med([s / d for s, d in zip(wall["steptap"], wall["direct"], strict=False)]),
        "ratio_wall_lp": med([s / d for s, d in zip(wall["steptap"], wall["direct_lp"], strict=False)]),
        "ratio_lp_direct": med([s / d for s, d in zip(wall["direct_lp"], wall["direct"], strict=False)]),
        "added_wall_ms": med([1000.0 * (s - d) for s, d in zip(wall["steptap"], wall["direct"],
                                                               strict=False)]),
        "direct_call_ms": 1000.0 * med([x for p in pairs for x in p["direct"]["call_s"]]),
        "added_call_ms": added_call_ms("direct"),
        "added_call_ms_over_lp": added_call_ms("direct_lp"),
    }


def report(s: dict[str, Any], args: argparse.Namespace) -> str:
    if not s:
        return "no rounds"
    lines = [
        (
            f"episodes of {args.turns} calls x {args.max_tokens} tokens, {s['rounds']} rounds, median wall: "
            f"direct {s['direct_wall_s']:.3f} s, direct_lp {s['direct_lp_wall_s']:.3f} s, "
            f"steptap {s['steptap_wall_s']:.3f} s"
        ),
        (
            f"- steptap / direct {s['ratio_wall']:.4f} (added {s['added_wall_ms']:+.1f} ms per episode, "
            f"{s['added_call_ms']:+.2f} ms per call of {s['direct_call_ms']:.1f} ms)"
        ),
        (
            f"- of which vLLM computing logprobs and ids: direct_lp / direct {s['ratio_lp_direct']:.4f}; "
            f"the proxy itself: steptap / direct_lp {s['ratio_wall_lp']:.4f} "
            f"({s['added_call_ms_over_lp']:+.2f} ms per call)"
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="http://127.0.0.1:18000", help="a running vLLM OpenAI server")
    p.add_argument("--model", help="served model name (default: the first of /v1/models)")
    p.add_argument("--pairs", type=int, default=9, help="rounds of one episode per path, interleaved")
    p.add_argument("--turns", type=int, default=4, help="model calls per episode")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens generated per call (exactly)")
    p.add_argument("--call-timeout", type=float, default=300.0)
    p.add_argument("--steptap-arg", action="append", default=[], help="extra argument for steptap serve")
    p.add_argument("--log-root", help="make steptap's log under this directory (/dev/shm: no disk fsync)")
    p.add_argument("--out", help="write every episode and the summary as JSON here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    args.backend = args.backend.rstrip("/")

    t0, load_start = time.time(), os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="steptap-e2e-"))
    log_dir = tempfile.mkdtemp(prefix="steptap-e2e-log-",
                               dir=args.log_root) if args.log_root else str(work / "log")
    problems: list[str] = []
    port = free_port()
    steptap = Steptap(
        "steptap", steptap_cmd(args.backend, port, log_dir, args.steptap_arg, None),
        log=str(work / "steptap.log"),
    )
    steptap.port = port
    try:
        steptap.start(timeout=120)
        pairs, sent = asyncio.run(run_pairs(args, steptap.url, problems))
        steptap.stop(timeout=30)
        counts = count_log(log_dir)
        if counts["steps"] != sent:
            problems.append(f"steptap log holds {counts['steps']} steps for {sent} calls sent to it")
        if counts["failed_steps"]:
            problems.append(f"steptap log holds {counts['failed_steps']} failed steps")
    finally:
        steptap.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(log_dir, ignore_errors=True)
    summary = summarize(pairs, args.turns) if pairs else {}
    result = {
        "summary": summary, "pairs": pairs, "log": {**counts, "calls_sent": sent}, "problems": problems,
        "meta": {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "wall_s": round(time.time() - t0, 1), "loadavg_start": load_start, "loadavg": os.getloadavg(),
            "cpus": os.cpu_count(), "git": _git_head(), "args": vars(args),
        },
    }
    print(report(summary, args))
    print(f"- log: {counts['steps']} steps for {sent} calls sent to steptap; records {counts}")
    print(f"- correctness: {'all calls as expected' if not problems else f'{len(problems)} problems'}")
    for line in problems[:20]:
        print(f"  - {line}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
