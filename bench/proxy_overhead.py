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

``--baseline REF`` (repeatable) adds the proxy as it was at a git ref, side by side in the same run: the ref's
tree is exported (``git archive``) to a temp dir and served by this checkout's Python and packages, as the
target ``baseline`` (a second ref: ``baseline2``, ...), with its own log, checks and ratios to the same
pass-through; the summary also gives each ratio of steptap to each baseline.
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
from overhead_report import check_budget, cpu_figures, markdown, pct, summarize, summarize_run
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


def steptap_cmd(
    backend: str, port: int, log_dir: str, extra: list[str], prefix: str | None, tree: str | None = None
) -> list[str]:
    """``steptap serve`` for this checkout, or (``tree``: a baseline's package dir, first on ``sys.path``)
    for the code at another ref, run by this checkout's Python."""
    exe = Path(sys.executable).with_name("steptap")
    if tree is not None:
        boot = (f"import sys; sys.path.insert(0, {tree!r}); import steptap.middleware as m; "
                f"assert m.__file__.startswith({tree!r}), m.__file__; "
                # as ``python -m``: the command line's module at that ref, wherever its main lives
                "import runpy; "
                "runpy.run_module('steptap.middleware.cli', run_name='__main__', alter_sys=True)")
        base = [*(shlex.split(prefix) if prefix else [sys.executable]), "-c", boot]
    elif prefix:
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


def is_proxy(target: str) -> bool:
    """steptap, or steptap at a baseline ref."""
    return target == "steptap" or target.startswith("baseline")


def baseline_tree(ref: str, work: Path, name: str) -> str:
    """The code at ``ref`` exported under ``work``, laid out as installed (``steptap/middleware``, ...);
    returns the directory to put first on ``sys.path`` (a regular ``steptap`` package there shadows the
    editable install's)."""
    src = work / f"{name}-src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    top = work / f"{name}-pkg"
    (top / "steptap").mkdir(parents=True)
    (top / "steptap" / "__init__.py").write_text("")
    for pkg in ("middleware", "adapters", "learner"):
        if (src / pkg).is_dir():
            (top / "steptap" / pkg).symlink_to(src / pkg)
    return str(top)


def target_url(target: str, urls: dict[str, str], identity: str, rnd: int, mode: str, c: int) -> str:
    if is_proxy(target) and identity == "session":
        # One session per worker: each worker is one agent making its calls in turn.
        return f"{urls[target]}/s/bench-r{rnd}-{mode}-c{c}-w{{worker}}/v1/chat/completions"
    return urls[target] + CHAT


def check_bodies(target: str, stream: bool, bodies: list[list[Any]], fx: recorded.Fixture) -> list[str]:
    """Problems with the distinct bodies a run saw (empty: all good)."""
    problems = []
    want = fx.stream if stream else fx.reply
    for text, count in bodies:
        body = text.encode()
        if is_proxy(target):
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


def count_log(log_dir: str, tree: str | None = None) -> dict[str, int]:
    """The log's counts, read by this checkout's reader, or (``tree``) by the baseline's own in a child;
    ``steptap serve --workers N`` writes one log a worker (``LOG/worker-i``): their counts summed."""
    workers = sorted(Path(log_dir).glob("worker-*"))
    if workers:
        total: dict[str, int] = {}
        for w in workers:
            for key, n in count_log(str(w), tree).items():
                total[key] = total.get(key, 0) + n
        return total
    if tree is None:
        return asyncio.run(_count_steps(log_dir))
    here = str(Path(__file__).parent)
    code = (f"import sys, json; sys.path.insert(0, {tree!r}); sys.path.insert(1, {here!r}); "
            f"import proxy_overhead as p; print(json.dumps(p.count_log({log_dir!r})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---- the run ---------------------------------------------------------------------------------------------


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    fixtures = {"short": recorded.load(args.fixture), "long": recorded.load(args.long_fixture)}
    work = Path(tempfile.mkdtemp(prefix="steptap-bench-"))
    log_root = args.log_root or str(work)
    # each steptap process (this checkout's, each baseline's) its own log
    log_dirs: dict[str, str] = {}
    result_fsync_before = fsync_probe(log_root)
    servers: list[Server] = []
    py_spy: subprocess.Popen[bytes] | None = None
    result: dict[str, Any] = {"problems": []}
    baselines = dict(zip(baseline_names(args.baseline), args.baseline, strict=True))
    proxies = [t for t in ["steptap", *baselines] if t in args.targets]
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
        started: dict[str, Steptap] = {}
        trees: dict[str, str | None] = {}
        for name in proxies:
            trees[name] = baseline_tree(baselines[name], work, name) if name in baselines else None
            log_dirs[name] = tempfile.mkdtemp(prefix=f"steptap-bench-log-{name}-", dir=log_root)
            port = free_port()
            proc = Steptap(
                name,
                steptap_cmd(
                    replay.url,
                    port,
                    log_dirs[name],
                    ["--max-concurrent-calls", str(MAX_CONCURRENT_CALLS), *args.steptap_arg,
                     *[a.partition("=")[2] for a in args.target_arg if a.partition("=")[0] == name]],
                    args.steptap_cmd,
                    trees[name],
                ),
                log=str(work / f"{name}.log"),
            )
            proc.port = port
            proc.start(timeout=args.start_timeout)
            servers.append(proc)
            started[name] = proc
            urls[name] = proc.url
            pids[name] = proc.pid
        steptap = started.get(args.profile_target)
        if steptap is not None and args.profile:
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
        targets = [t for t in [*TARGETS, *baselines] if t in args.targets]
        runs: list[dict[str, Any]] = []
        sent = dict.fromkeys(proxies, 0)
        if args.fresh_proxies:
            result["restarts"] = dict.fromkeys(started, 0)
        for rnd in range(args.rounds):
            order = targets[rnd % len(targets) :] + targets[: rnd % len(targets)]
            if args.fresh_proxies and rnd:
                # new processes each round, started in the round's order: a process's own layout (hash seed,
                # addresses) or its place in the start order can tilt a whole run by a few % at c=1
                for name in [t for t in order if t in started]:
                    started[name].stop(timeout=30)
                    started[name].start(timeout=args.start_timeout)
                    pids[name] = started[name].pid
                    result["restarts"][name] += 1
            for mode, c in configs:
                stream = mode != "plain"
                fx = fixtures["long" if mode == "long" else "short"]
                # c=1 with interleaving: one run calls the targets in turn, call after call; else one run
                # each.
                groups = [order] if c == 1 and args.interleave_c1 else [[t] for t in order]
                for group in groups:
                    wait0 = {t: log_wait(urls[t]) for t in group if is_proxy(t)}
                    res = loadgen.run(
                        targets=[
                            {"name": t, "url": target_url(t, urls, args.identity, rnd, mode, c)}
                            for t in group
                        ],
                        body=fx.agent_body(stream).decode(),
                        headers={"Authorization": "Bearer EMPTY"},
                        concurrency=c,
                        block=args.c1_block,
                        warmup=max(args.warmup, c),  # at least one call per worker: its connection open
                        requests=args.requests * len(group),
                        seconds=args.seconds * len(group),
                        watch_pids=sorted({pids[t] for t in group} | {pids["direct"]}),
                    )
                    total_calls = max(1, sum(r["calls"] for r in res["targets"].values()))
                    wait1 = {t: log_wait(urls[t]) for t in wait0}
                    for target in group:
                        tres = res["targets"][target]
                        if is_proxy(target):
                            sent[target] += tres["sent"]
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
                        w0, w1 = wait0.get(target), wait1.get(target)
                        if w0 and w1 and w1[1] > w0[1]:
                            row["log_wait_ms"] = 1000.0 * (w1[0] - w0[0]) / (w1[1] - w0[1])
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
        result["logs"] = {}
        for name, proc in started.items():
            proc.stop(timeout=30)
            log_dir = log_dirs[name]
            counts = count_log(log_dir, trees[name])
            steps = counts["steps"]
            log_bytes = sum(f.stat().st_size for f in Path(log_dir).rglob("*") if f.is_file())
            result["logs"][name] = {
                "ref": baselines.get(name, "HEAD"),
                "calls_sent": sent[name],
                "records": counts,
                "steps": steps,
                "dir": log_dir,
                "bytes": log_bytes,
                "bytes_per_call": round(log_bytes / max(1, sent[name])),
                "one_step_per_call": steps == sent[name],
            }
            if steps != sent[name]:
                result["problems"].append(f"{name} log holds {steps} steps for {sent[name]} calls")
            if counts.get("failed_steps"):
                result["problems"].append(f"{name} log holds {counts['failed_steps']} failed steps")
        if "steptap" in result["logs"]:
            result["log"] = result["logs"]["steptap"]
        result["replay_stats"] = _replay_stats(replay.url)
        result["fsync_ms"] = {"before": result_fsync_before, "after": fsync_probe(log_root)}
    finally:
        if py_spy is not None and py_spy.poll() is None:
            py_spy.send_signal(signal.SIGINT)
            py_spy.wait(30)
        for s in reversed(servers):
            s.stop()
        if args.keep:
            print(f"kept logs in {work} and {sorted(log_dirs.values())}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            for d in log_dirs.values():
                shutil.rmtree(d, ignore_errors=True)
    result["baselines"] = baselines
    result["summary"] = summarize(result["runs"], targets, configs)
    return result


def baseline_names(refs: list[str]) -> list[str]:
    """The targets of the ``--baseline`` refs: ``baseline``, ``baseline2``, ..."""
    return ["baseline" if i == 0 else f"baseline{i + 1}" for i in range(len(refs))]


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
    p.add_argument(
        "--targets",
        type=lambda s: s.split(","),
        default=list(TARGETS),
        help="of direct, passthrough, steptap, and baseline (every --baseline ref: baseline, baseline2, ...)",
    )
    p.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="REF",
        help="also run steptap as it was at this git ref, side by side (repeatable); add `baseline` to "
        "--targets (the default targets take every baseline)",
    )
    p.add_argument(
        "--identity",
        choices=("anonymous", "session"),
        default="anonymous",
        help="steptap calls without a session (one anonymous trajectory each, written whole) or "
        "on a session path per worker (/s/<id>/v1)",
    )
    p.add_argument(
        "--fresh-proxies",
        action="store_true",
        help="restart every proxy before each round after the first (in the round's order), so that no one "
        "process's layout or start order tilts the run",
    )
    p.add_argument(
        "--no-interleave-c1",
        dest="interleave_c1",
        action="store_false",
        help="at c=1, one run per target instead of one run calling the targets in turn",
    )
    p.add_argument(
        "--c1-block",
        type=int,
        default=1,
        metavar="N",
        help="at c=1 interleaved, N calls to a target before the next (default 1: every call another "
        "target's, so each call finds its caches as the others left them; 50 keeps them warm)",
    )
    p.add_argument("--fixture", default=recorded.DEFAULT_FIXTURE)
    p.add_argument("--long-fixture", default=recorded.LONG_FIXTURE)
    p.add_argument(
        "--steptap-cmd",
        help="run this instead of the `steptap` command (e.g. under a profiler); "
        "`serve --backend ... --log ...` is appended",
    )
    p.add_argument("--steptap-arg", action="append", default=[], help="extra argument for steptap serve")
    p.add_argument("--target-arg", action="append", default=[], metavar="TARGET=ARG",
                   help="extra argument for one proxy's steptap serve (steptap, baseline, ...): "
                        "--target-arg steptap=--workers --target-arg steptap=2")
    p.add_argument("--start-timeout", type=float, default=60.0)
    p.add_argument(
        "--profile", help="record the steptap process with py-spy (raw collapsed stacks) to this file"
    )
    p.add_argument("--profile-gil", action="store_true", help="with --profile: only samples holding the GIL")
    p.add_argument("--profile-target", default="steptap", help="with --profile: which proxy (e.g. baseline)")
    p.add_argument(
        "--log-root",
        help="make steptap's trajectory log under this directory (default: a temp "
        "dir; /dev/shm takes the disk's fsync out of the measurement)",
    )
    p.add_argument("--out", help="write the full result (every run, summary, checks) as JSON here")
    p.add_argument(
        "--budget",
        default=str(Path(__file__).with_name("cpu_budget.json")),
        help="the committed per-call CPU figures (ratios to the pass-through): a ratio more than 10%% above "
        "one is reported as a REGRESSION",
    )
    p.add_argument("--write-budget", action="store_true", help="write this run's CPU figures to --budget")
    p.add_argument("--keep", action="store_true", help="keep the servers' logs and the trajectory log")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    names = baseline_names(args.baseline)
    if "baseline" in args.targets or args.targets == list(TARGETS):
        args.targets = [t for t in args.targets if t != "baseline"] + names
    bad = set(args.targets) - set(TARGETS) - set(names)
    if bad:
        p.error(f"unknown targets {sorted(bad)}")
    if args.fresh_proxies and args.profile:
        p.error("--profile follows one process: not with --fresh-proxies")
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
    if args.budget and Path(args.budget).exists():
        budget = json.loads(Path(args.budget).read_text())
        result["budget"] = check_budget(cpu_figures(result["summary"]), budget)
    if args.write_budget:
        figures = cpu_figures(result["summary"])
        Path(args.budget).write_text(json.dumps({
            "about": "steptap's CPU per call against the pass-through's in the same run (proxy_overhead.py "
                     "--write-budget); a later run reports a ratio more than 10% above one of these",
            "git": result["meta"]["git"], "at": result["meta"]["started_at"],
            "command": result["meta"]["command"], "loadavg": result["meta"]["loadavg"],
            "figures": figures}, indent=1) + "\n")
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
