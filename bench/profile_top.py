"""Summarize a py-spy profile of the proxy (raw collapsed stacks, as ``proxy_overhead.py --profile`` records).

    python bench/profile_top.py PROFILE.txt [--top 25] [--focus steptap]

Prints where the samples went: self time by function, inclusive time by function, and inclusive time by
source file group (steptap's modules one by one, aiohttp, msgspec, asyncio, the rest). py-spy leaves idle
threads out by default, so the shares are of the time the proxy was busy on a CPU.

Two profiles side by side (e.g. a baseline's, recorded with ``proxy_overhead.py --baseline REF
--profile-target baseline``), each with the calls its run served (the run's ``calls`` column):

    python bench/profile_top.py NEW.txt --calls 6987 --compare OLD.txt --compare-calls 8641 [--top 40]

prints each function's inclusive busy time in microseconds per call (samples / rate / calls) in both, sorted
by what it added: where a round's new cost went.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")


def parse(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            frames, _, count = line.rpartition(" ")
            stacks.append((frames.split(";"), int(count)))
    return stacks


def label(frame: str) -> tuple[str, str]:
    """(``func (short file)``, group) for one collapsed frame."""
    m = _FRAME.match(frame)
    if not m:
        return frame, "other"
    func, file = m["func"], m["file"]
    short = re.sub(r".*/(site-packages|lib/python3\.\d+)/", "", file)
    # a checkout, a worktree or a baseline's exported tree: named from the package folder on
    short = re.sub(r"^(?:.*?/)?(?:steptap/)?(?=(?:middleware|adapters|learner|bench)/)", "", short)
    if "middleware/" in short or "steptap" in short:
        group = "steptap:" + short.rsplit("/", 1)[-1]
    elif short.startswith("aiohttp/"):
        group = "aiohttp:" + short.split("/", 1)[1]
    elif short.startswith(("msgspec", "yarl", "multidict", "asyncio/", "uvloop", "concurrent/", "threading")):
        group = short.split("/", 1)[0]
    else:
        group = "other"
    return f"{func} ({short})", group


def summarize(stacks: list[tuple[list[str], int]], top: int, focus: str | None) -> str:
    total = sum(n for _, n in stacks)
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    groups: Counter[str] = Counter()
    for frames, n in stacks:
        labels = [label(f) for f in frames if not f.startswith(("process ", "thread "))]
        if not labels:
            continue
        own[labels[-1][0]] += n
        for name in {lab for lab, _ in labels}:
            incl[name] += n
        groups[labels[-1][1]] += n
    lines = [f"{total} samples"]

    def table(title: str, counter: Counter[str], filt: str | None = None) -> None:
        lines.append(f"\n## {title}")
        rows = [(k, v) for k, v in counter.most_common() if not filt or filt in k][:top]
        for k, v in rows:
            lines.append(f"{100.0 * v / total:6.1f}%  {k}")

    table("self time by source group (where the CPU was)", groups)
    table("self time by function", own)
    table("inclusive time by function" + (f" (matching {focus!r})" if focus else ""), incl, focus)
    return "\n".join(lines)


def inclusive(stacks: list[tuple[list[str], int]]) -> tuple[Counter[str], int]:
    """Samples per function, inclusive (each counted once per stack), and the total."""
    incl: Counter[str] = Counter()
    total = 0
    for frames, n in stacks:
        total += n
        for name in {label(f)[0] for f in frames if not f.startswith(("process ", "thread "))}:
            incl[name] += n
    return incl, total


def compare(new: str, new_calls: int, old: str, old_calls: int, rate: float, top: int,
            focus: str | None) -> str:
    """Inclusive microseconds per call by function, ``new`` against ``old``, sorted by what ``new`` added."""
    a, ta = inclusive(parse(new))
    b, tb = inclusive(parse(old))
    us = 1e6 / rate
    per_a = {k: v * us / new_calls for k, v in a.items()}
    per_b = {k: v * us / old_calls for k, v in b.items()}
    lines = [f"busy us per call (all threads): new {ta * us / new_calls:.0f}, old {tb * us / old_calls:.0f}",
             "", "| function | new us/call | old us/call | added |", "|---|---:|---:|---:|"]
    keys = [k for k in set(per_a) | set(per_b) if not focus or focus in k]
    keys.sort(key=lambda k: per_a.get(k, 0.0) - per_b.get(k, 0.0), reverse=True)
    for k in keys[:top]:
        lines.append(f"| {k} | {per_a.get(k, 0.0):.1f} | {per_b.get(k, 0.0):.1f} | "
                     f"{per_a.get(k, 0.0) - per_b.get(k, 0.0):+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--focus", help="only functions whose label contains this (inclusive table)")
    p.add_argument("--calls", type=int, help="calls the profiled run served (with --compare)")
    p.add_argument("--compare", metavar="PROFILE",
                   help="an older profile: per-call inclusive times side by side")
    p.add_argument("--compare-calls", type=int, help="calls the older profile's run served")
    p.add_argument("--rate", type=float, default=250.0,
                   help="py-spy's samples per second (proxy_overhead: 250)")
    args = p.parse_args(argv)
    if args.compare:
        if not (args.calls and args.compare_calls):
            p.error("--compare needs --calls and --compare-calls")
        print(compare(args.profile, args.calls, args.compare, args.compare_calls, args.rate, args.top,
                      args.focus))
        return 0
    print(summarize(parse(args.profile), args.top, args.focus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
