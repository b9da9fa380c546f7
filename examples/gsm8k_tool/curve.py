"""The run's curve as a table: training reward by the policy version that sampled it, held-out accuracy by the
version evaluated (``steptap up``'s metrics file: the learner's rows and ``steptap eval``'s).

    python examples/gsm8k_tool/curve.py runs/gsm8k/metrics.jsonl [--json]

Exit status 1 when the file holds no training row (nothing was learned from).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from steptap.learner.plot import read_rows  # the one reader of the metrics file (lines being written skipped)


def by_version(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """version -> {"reward": the mean training reward of the batches it sampled, "batches": how many,
    "accuracy": held-out accuracy}."""
    out: dict[int, dict[str, Any]] = {}
    rewards: dict[int, list[float]] = {}
    for r in rows:
        if r.get("reward_mean") is not None and r.get("behaviour_version") is not None:
            rewards.setdefault(int(r["behaviour_version"]), []).append(float(r["reward_mean"]))
        if r.get("eval_accuracy") is not None and r.get("eval_version") is not None:
            out.setdefault(int(r["eval_version"]), {})["accuracy"] = float(r["eval_accuracy"])
    for v, rs in rewards.items():
        out.setdefault(v, {}).update(reward=statistics.fmean(rs), batches=len(rs))
    return dict(sorted(out.items()))


def table(curve: dict[int, dict[str, Any]]) -> str:
    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    lines = ["version  train reward (batches)  held-out accuracy"]
    for v, c in curve.items():
        reward = f"{cell(c.get('reward'))} ({c['batches']})" if "batches" in c else "-"
        lines.append(f"{v:>7}  {reward:<22}  {cell(c.get('accuracy'))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", help="the metrics file (steptap up: WORKDIR/metrics.jsonl)")
    p.add_argument("--json", action="store_true", help="one JSON object, versions as keys")
    args = p.parse_args(argv)
    try:
        curve = by_version(read_rows(args.metrics))
    except OSError as exc:
        print(f"curve: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(curve) if args.json else table(curve))
    return 0 if any("batches" in c for c in curve.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
