"""Python function calls a model call costs the proxy's event loop, counted (not timed): steptap against refs.

    .venv/bin/python bench/call_counts.py [--baseline REF ...] [--stream] [--calls 1000] [--top 30]

Timing the proxy on a shared 2-core machine needs rounds and a quiet hour; a count does not. Each target
(this checkout, and each ``--baseline`` ref's tree as ``proxy_overhead.py`` exports it) runs ``steptap serve``
under ``cProfile`` (the main thread: the event loop) in front of the replay upstream, and one keep-alive
client sends sequential calls (the recorded agent body, plain or ``--stream``). It runs twice per target,
with W and W + ``--calls`` calls, and the difference of the two profiles divided by ``--calls`` is what one
call costs, start-up and shutdown cancelled out. A coroutine's resume counts as a call (cProfile's rule),
the same on every side.

Printed: calls a call by area (steptap's modules, aiohttp, builtins, the rest), and the functions whose
count changed most against the first baseline. Where the time of a c=1 call is the loop's Python work (its
syscalls counted equal: bench/README.md), the counts say where it grew; ``proxy_overhead.py`` measures what
it costs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import pstats
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recorded
from procs import Server, free_port, python_cmd
from proxy_overhead import CHAT, ROOT, Steptap, baseline_names, baseline_tree, steptap_cmd

WARM = 50  # calls before the counted ones in both runs: first-call paths and lazy imports cancel out


def _boot(tree: str | None, out: str, opcodes: bool) -> str:
    """A ``python -c`` program: the event loop's thread profiled from start to exit, the stats dumped at
    exit (``steptap serve`` stops on SIGTERM through its own shutdown). With ``opcodes``, every thread's
    bytecodes are counted by function instead (``sys.settrace`` with opcode events: slow, but a count)."""
    head = f"import sys; sys.path.insert(0, {tree!r}); " if tree else "import sys; "
    run = "runpy.run_module('steptap.middleware.cli', run_name='__main__', alter_sys=True)"
    if not opcodes:
        return (head + "import atexit, cProfile, runpy; p = cProfile.Profile(); "
                f"atexit.register(lambda: (p.disable(), p.dump_stats({out!r}))); p.enable(); " + run)
    return head + f"import runpy; sys.path.append({str(Path(__file__).parent)!r}); " \
        f"import call_counts; call_counts.trace_opcodes({out!r}); " + run


def trace_opcodes(out: str) -> None:
    """Count the bytecodes each function runs, in every thread, until exit; written to ``out`` as JSON rows
    ``[file, line, name, count]``. A thread has its own counter (no lost increments between threads)."""
    import atexit
    import threading

    counters: dict[int, Counter[tuple[str, int, str]]] = {}

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202 (sys.settrace's signature)
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        code = frame.f_code
        key = (code.co_filename, code.co_firstlineno, code.co_qualname)
        tid = threading.get_ident()
        mine = counters.get(tid)
        if mine is None:  # a thread's first frame: its counter (one dict write, made once)
            mine = counters[tid] = Counter()

        def local(frame, event, arg):  # noqa: ANN001, ANN202
            if event == "opcode":
                mine[key] += 1
            return local
        return local

    def dump() -> None:
        sys.settrace(None)
        total: Counter[tuple[str, int, str]] = Counter()
        for c in list(counters.values()):
            total.update(c)
        Path(out).write_text(json.dumps([[*k, v] for k, v in total.items()]))

    atexit.register(dump)
    threading.settrace(tracer)
    sys.settrace(tracer)


def profile(tree: str | None, upstream: str, n: int, args: argparse.Namespace, work: Path,
            name: str) -> dict[tuple[str, int, str], float]:
    """``steptap serve`` (at ``tree``, or this checkout) over ``n`` sequential calls: each function's calls
    (cProfile, the loop's thread) or, with ``--opcodes``, its bytecodes (every thread)."""
    out = str(work / f"{name}.prof")
    port = free_port()
    cmd = steptap_cmd(upstream, port, str(work / f"{name}-log"), [], None)
    proxy = Steptap(name, [sys.executable, "-c", _boot(tree, out, args.opcodes), *cmd[cmd.index("serve"):]],
                    log=str(work / f"{name}.log"))
    proxy.port = port
    proxy.start()
    try:
        sequential(port, n, args.stream)
    finally:
        proxy.stop(timeout=120)
    if args.opcodes:
        return {(f, line, func): c for f, line, func, c in json.loads(Path(out).read_text())}
    return {key: row[1] for key, row in pstats.Stats(out).stats.items()}  # type: ignore[attr-defined]


def sequential(port: int, n: int, stream: bool, timeout: float = 60.0) -> None:
    """``n`` calls one after the other on one keep-alive connection: the recorded agent body, plain or
    streamed, each answered 200 and read whole."""
    body = recorded.load().agent_body(stream)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        for _ in range(n):
            conn.request("POST", CHAT, body=body, headers={"content-type": "application/json"})
            reply = conn.getresponse()
            data = reply.read()
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {data[:300]!r}")
    finally:
        conn.close()


def _where(key: tuple[str, int, str]) -> str:
    """A function's name without the tree it was loaded from (the same module at two refs is one row)."""
    file, line, func = key
    file = file.removeprefix(f"{ROOT}/")
    for marker in ("/steptap/", "site-packages/"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{file}:{func}" if file != "~" else re.sub(r" at 0x[0-9a-f]+", "", func)


def per_call(short: dict[tuple[str, int, str], float], long: dict[tuple[str, int, str], float],
             n: int) -> Counter[str]:
    """Per model call, each function's count (by file and name, lines dropped: they move between refs)."""
    out: Counter[str] = Counter()
    for key, value in long.items():
        out[_where(key)] += (value - short.get(key, 0)) / n
    return out


def area(name: str) -> str:
    if name.startswith(("middleware/", "adapters/", "learner/")):
        return "steptap"
    if name.startswith(("aiohttp/", "multidict/", "yarl/")):
        return "aiohttp"
    if ":" not in name:
        return "builtins"
    return "other"


def count(tree: str | None, upstream: str, args: argparse.Namespace, work: Path, name: str) -> Counter[str]:
    short = profile(tree, upstream, WARM, args, work, f"{name}-short")
    long = profile(tree, upstream, WARM + args.calls, args, work, f"{name}-long")
    return per_call(short, long, args.calls)


def table(title: str, counts: dict[str, Counter[str]], top: int) -> None:
    names = list(counts)
    print(f"{title}\n\n| area | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for part in ("steptap", "aiohttp", "builtins", "other", "all"):
        cells = [sum(v for k, v in c.items() if part == "all" or area(k) == part) for c in counts.values()]
        print(f"| {part} | " + " | ".join(f"{x:.0f}" for x in cells) + " |")
    if len(names) > 1:
        new, old = counts[names[0]], counts[names[1]]
        rows = sorted(set(new) | set(old), key=lambda k: -abs(new[k] - old[k]))[:top]
        print(f"\nMost changed against {names[1]}:\n\n| function | steptap | {names[1]} |\n|---|---:|---:|")
        for k in rows:
            print(f"| `{k}` | {new[k]:.1f} | {old[k]:.1f} |")
    print()


def counting_parser(doc: str | None, calls: int) -> argparse.ArgumentParser:
    """The options both counting benches take: refs side by side, plain or streamed, how many calls, JSON."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", action="append", default=[], help="a git ref to count side by side")
    p.add_argument("--stream", action="store_true", help="streamed calls (default: plain)")
    p.add_argument("--calls", type=int, default=calls, help=f"counted calls (default {calls})")
    p.add_argument("--json", help="write the figures here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = counting_parser(__doc__, 1000)
    p.add_argument("--top", type=int, default=25, help="functions listed (default 25)")
    p.add_argument("--opcodes", action="store_true",
                   help="count bytecodes run by each function, in every thread, instead of calls (slow: "
                        "use --calls 200)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="steptap-counts-"))
    replay = Server("replay", python_cmd("replay_upstream.py"), log=str(work / "replay.log")).start()
    calls: dict[str, Counter[str]] = {}
    try:
        calls["steptap"] = count(None, replay.url, args, work, "steptap")
        for name, ref in zip(baseline_names(args.baseline), args.baseline, strict=True):
            calls[f"{name} ({ref})"] = count(baseline_tree(ref, work, name), replay.url, args, work, name)
    finally:
        replay.stop()
        shutil.rmtree(work, ignore_errors=True)  # the profiles and the logs: counted above, not kept
    kind = "streamed" if args.stream else "plain"
    what = "Bytecodes run (every thread)" if args.opcodes else "Python calls on the event loop"
    how = "sys.settrace" if args.opcodes else "cProfile"
    title = f"{what} per {kind} call ({args.calls} counted, {how}):"
    table(title, calls, args.top)
    if args.json:
        Path(args.json).write_text(json.dumps(calls, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
