"""What the steptap proxy costs on every call: steptap vs a bare pass-through vs the upstream directly.

    .venv/bin/python bench/proxy_overhead.py --out runs/bench.json

One run starts, each in its own process: the replay upstream (recorded vLLM replies with logprobs and token
ids, bench/fixtures/: 32 tokens, and a long streamed one of 1,400), the pass-through proxy
(bench/passthrough.py) in front of it, the steptap proxy (``steptap serve --backend <replay> --log <tmpdir>``:
capture and the durable log on, its concurrency cap above the matrix's), and the load generator
(bench/loadgen.py). For each configuration (concurrency 1, 32 and 256, streamed and not; the long reply
streamed at 1 and 32) it measures direct, pass-through and steptap in rounds (this machine is shared and
noisy) and reports medians over rounds: calls/s, p50 and p99 latency, and the proxy process's CPU time per
call (user + system, all threads: the measure that noise disturbs least). At c > 1 each target gets its own
run, in an order that rotates each round; at c=1 one run calls the three in turn, call after call, so that
they see the same moment-to-moment noise (calls/s is then 1 / mean latency, what a sequential agent gets). The
targets (issue 15, ratios to the pass-through in the same round) are in overhead_report.py; each prints PASS
or MISS, and a miss does not fail the run.

Correctness is checked on every run: the bodies the agent got through steptap equal the recorded ones minus
what it did not ask for (logprobs, token ids), the direct and pass-through bodies equal the recorded bytes,
and after steptap stops its log holds one step per call it served. A check that fails makes the exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recorded
from overhead_report import markdown, pct, summarize, summarize_run
from procs import Server, free_port, python_cmd

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
TARGETS = ("direct", "passthrough", "steptap")
CONTROL_TOKEN = "bench-control-token"
# steptap's cap on model calls in flight, passed explicitly: above the matrix's highest concurrency (256), so
# the bench measures the proxy, not its 429s.
MAX_CONCURRENT_CALLS = 1024


# ---- the processes ---------------------------------------------------------------------------------------


class LoadGen(Server):
    """The load generator worker: commands on stdin, results on stdout."""

    def __init__(self, log: str | None) -> None:
        super().__init__("loadgen", python_cmd("loadgen.py"), log=log)

    def start(self, timeout: float = 30.0) -> LoadGen:
        stderr = open(self.log, "w") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not json.loads(line or "{}").get("ready"):
            raise RuntimeError("load generator did not start")
        return self

    def run(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("load generator exited")
        return json.loads(line)


def steptap_cmd(backend: str, port: int, log_dir: str, extra: list[str], prefix: str | None) -> list[str]:
    exe = Path(sys.executable).with_name("steptap")
    if prefix:
        base = shlex.split(prefix)
    else:
        base = [str(exe)] if exe.exists() else [sys.executable, "-m", "steptap.middleware.cli"]
    return [
        *base,
        "serve",
        "--backend",
        backend,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log",
        log_dir,
        "--control-token",
        CONTROL_TOKEN,
        *extra,
    ]


def wait_http(url: str, timeout: float, proc: subprocess.Popen[Any] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout:.0f}s")


class Steptap(Server):
    """``steptap serve`` as a subprocess; ready when its /health answers."""

    def start(self, timeout: float = 60.0) -> Steptap:
        out = open(self.log, "w") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(self.env or {})}
        )
        try:
            wait_http(f"{self.url}/health", timeout, self.proc)
        except RuntimeError:
            self.stop()
            raise
        return self


# ---- correctness -----------------------------------------------------------------------------------------


def target_url(target: str, urls: dict[str, str], identity: str, rnd: int, mode: str, c: int) -> str:
    if target == "steptap" and identity == "session":
        # One session per worker: each worker is one agent making its calls in turn.
        return f"{urls[target]}/s/bench-r{rnd}-{mode}-c{c}-w{{worker}}/v1/chat/completions"
    return urls[target] + CHAT


def check_bodies(target: str, stream: bool, bodies: list[list[Any]], fx: recorded.Fixture) -> list[str]:
    """Problems with the distinct bodies a run saw (empty: all good)."""
    problems = []
    want = fx.stream if stream else fx.reply
    for text, count in bodies:
        body = text.encode()
        if target == "steptap":
            why = recorded.same_agent_stream(body, want) if stream else recorded.same_agent_body(body, want)
        else:  # direct and pass-through relay the recorded bytes untouched
            why = None if body == want else f"bytes differ from the recording ({len(body)} vs {len(want)})"
        if why:
            problems.append(f"{target} {'stream' if stream else 'plain'} x{count}: {why}")
    return problems


async def _count_steps(log_dir: str) -> dict[str, int]:
    """Records by type, and ``steps``: the distinct steps the log holds, whether written as ``Step`` records,
    inside ``Trajectory`` records, or both (an anonymous call may be written either way)."""
    from steptap.middleware.log.wal import TrajectoryLog
    from steptap.middleware.records import Step, Trajectory

    # Read-only: inspect, never repair (the proxy has stopped, but a check must not change what it checks)
    try:
        log = await TrajectoryLog.open(log_dir, readonly=True)
    except TypeError:  # a TrajectoryLog without the read-only mode
        log = await TrajectoryLog.open(log_dir)
    counts: dict[str, int] = {}
    steps: dict[tuple[str, int, int], str] = {}  # (trajectory, index, choice) -> status
    try:
        for rec in log.records():
            kind = type(rec).__name__
            counts[kind] = counts.get(kind, 0) + 1
            for step in [rec] if isinstance(rec, Step) else rec.steps if isinstance(rec, Trajectory) else []:
                steps[(step.trajectory_id, step.index, step.choice)] = step.status
    finally:
        await log.close()
    counts["steps"] = len(steps)
    counts["failed_steps"] = sum(1 for status in steps.values() if status != "ok")
    return counts


def count_log(log_dir: str) -> dict[str, int]:
    return asyncio.run(_count_steps(log_dir))


# ---- the run ---------------------------------------------------------------------------------------------


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    fixtures = {"short": recorded.load(args.fixture), "long": recorded.load(args.long_fixture)}
    work = Path(tempfile.mkdtemp(prefix="steptap-bench-"))
    log_dir = (
        tempfile.mkdtemp(prefix="steptap-bench-log-", dir=args.log_root)
        if args.log_root
        else str(work / "log")
    )
    result_fsync_before = fsync_probe(args.log_root or str(work))
    servers: list[Server] = []
    py_spy: subprocess.Popen[bytes] | None = None
    result: dict[str, Any] = {"problems": []}
    try:
        replay = Server(
            "replay",
            python_cmd(
                "replay_upstream.py", "--fixture", args.fixture, "--fixture", args.long_fixture
            ),
            log=str(work / "replay.log"),
        ).start()
        servers.append(replay)
        urls = {"direct": replay.url}
        pids = {"direct": replay.pid}
        if "passthrough" in args.targets:
            pt = Server(
                "passthrough",
                python_cmd("passthrough.py", "--backend", replay.url),
                log=str(work / "passthrough.log"),
            ).start()
            servers.append(pt)
            urls["passthrough"] = pt.url
            pids["passthrough"] = pt.pid
        steptap = None
        if "steptap" in args.targets:
            port = free_port()
            steptap = Steptap(
                "steptap",
                steptap_cmd(
                    replay.url,
                    port,
                    log_dir,
                    ["--max-concurrent-calls", str(MAX_CONCURRENT_CALLS), *args.steptap_arg],
                    args.steptap_cmd,
                ),
                log=str(work / "steptap.log"),
            )
            steptap.port = port
            steptap.start(timeout=args.start_timeout)
            servers.append(steptap)
            urls["steptap"] = steptap.url
            pids["steptap"] = steptap.pid
            if args.profile:
                py_spy = subprocess.Popen(
                    [
                        str(Path(sys.executable).with_name("py-spy")),
                        "record",
                        "-p",
                        str(steptap.pid),
                        "-r",
                        "250",
                        "-f",
                        "raw",
                        "-o",
                        args.profile,
                        "--nonblocking",
                        *(["--gil"] if args.profile_gil else []),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
        loadgen = LoadGen(log=str(work / "loadgen.log")).start()
        servers.append(loadgen)

        configs = [(mode, c) for mode in args.modes for c in args.concurrency]
        configs += [("long", c) for c in args.long_concurrency]  # the long reply: streamed only
        targets = [t for t in TARGETS if t in args.targets]
        runs: list[dict[str, Any]] = []
        sent_to_steptap = 0
        for rnd in range(args.rounds):
            for mode, c in configs:
                stream = mode != "plain"
                fx = fixtures["long" if mode == "long" else "short"]
                order = targets[rnd % len(targets) :] + targets[: rnd % len(targets)]
                # c=1 with interleaving: one run calls the targets in turn, call after call; else one run
                # each.
                groups = [order] if c == 1 and args.interleave_c1 else [[t] for t in order]
                for group in groups:
                    wait0 = log_wait(urls["steptap"]) if "steptap" in group else None
                    res = loadgen.run(
                        targets=[
                            {"name": t, "url": target_url(t, urls, args.identity, rnd, mode, c)}
                            for t in group
                        ],
                        body=fx.agent_body(stream).decode(),
                        headers={"Authorization": "Bearer EMPTY"},
                        concurrency=c,
                        warmup=max(args.warmup, c),  # at least one call per worker: its connection open
                        requests=args.requests * len(group),
                        seconds=args.seconds * len(group),
                        watch_pids=sorted({pids[t] for t in group} | {pids["direct"]}),
                    )
                    total_calls = max(1, sum(r["calls"] for r in res["targets"].values()))
                    wait1 = log_wait(urls["steptap"]) if wait0 is not None else None
                    for target in group:
                        tres = res["targets"][target]
                        if target == "steptap":
                            sent_to_steptap += tres["sent"]
                        row = {
                            "round": rnd,
                            "mode": mode,
                            "concurrency": c,
                            "target": target,
                            "interleaved": len(group) > 1,
                            **summarize_run(tres, res["elapsed_s"], len(group) > 1),
                        }
                        calls = max(1, tres["calls"])
                        row["upstream_cpu_ms_per_call"] = (
                            1000.0 * res["cpu_s"][str(pids["direct"])] / total_calls
                        )
                        if target == "steptap" and wait0 and wait1 and wait1[1] > wait0[1]:
                            row["log_wait_ms"] = 1000.0 * (wait1[0] - wait0[0]) / (wait1[1] - wait0[1])
                        row["proxy_cpu_ms_per_call"] = (
                            None if target == "direct" else 1000.0 * res["cpu_s"][str(pids[target])] / calls
                        )
                        runs.append(row)
                        problems = check_bodies(target, stream, tres["bodies"], fx)
                        if tres["errors"] or tres["warmup_errors"]:
                            problems.append(
                                f"{target} {mode} c={c}: {tres['errors']} errors "
                                f"(+{tres['warmup_errors']} in warm-up): {tres['error_samples']}"
                            )
                        result["problems"] += problems
                        if not args.quiet:
                            print(
                                f"round {rnd} {mode:6} c={c:<3} {target:11} {row['calls_per_s']:8.1f} "
                                "calls/s  "
                                f"p50 {row['p50_ms']:7.3f} ms  p99 {row['p99_ms']:7.3f} ms"
                                + (
                                    f"  proxy CPU {row['proxy_cpu_ms_per_call']:.3f} ms/call"
                                    if row["proxy_cpu_ms_per_call"] is not None
                                    else ""
                                )
                                + ("  BODY/ERR PROBLEM" if problems else ""),
                                flush=True,
                            )
        result["runs"] = runs

        if py_spy is not None:
            py_spy.send_signal(signal.SIGINT)
            py_spy.wait(30)
            py_spy = None
        if steptap is not None:
            steptap.stop(timeout=30)
            counts = count_log(log_dir)
            steps = counts["steps"]
            log_bytes = sum(f.stat().st_size for f in Path(log_dir).rglob("*") if f.is_file())
            result["log"] = {
                "calls_sent": sent_to_steptap,
                "records": counts,
                "steps": steps,
                "dir": log_dir,
                "bytes": log_bytes,
                "bytes_per_call": round(log_bytes / max(1, sent_to_steptap)),
                "one_step_per_call": steps == sent_to_steptap,
            }
            if steps != sent_to_steptap:
                result["problems"].append(f"steptap log holds {steps} steps for {sent_to_steptap} calls")
            if counts.get("failed_steps"):
                result["problems"].append(f"steptap log holds {counts['failed_steps']} failed steps")
        result["replay_stats"] = _replay_stats(replay.url)
        result["fsync_ms"] = {"before": result_fsync_before, "after": fsync_probe(args.log_root or str(work))}
    finally:
        if py_spy is not None and py_spy.poll() is None:
            py_spy.send_signal(signal.SIGINT)
            py_spy.wait(30)
        for s in reversed(servers):
            s.stop()
        if args.keep:
            print(f"kept logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(log_dir, ignore_errors=True)
    result["summary"] = summarize(result["runs"], targets, configs)
    return result


def fsync_probe(directory: str, n: int = 100, size: int = 8192) -> dict[str, float]:
    """What one append + fdatasync costs where the log lives (ms): at c=1 steptap waits for one per call."""
    path = os.path.join(directory, f".fsync-probe-{os.getpid()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    times = []
    try:
        for _ in range(n):
            os.write(fd, b"x" * size)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            times.append((time.perf_counter() - t0) * 1000.0)
    finally:
        os.close(fd)
        os.unlink(path)
    return {"p50": round(pct(times, 50), 3), "p90": round(pct(times, 90), 3), "p99": round(pct(times, 99), 3)}


def log_wait(url: str) -> tuple[float, float] | None:
    """(sum of seconds, count) of steptap's ``steptap_log_commit_seconds``: how long calls waited for their
    log commit, from the proxy's own /metrics; None when it does not answer."""
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {CONTROL_TOKEN}"})
    total = count = None
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("steptap_log_commit_seconds_sum"):
                    total = float(line.split()[-1])
                elif line.startswith("steptap_log_commit_seconds_count"):
                    count = float(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None if total is None or count is None else (total, count)


def _replay_stats(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url}/bench/stats", timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (medians are taken over them)")
    p.add_argument("--seconds", type=float, default=2.0, help="timed length of one run (bound)")
    p.add_argument("--requests", type=int, default=20000, help="calls in one run (bound)")
    p.add_argument("--warmup", type=int, default=64, help="untimed calls before each run")

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    p.add_argument("--concurrency", type=ints, default=[1, 32, 256])
    p.add_argument("--modes", type=lambda s: s.split(","), default=["plain", "stream"])
    p.add_argument(
        "--long-concurrency",
        type=ints,
        default=[1, 32],
        help="concurrencies of the long streamed reply (mode 'long', --long-fixture); empty: none",
    )
    p.add_argument("--targets", type=lambda s: s.split(","), default=list(TARGETS))
    p.add_argument(
        "--identity",
        choices=("anonymous", "session"),
        default="anonymous",
        help="steptap calls without a session (one anonymous trajectory each, written whole) or "
        "on a session path per worker (/s/<id>/v1)",
    )
    p.add_argument(
        "--no-interleave-c1",
        dest="interleave_c1",
        action="store_false",
        help="at c=1, one run per target instead of one run calling the targets in turn",
    )
    p.add_argument("--fixture", default=recorded.DEFAULT_FIXTURE)
    p.add_argument("--long-fixture", default=recorded.LONG_FIXTURE)
    p.add_argument(
        "--steptap-cmd",
        help="run this instead of the `steptap` command (e.g. under a profiler); "
        "`serve --backend ... --log ...` is appended",
    )
    p.add_argument("--steptap-arg", action="append", default=[], help="extra argument for steptap serve")
    p.add_argument("--start-timeout", type=float, default=60.0)
    p.add_argument(
        "--profile", help="record the steptap process with py-spy (raw collapsed stacks) to this file"
    )
    p.add_argument("--profile-gil", action="store_true", help="with --profile: only samples holding the GIL")
    p.add_argument(
        "--log-root",
        help="make steptap's trajectory log under this directory (default: a temp "
        "dir; /dev/shm takes the disk's fsync out of the measurement)",
    )
    p.add_argument("--out", help="write the full result (every run, summary, checks) as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the servers' logs and the trajectory log")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    bad = set(args.targets) - set(TARGETS)
    if bad:
        p.error(f"unknown targets {sorted(bad)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    load_start = os.getloadavg()
    result = run_benchmark(args)
    result["meta"] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "wall_s": round(time.time() - t0, 1),
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg": os.getloadavg(),
        "python": platform.python_version(),
        "fixture": args.fixture,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "git": _git_head(),
    }
    text = markdown(result)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["problems"] else 0


def _git_head() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                check=False,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
