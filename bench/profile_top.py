"""Summarize a py-spy profile of the proxy (raw collapsed stacks, as ``proxy_overhead.py --profile`` records).

    python bench/profile_top.py PROFILE.txt [--top 25] [--focus steptap]

Prints where the samples went: self time by function, inclusive time by function, and inclusive time by
source file group (steptap's modules one by one, aiohttp, msgspec, asyncio, the rest). py-spy leaves idle
threads out by default, so the shares are of the time the proxy was busy on a CPU.
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
    short = re.sub(r".*/work/main/", "", short)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--focus", help="only functions whose label contains this (inclusive table)")
    args = p.parse_args(argv)
    print(summarize(parse(args.profile), args.top, args.focus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
