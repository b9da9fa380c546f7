"""A task run's figures from its state lines: pass rate per task, infrastructure errors by cause, and in eval
runs pass@1 and pass@k by policy version (the unbiased estimator of Chen et al. 2021: 1 - C(n-c, k) / C(n, k)
per task, averaged over the tasks with at least k episodes of that version).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

PASS_THRESHOLD = 1.0  # the reward at or above which an episode passes, unless the run says otherwise


def latest(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each episode's last attempt (an infrastructure error retried counts once, by its retry's outcome)."""
    last: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rec in lines:
        key = (rec["task"], rec["hash"], rec["round"], rec["index"])
        if key not in last or rec.get("attempt", 0) >= last[key].get("attempt", 0):
            last[key] = rec
    return list(last.values())


def passed(rec: dict[str, Any], threshold: float) -> bool:
    return rec["status"] == "finished" and rec.get("reward") is not None and rec["reward"] >= threshold


def per_task(lines: list[dict[str, Any]], threshold: float) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for rec in latest(lines):
        row = rows.setdefault(rec["task"], {"task": rec["task"], "episodes": 0, "passed": 0,
                                            "reward_sum": 0.0, "rewarded": 0, "infra_errors": 0})
        row["episodes"] += 1
        row["passed"] += passed(rec, threshold)
        row["infra_errors"] += rec["status"] == "infra_error"
        if rec.get("reward") is not None:
            row["reward_sum"] += rec["reward"]
            row["rewarded"] += 1
    out = []
    for row in sorted(rows.values(), key=lambda r: r["task"]):
        judged = row["episodes"] - row["infra_errors"]
        out.append({"task": row["task"], "episodes": row["episodes"], "passed": row["passed"],
                    "pass_rate": row["passed"] / judged if judged else None,
                    "reward_mean": row["reward_sum"] / row["rewarded"] if row["rewarded"] else None,
                    "infra_errors": row["infra_errors"]})
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def by_version(lines: list[dict[str, Any]], threshold: float, ks: list[int]) -> dict[int, dict[str, Any]]:
    """``{version: {"tasks", "episodes", "pass@K": ...}}`` over episodes with a verdict and a version."""
    counts: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for rec in latest(lines):
        if rec["status"] != "finished" or rec.get("policy_version") is None:
            continue
        nc = counts[int(rec["policy_version"])][rec["task"]]
        nc[0] += 1
        nc[1] += passed(rec, threshold)
    out: dict[int, dict[str, Any]] = {}
    for version, tasks in sorted(counts.items()):
        row: dict[str, Any] = {"tasks": len(tasks), "episodes": sum(n for n, _ in tasks.values())}
        for k in ks:
            scored = [pass_at_k(n, c, k) for n, c in tasks.values() if n >= k]
            row[f"pass@{k}"] = sum(scored) / len(scored) if scored else None
        out[version] = row
    return out


def summary(lines: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    eps = latest(lines)
    causes = Counter(r.get("infra_cause") or "other" for r in eps if r["status"] == "infra_error")
    retried = sum(1 for r in lines if r["status"] == "infra_error") - sum(causes.values())
    judged = [r for r in eps if r["status"] == "finished"]
    return {"episodes": len(eps), "finished": len(judged),
            "passed": sum(passed(r, threshold) for r in judged), "infra_errors": dict(causes),
            "infra_retried": retried,
            "short_groups": _short_groups(eps)}


def _short_groups(eps: list[dict[str, Any]]) -> int:
    """Groups that end with an episode still an infrastructure error: short of a member for the learner."""
    return len({r["group_id"] for r in eps if r["status"] == "infra_error"})


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain text table (``columns``: key, heading)."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    body = [[cell(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, (_, h) in enumerate(columns)]
    head = "  ".join(h.ljust(w) for (_, h), w in zip(columns, widths, strict=True)).rstrip()
    lines = ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)).rstrip() for b in body]
    return "\n".join([head, *lines])
