"""What routing over replicas and running several proxy workers cost: steptap with two backends against
steptap with one, and ``steptap serve --workers 2`` against one worker, on the replay upstream (recorded vLLM
replies).

    .venv/bin/python bench/replicas_overhead.py --out runs/replicas-bench.json

Targets, each a ``steptap serve`` process (capture and the durable log on):

- ``one``: ``--backend R1``;
- ``two``: ``--backend R1 --backend R2`` (two replay upstreams; every anonymous call is a new session, placed
  on the least-loaded replica);
- ``workers2``: ``--workers 2 --backend R1 --backend R2`` (two processes on one port, one replica each).

Rounds alternate the targets (this machine is shared and noisy): at c=1 one run calls the targets in turn,
call after call; at c=32 each target gets its own run, in the order one, two, workers2 on even rounds and the
reverse on odd ones, so both compared pairs always run back to back and each side goes first in half the
rounds (a rotation would split ``one`` from ``two`` by a ``workers2`` run in some rounds and let one side go
first more often: drift over a round then reads as a difference). Medians over rounds of the paired ratios
decide: ``two`` within 10% of ``one`` (calls/s at c=32 >= 0.9x, p50 at c=1 <= 1.1x) prints PASS or MISS;
``workers2`` against ``two`` is reported (on a 2-core machine the load generator and the replay upstreams take
the cores a second worker would use). A target that answers anything but 200 fails the run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recorded
from procs import Server, free_port, python_cmd
from proxy_overhead import CHAT, LoadGen, Steptap, steptap_cmd, summarize_run

TARGETS = ("one", "two", "workers2")
WITHIN = 0.10


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    fx = recorded.load(args.fixture)
    work = Path(tempfile.mkdtemp(prefix="steptap-replicas-bench-"))
    servers: list[Server] = []
    rows: list[dict[str, Any]] = []
    try:
        replays = [Server(f"replay{i}", python_cmd("replay_upstream.py", "--fixture", args.fixture),
                          log=str(work / f"replay{i}.log")).start() for i in range(2)]
        servers += replays
        backends = {"one": [replays[0].url], "two": [r.url for r in replays],
                    "workers2": [r.url for r in replays]}
        urls: dict[str, str] = {}
        for name in args.targets:
            port = free_port()
            extra = [a for b in backends[name][1:] for a in ("--backend", b)]
            if name == "workers2":
                extra += ["--workers", "2"]  # the workers' own ports: PORT+1, PORT+2
            proc = Steptap(name, steptap_cmd(backends[name][0], port, str(work / f"log-{name}"), extra, None),
                           log=str(work / f"{name}.log"))
            proc.port = port
            proc.start(timeout=args.start_timeout)
            servers.append(proc)
            urls[name] = proc.url
        loadgen = LoadGen(log=str(work / "loadgen.log")).start()
        servers.append(loadgen)
        watch = sorted(r.pid for r in replays)
        for rnd in range(args.rounds):
            for mode in args.modes:
                for c in args.concurrency:
                    order = list(args.targets) if rnd % 2 == 0 else list(reversed(args.targets))
                    groups = [order] if c == 1 else [[t] for t in order]
                    for group in groups:
                        res = loadgen.run(
                            targets=[{"name": t, "url": urls[t] + CHAT} for t in group],
                            body=fx.agent_body(mode == "stream").decode(),
                            headers={"Authorization": "Bearer EMPTY"}, concurrency=c, warmup=args.warmup,
                            requests=args.requests * len(group), seconds=args.seconds * len(group),
                            watch_pids=watch,
                        )
                        for t in group:
                            row = {"round": rnd, "mode": mode, "concurrency": c, "target": t,
                                   **summarize_run(res["targets"][t], res["elapsed_s"], len(group) > 1)}
                            rows.append(row)
                            if row["errors"]:
                                raise RuntimeError(f"{t} answered {row['errors']} errors: see {work}")
        return {"rows": rows, "summary": summarize(rows, args), "work": str(work)}
    finally:
        for s in reversed(servers):
            s.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in args.modes:
        for c in args.concurrency:
            by_round: dict[int, dict[str, dict[str, Any]]] = {}
            for r in rows:
                if r["mode"] == mode and r["concurrency"] == c:
                    by_round.setdefault(r["round"], {})[r["target"]] = r
            key = f"{mode}/c{c}"
            res: dict[str, Any] = {}
            for a, b in (("two", "one"), ("workers2", "two")):
                if a in args.targets and b in args.targets:
                    rate = _med([rr[a]["calls_per_s"] / rr[b]["calls_per_s"] for rr in by_round.values()])
                    p50 = _med([rr[a]["p50_ms"] / rr[b]["p50_ms"] for rr in by_round.values()])
                    res[f"{a}_vs_{b}"] = {"calls_per_s_ratio": round(rate, 3), "p50_ratio": round(p50, 3)}
            for t in args.targets:
                res[t] = {"calls_per_s": round(_med([rr[t]["calls_per_s"] for rr in by_round.values()]), 1),
                          "p50_ms": round(_med([rr[t]["p50_ms"] for rr in by_round.values()]), 3)}
            if "two_vs_one" in res:
                ok = (res["two_vs_one"]["calls_per_s_ratio"] >= 1 - WITHIN if c > 1
                      else res["two_vs_one"]["p50_ratio"] <= 1 + WITHIN)
                res["two_within_10pct_of_one"] = "PASS" if ok else "MISS"
            out[key] = res
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="even: each order as often as the other")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    p.add_argument("--modes", type=lambda s: s.split(","), default=["plain", "stream"])
    p.add_argument("--targets", type=lambda s: tuple(s.split(",")), default=TARGETS)
    p.add_argument("--fixture", default=recorded.DEFAULT_FIXTURE)
    p.add_argument("--start-timeout", type=float, default=60.0)
    p.add_argument("--out")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    result = run(args)
    for key, res in result["summary"].items():
        print(key, json.dumps(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
