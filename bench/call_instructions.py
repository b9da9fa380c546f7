"""CPU instructions a model call costs the proxy, counted under callgrind: the same on a loaded machine as on
an idle one, so two refs compare in one run without rounds or a quiet hour.

    .venv/bin/python bench/call_instructions.py [--baseline REF ...] [--stream] [--calls 100] [--warm 20]
        [--cache]

Each target (the floor: bench/passthrough.py; this checkout's ``steptap serve``; each ``--baseline`` ref's
tree as ``proxy_overhead.py`` exports it) runs under ``valgrind --tool=callgrind`` (every thread of the
process: the event loop, the log's writer) in front of the replay upstream, and one keep-alive client sends
sequential calls (the recorded agent body, plain or ``--stream``). Each target runs twice, with W and W +
``--calls`` calls; the difference of the two totals divided by ``--calls`` is what one call costs, start-up
and shutdown cancelled out. Kernel time (syscalls, the log's fsync) is not counted: ``proxy_overhead.py``
times the whole call.

Printed: thousands of instructions per call, each target's ratio to the floor and to the first baseline.
Where the work per call is Python (it is), instructions follow CPU time: at 0b2ea21 and the code of
2026-12-04 the plain call's ratio (1.10x) was the ratio of CPU seconds ``proxy_overhead.py`` measured at
c=1 (bench/README.md). ``--cache`` adds callgrind's cache simulation: first-level data and instruction
misses per call, and last-level misses with the last level the size of this machine's L2 (a process's own
core's cache; callgrind's default, the shared L3, is larger than anything a call touches), what instructions
alone miss where one version touches more memory a call. Needs valgrind (Debian: ``apt-get install
valgrind``); about 2 minutes a target (longer with ``--cache``).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from call_counts import counting_parser, sequential
from procs import Server, free_port, python_cmd
from proxy_overhead import Steptap, baseline_names, baseline_tree, steptap_cmd

FLOOR = "floor (passthrough)"


L2 = Path("/sys/devices/system/cpu/cpu0/cache/index2")


def l2_geometry() -> str | None:
    """This machine's L2 as callgrind's ``--LL`` wants it (size,ways,line), or None where sysfs has none."""
    try:
        size, ways, line = ((L2 / f).read_text().strip() for f in ("size", "ways_of_associativity",
                                                                    "coherency_line_size"))
    except OSError:
        return None
    units = {"K": 1 << 10, "M": 1 << 20}
    return f"{int(size.rstrip('KM')) * units.get(size[-1], 1)},{ways},{line}"


def valgrind(out: Path, cache: bool = False) -> list[str]:
    exe = shutil.which("valgrind")
    if exe is None:
        raise SystemExit("call_instructions.py needs valgrind (Debian: apt-get install valgrind)")
    ll = l2_geometry() if cache else None
    # one output file for the process, its threads summed; no per-instruction data (smaller, faster)
    return [exe, "--tool=callgrind", "--dump-instr=no", f"--callgrind-out-file={out}",
            *(["--cache-sim=yes"] if cache else []), *([f"--LL={ll}"] if ll else [])]


def totals(out: Path) -> dict[str, int]:
    """The events callgrind counted in a run (its ``summary:`` or ``totals:`` line under ``events:``):
    ``Ir`` (instructions), and with the cache simulation ``D1mr``/``D1mw`` (first-level data misses) etc."""
    events: list[str] = []
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            return dict(zip(events or ["Ir"], map(int, line.split()[1:]), strict=False))
    raise RuntimeError(f"{out}: no totals line (did the process exit cleanly?)")


def counted(target: str, tree: str | None, upstream: str, n: int, stream: bool, work: Path, name: str,
            cache: bool = False) -> dict[str, int]:
    """callgrind's events of one target's process over ``n`` sequential calls, start to exit."""
    out = work / f"{name}.callgrind"
    if target == FLOOR:
        cmd = [*valgrind(out, cache), *python_cmd("passthrough.py", "--backend", upstream)]
        server: Server = Server(name, cmd, log=str(work / f"{name}.log")).start(timeout=900)
    else:
        port = free_port()
        # this checkout as ``python -m``, or a baseline's tree first on the path (steptap_cmd's boot code)
        prefix = [*valgrind(out, cache), sys.executable, *([] if tree else ["-m", "steptap.middleware.cli"])]
        cmd = steptap_cmd(upstream, port, str(work / f"{name}-log"), [], " ".join(prefix), tree)
        server = Steptap(name, cmd, log=str(work / f"{name}.log"))
        server.port = port
        server.start(timeout=900)
    try:
        sequential(server.port, n, stream, timeout=600)
    finally:
        server.stop(timeout=600)
    return totals(out)


def main(argv: list[str] | None = None) -> int:
    p = counting_parser(__doc__, 100)
    p.add_argument("--warm", type=int, default=20, help="calls before the counted ones (default 20)")
    p.add_argument("--cache", action="store_true",
                   help="simulate the caches too: first-level data and instruction misses per call (slower)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="steptap-instructions-"))
    targets: dict[str, str | None] = {FLOOR: None, "steptap": None}
    for name, ref in zip(baseline_names(args.baseline), args.baseline, strict=True):
        targets[f"{name} ({ref})"] = baseline_tree(ref, work, name)
    replay = Server("replay", python_cmd("replay_upstream.py"), log=str(work / "replay.log")).start()
    per_call: dict[str, float] = {}
    misses: dict[str, float] = {}  # --cache: first-level data misses (reads + writes) per call
    i_misses: dict[str, float] = {}  # --cache: first-level instruction misses per call
    ll_misses: dict[str, float] = {}  # --cache: last-level (L2-sized) misses per call: data and instructions
    try:
        for i, (target, tree) in enumerate(targets.items()):
            short = counted(target, tree, replay.url, args.warm, args.stream, work, f"t{i}-short", args.cache)
            long = counted(target, tree, replay.url, args.warm + args.calls, args.stream, work, f"t{i}-long",
                           args.cache)
            per_call[target] = (long["Ir"] - short["Ir"]) / args.calls
            if args.cache:
                misses[target] = sum(long.get(e, 0) - short.get(e, 0) for e in ("D1mr", "D1mw")) / args.calls
                i_misses[target] = (long.get("I1mr", 0) - short.get("I1mr", 0)) / args.calls
                ll_misses[target] = sum(long.get(e, 0) - short.get(e, 0) for e in ("DLmr", "DLmw", "ILmr")) \
                    / args.calls
    finally:
        replay.stop()
    kind = "streamed" if args.stream else "plain"
    names = list(per_call)
    ref = names[2] if len(names) > 2 else None
    print(f"Instructions per {kind} call ({args.calls} counted after {args.warm}, callgrind, all threads):\n")
    # (header, cell of a target): the instructions, and with --cache the data misses, each also against ref
    columns = [("k instructions", lambda n: f"{per_call[n] / 1e3:,.0f}"),
               ("x floor", lambda n: f"{per_call[n] / per_call[FLOOR]:.2f}")]
    if ref:
        columns.append((f"x {ref}", lambda n: f"{per_call[n] / per_call[ref]:.2f}"))
    if misses:
        columns.append(("k D1 misses", lambda n: f"{misses[n] / 1e3:,.1f}"))
        if ref:
            columns.append((f"x {ref}", lambda n: f"{misses[n] / misses[ref]:.2f}"))
        columns.append(("k I1 misses", lambda n: f"{i_misses[n] / 1e3:,.1f}"))
        if ref:
            columns.append((f"x {ref}", lambda n: f"{i_misses[n] / i_misses[ref]:.2f}"))
        ll = l2_geometry() or "callgrind's default"
        columns.append((f"k LL misses ({ll})", lambda n: f"{ll_misses[n] / 1e3:,.2f}"))
        if ref:
            columns.append((f"x {ref}", lambda n: f"{ll_misses[n] / ll_misses[ref]:.2f}"))
    print("| target | " + " | ".join(h for h, _ in columns) + " |\n|---|" + "---:|" * len(columns))
    for name in per_call:
        print(f"| {name} | " + " | ".join(cell(name) for _, cell in columns) + " |")
    if args.json:
        figures = {"kind": kind, "calls": args.calls, "per_call": per_call, "d1_misses": misses or None,
                   "i1_misses": i_misses or None, "ll_misses": ll_misses or None,
                   "ll": l2_geometry() if misses else None}
        Path(args.json).write_text(json.dumps(figures, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
