"""``steptap plot METRICS.jsonl -o curves.png``: reward and loss curves from the learner's metrics file.

Rows written by ``steptap eval --metrics-file`` (``eval_version``, ``eval_accuracy``) are drawn on the reward
panel at the update that published that policy version (version 0: before the first update). A tool
environment's eval rows (``eval_tool_call_rate``, ``eval_well_formed_rate``, ``eval_turns_mean``) get a panel
of their own: held-out accuracy, the two rates and the turns per episode, by update, and with
``eval_accuracy_by_kind`` (a task family's kinds, examples/pi_learns) each kind's accuracy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def read_rows(path: str | Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written right now
            continue
    return rows


def eval_points(rows: list[dict], evals: list[dict], key: str = "eval_accuracy") -> list[tuple[int, float]]:
    """(update, value of ``key``) for each eval row that has it: at the first update whose published version
    reached the row's version."""
    points = []
    for e in evals:
        if e.get(key) is None:
            continue
        version = e["eval_version"]
        published = (r["update"] for r in rows if (r.get("policy_version") or 0) >= version)
        x = 0 if version <= 0 else next(published, None)
        if x is not None:
            points.append((x, float(e[key])))
    return points


TOOL_SERIES = (  # (key, label, colour): a tool environment's held-out series
    ("eval_accuracy", "accuracy", "tab:orange"),
    ("eval_tool_call_rate", "tool-call rate", "tab:blue"),
    ("eval_well_formed_rate", "well-formed rate", "tab:green"),
)


def kind_points(rows: list[dict], evals: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each task kind's held-out accuracy (``eval_accuracy_by_kind``), by update; none for a single kind (its
    line is the accuracy's)."""
    kinds = sorted({k for e in evals for k in e.get("eval_accuracy_by_kind") or {}})
    if len(kinds) < 2:
        return {}
    out = {}
    for k in kinds:  # each kind's figure as an eval row's own key, for eval_points
        figures = [{**e, "kind": (e.get("eval_accuracy_by_kind") or {}).get(k)} for e in evals]
        out[k] = eval_points(rows, figures, "kind")
    return out


def _tool_panel(ax: Any, rows: list[dict], evals: list[dict]) -> None:
    for key, label, colour in TOOL_SERIES:
        pts = eval_points(rows, evals, key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", ms=4, color=colour, label=label)
    for kind, pts in kind_points(rows, evals).items():  # a task family's kinds, dotted under the accuracy
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=":", marker=".", label=f"accuracy: {kind}")
    ax.set_ylabel("held-out (greedy)")
    ax.set_ylim(-0.05, 1.05)
    turns = eval_points(rows, evals, "eval_turns_mean")
    twin = ax.twinx()
    twin.plot([p[0] for p in turns], [p[1] for p in turns], ls="--", marker=".", color="tab:gray",
              label="turns / episode")
    twin.set_ylabel("turns")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="best", fontsize=8)
    ax.grid(alpha=0.3)


def plot(rows: list[dict], out: str | Path, title: str = "", evals: list[dict] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    x = [r["update"] for r in rows]
    has_entropy = any(r.get("entropy") is not None for r in rows)
    has_tools = any(e.get("eval_tool_call_rate") is not None for e in evals or [])
    panels = 2 + has_entropy + has_tools
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2 + 2 * panels), sharex=True)
    ax_r, ax_l = axes[0], axes[1]
    reward = [r.get("reward_mean") for r in rows]
    ax_r.plot(x, reward, marker="o", ms=3, label="mean reward")
    std = [r.get("reward_std") or 0.0 for r in rows]
    known = [m for m in reward if m is not None]
    if len(known) == len(reward):
        ax_r.fill_between(x, [m - s for m, s in zip(known, std, strict=False)],
                          [m + s for m, s in zip(known, std, strict=False)],
                          alpha=0.2, label="± std")
    points = eval_points(rows, evals or [])
    if points:
        ax_r.plot([p[0] for p in points], [p[1] for p in points], marker="s", ms=5, color="tab:orange",
                  label="eval accuracy")
    ax_r.set_ylabel("reward")
    ax_r.legend(loc="best")
    ax_r.grid(alpha=0.3)
    ax_l.plot(x, [r.get("loss") for r in rows], color="tab:red", label="loss")
    if any(r.get("kl") for r in rows):
        ax_l.plot(x, [r.get("kl") for r in rows], color="tab:green", label="KL to reference")
    ax_l.set_ylabel("loss")
    ax_l.legend(loc="best")
    ax_l.grid(alpha=0.3)
    if has_entropy:  # on-policy GRPO losses hover near 0; the policy's entropy shows it sharpening
        axes[2].plot(x, [r.get("entropy") for r in rows], color="tab:purple", label="entropy (nats/token)")
        axes[2].legend(loc="best")
        axes[2].grid(alpha=0.3)
    if has_tools:
        _tool_panel(axes[-1], rows, evals or [])
    axes[-1].set_xlabel("update")
    fig.suptitle(title or "steptap learner")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="steptap plot", description=__doc__.split("\n")[0].split(": ", 1)[-1])
    p.add_argument("metrics", help="the learner's metrics file (JSON lines)")
    p.add_argument("-o", "--out", default="curves.png", help="PNG to write (default curves.png)")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    everything = read_rows(args.metrics)
    rows = [r for r in everything if "update" in r]
    evals = [r for r in everything if "eval_accuracy" in r and "eval_version" in r]
    if not rows:
        print(f"steptap plot: no updates in {args.metrics}")
        return 1
    extra = f", {len(evals)} evaluations" if evals else ""
    print(f"wrote {plot(rows, args.out, args.title, evals)} ({len(rows)} updates{extra})")
    return 0
