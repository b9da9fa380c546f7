"""The proxy benchmark's figures: per-run statistics, medians over rounds, the targets, the Markdown summary.

Every target is a ratio (or a difference) between steptap and the pass-through measured in the same round,
then the median over rounds: the machine's noise moves both sides of a pair together. The targets are issue
15's ("the proxy's cost per call close to the floor"):

- calls/s: plain c=32 >= 0.8 x the pass-through's, streamed c=32 >= 0.7 x, plain and streamed c=256 >= 0.7 x;
- p99 latency at c=256 <= 1.5 x the pass-through's, plain and streamed;
- added median latency at c=1 over the pass-through's <= 0.5 ms, plain and streamed;
- the proxy process's CPU time per call <= 2 x the pass-through's, in every configuration.

A configuration whose concurrency is not in the run gets no verdict (a smoke run at c=4 judges nothing but
CPU).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

# (mode, concurrency, figure, ">=" or "<=", bound); figures are computed per round in summarize().
TARGETS: list[tuple[str, int, str, str, float]] = [
    ("plain", 32, "ratio_calls_per_s", ">=", 0.8),
    ("stream", 32, "ratio_calls_per_s", ">=", 0.7),
    ("plain", 256, "ratio_calls_per_s", ">=", 0.7),
    ("stream", 256, "ratio_calls_per_s", ">=", 0.7),
    ("plain", 256, "ratio_p99", "<=", 1.5),
    ("stream", 256, "ratio_p99", "<=", 1.5),
    ("plain", 1, "added_p50_ms", "<=", 0.5),
    ("stream", 1, "added_p50_ms", "<=", 0.5),
]
CPU_RATIO_MAX = 2.0  # every configuration
FIGURE_NAMES = {
    "ratio_calls_per_s": "calls/s, steptap / pass-through",
    "ratio_p99": "p99, steptap / pass-through",
    "added_p50_ms": "added p50 ms, steptap - pass-through",
    "ratio_cpu": "proxy CPU per call, steptap / pass-through",
}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100.0 * (len(s) - 1))))
    return s[k]


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize_run(res: dict[str, Any], elapsed_s: float, interleaved: bool) -> dict[str, Any]:
    lat = res["latencies_ms"]
    if interleaved:  # the targets shared the run's time: a sequential agent's rate is 1 / mean latency
        rate = 1000.0 * len(lat) / sum(lat) if lat else 0.0
    else:
        rate = res["calls"] / elapsed_s if elapsed_s > 0 else 0.0
    return {
        "calls": res["calls"],
        "errors": res["errors"],
        "elapsed_s": round(elapsed_s, 4),
        "calls_per_s": rate,
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
    }


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("nan")


def _paired(runs: list[dict[str, Any]], mode: str, c: int, a: str, b: str) -> list[tuple[dict[str, Any],
                                                                                         dict[str, Any]]]:
    """(a's run, b's run) of each round that measured both in this configuration."""
    pairs: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        if r["mode"] == mode and r["concurrency"] == c and r["target"] in (a, b):
            pairs.setdefault(r["round"], {})[r["target"]] = r
    return [(p[a], p[b]) for p in pairs.values() if len(p) == 2]


def _figures(full: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, float]:
    return {
        "ratio_calls_per_s": med([_ratio(s["calls_per_s"], p["calls_per_s"]) for s, p in full]),
        "ratio_p99": med([_ratio(s["p99_ms"], p["p99_ms"]) for s, p in full]),
        "added_p50_ms": med([s["p50_ms"] - p["p50_ms"] for s, p in full]),
        "added_cpu_ms_per_call": med(
            [s["proxy_cpu_ms_per_call"] - p["proxy_cpu_ms_per_call"] for s, p in full]
        ),
        "ratio_cpu": med([_ratio(s["proxy_cpu_ms_per_call"], p["proxy_cpu_ms_per_call"]) for s, p in full]),
    }


def summarize(runs: list[dict[str, Any]], targets: list[str], configs: list[tuple[str, int]]) -> dict[str,
                                                                                                      Any]:
    """Medians per target and configuration; ``targets``: steptap's figures against the pass-through (the
    verdicts are on them); ``baselines``: each baseline's against the pass-through, and ``vs_baseline``:
    steptap's against each baseline, each a median over rounds of the per-round ratio."""
    out: dict[str, Any] = {"configs": [], "targets": {}, "baselines": {}, "vs_baseline": {}}
    proxies = [t for t in targets if t == "steptap" or t.startswith("baseline")]
    for mode, c in configs:
        for t in targets:
            rs = [r for r in runs if r["mode"] == mode and r["concurrency"] == c and r["target"] == t]
            out["configs"].append(
                {
                    "mode": mode,
                    "concurrency": c,
                    "target": t,
                    "rounds": len(rs),
                    "calls_per_s": med([r["calls_per_s"] for r in rs]),
                    "p50_ms": med([r["p50_ms"] for r in rs]),
                    "p99_ms": med([r["p99_ms"] for r in rs]),
                    "proxy_cpu_ms_per_call": (
                        None if t == "direct" else med([r["proxy_cpu_ms_per_call"] for r in rs])
                    ),
                    "calls": sum(r["calls"] for r in rs),
                    "log_wait_ms": med([r["log_wait_ms"] for r in rs if "log_wait_ms" in r])
                    if t in proxies
                    else None,
                }
            )
        key = f"{mode} c={c}"
        if "passthrough" in targets:
            for t in proxies:
                figures = _figures(_paired(runs, mode, c, t, "passthrough"))
                if t == "steptap":
                    out["targets"][key] = figures
                else:
                    out["baselines"].setdefault(t, {})[key] = figures
        if "steptap" in targets:
            for t in proxies:
                if t != "steptap":
                    out["vs_baseline"].setdefault(t, {})[key] = _figures(_paired(runs, mode, c, "steptap", t))
    out["verdicts"] = verdicts(out["targets"])
    return out


def verdicts(figures: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Each target whose configuration was measured: its figure and whether it holds (None: no figure, e.g. a
    short run whose pass-through used less CPU than one clock tick)."""
    found: dict[str, dict[str, Any]] = {}
    checks = [(mode, c, fig, op, bound) for mode, c, fig, op, bound in TARGETS]
    checks += [(key.split(" c=")[0], int(key.split(" c=")[1]), "ratio_cpu", "<=", CPU_RATIO_MAX)
               for key in figures]
    for mode, c, fig, op, bound in checks:
        key = f"{mode} c={c}"
        if key not in figures:
            continue
        value = figures[key][fig]
        # NaN: no figure
        ok = None if math.isnan(value) else bool(value >= bound if op == ">=" else value <= bound)
        found[f"{key}: {FIGURE_NAMES[fig]} {op} {bound}"] = {"value": value, "pass": ok}
    return found


BUDGET_SLACK = 1.10  # a CPU ratio more than 10% above the committed one is reported as a regression


def cpu_figures(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per configuration: steptap's and the pass-through's CPU microseconds per call (medians over rounds) and
    the ratio of the two (the median of the per-round ratios): the per-call CPU budget's figures."""
    per = {(r["mode"], r["concurrency"], r["target"]): r["proxy_cpu_ms_per_call"] for r in summary["configs"]}
    out = {}
    for key, v in summary["targets"].items():
        mode, c = key.split(" c=")
        steptap, floor = per.get((mode, int(c), "steptap")), per.get((mode, int(c), "passthrough"))
        if steptap is None or floor is None:
            continue
        out[key] = {"steptap_cpu_us": round(1000.0 * steptap, 1), "floor_cpu_us": round(1000.0 * floor, 1),
                    "ratio_cpu": round(v["ratio_cpu"], 3)}
    return out


def check_budget(figures: dict[str, dict[str, float]], budget: dict[str, Any]) -> list[dict[str, Any]]:
    """Each configuration of the committed budget measured in this run: its CPU ratio to the pass-through
    against the committed one (a ratio: the absolute microseconds move with the machine and its load), a
    regression when more than ``BUDGET_SLACK`` times it."""
    found = []
    for key, want in budget.get("figures", {}).items():
        got = figures.get(key)
        if got is None or math.isnan(got["ratio_cpu"]):
            continue
        found.append({"config": key, "committed": want["ratio_cpu"], "measured": got["ratio_cpu"],
                      "regression": got["ratio_cpu"] > BUDGET_SLACK * want["ratio_cpu"]})
    return found


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [
        "| mode | c | target | calls/s | p50 ms | p99 ms | proxy CPU ms/call | calls |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in s["configs"]:
        cpu = "" if r["proxy_cpu_ms_per_call"] is None else f"{r['proxy_cpu_ms_per_call']:.3f}"
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['target']} | {r['calls_per_s']:.0f} | "
            f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {cpu} | {r['calls']} |"
        )
    if s["targets"]:
        lines += [
            "",
            "| config | calls/s ratio | p99 ratio | added p50 ms | CPU/call ratio | added CPU ms/call |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for key, v in s["targets"].items():
            lines.append(
                f"| {key} | {v['ratio_calls_per_s']:.2f} | {v['ratio_p99']:.2f} | {v['added_p50_ms']:+.3f} | "
                f"{v['ratio_cpu']:.2f} | {v['added_cpu_ms_per_call']:+.3f} |"
            )
    # each baseline against the floor, then steptap against it (ratios per round, medians)
    floor = {"steptap": s["targets"], **s.get("baselines", {})}
    if len(floor) > 1:
        names = list(floor)
        refs = result.get("baselines", {})
        lines += [
            "",
            "calls/s / the pass-through's (added p50 ms at c=1; CPU ms per call), per target:",
            "",
            "| config | " + " | ".join(f"{n} ({refs.get(n, 'this checkout')})" for n in names) + " |",
            "|---|" + "---:|" * len(names),
        ]
        for key in s["targets"]:
            cells = []
            for n in names:
                v = floor[n].get(key)
                cells.append("" if v is None else f"{v['ratio_calls_per_s']:.2f}x, "
                             f"{v['added_p50_ms']:+.2f} ms, CPU {v['ratio_cpu']:.2f}x")
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    for name, figs in s.get("vs_baseline", {}).items():
        lines += ["", f"steptap / {name} ({result.get('baselines', {}).get(name, '')}), same rounds:", "",
                  "| config | calls/s ratio | p99 ratio | added p50 ms | CPU/call ratio |",
                  "|---|---:|---:|---:|---:|"]
        for key, v in figs.items():
            lines.append(f"| {key} | {v['ratio_calls_per_s']:.2f} | {v['ratio_p99']:.2f} | "
                         f"{v['added_p50_ms']:+.3f} | {v['ratio_cpu']:.2f} |")
    cpu = cpu_figures(s)
    if cpu:
        lines += ["", "CPU per call (user + system, all threads), microseconds:", "",
                  "| config | steptap | pass-through (floor) | ratio |", "|---|---:|---:|---:|"]
        for key, v in cpu.items():
            lines.append(f"| {key} | {v['steptap_cpu_us']:.0f} | {v['floor_cpu_us']:.0f} | "
                         f"{v['ratio_cpu']:.2f} |")
    for b in result.get("budget", []):
        word = "REGRESSION" if b["regression"] else "within budget"
        lines.append(f"- {word}: {b['config']} CPU ratio {b['measured']:.2f} against the committed "
                     f"{b['committed']:.2f} (bench/cpu_budget.json; more than {BUDGET_SLACK:.2f}x is a "
                     "regression)")
    if s["verdicts"]:
        lines.append("")
        for key, v in s["verdicts"].items():
            # e.g. CPU below the clock tick
            word = {True: "PASS", False: "MISS", None: "NO FIGURE"}[v["pass"]]
            lines.append(f"- {word} {key} (measured {v['value']:.3f})")
    log = result.get("log")
    lines.append("")
    for name, lg in result.get("logs", {"steptap": log} if log else {}).items():
        lines.append(
            f"- log ({name}): {lg['steps']} steps for {lg['calls_sent']} calls sent "
            f"({'one step per call' if lg['one_step_per_call'] else 'MISMATCH'}); records {lg['records']}"
        )
    waits = [
        r for r in s["configs"] if r.get("log_wait_ms") is not None and r["log_wait_ms"] == r["log_wait_ms"]
    ]
    if waits:
        lines.append(
            "- the wait for the log commit (each proxy's own `steptap_log_commit_seconds`), mean ms per "
            "record: "
            + ", ".join(
                f"{r['target']} {r['mode']} c={r['concurrency']} {r['log_wait_ms']:.2f}" for r in waits
            )
        )
    if result.get("fsync_ms"):
        f = result["fsync_ms"]
        lines.append(
            f"- fdatasync of an 8 kB append where the log lives, ms: before {f['before']}, after {f['after']}"
        )
    if log:
        lines.append(f"- log size: {log['bytes']} bytes, {log['bytes_per_call']} bytes per call")
    probs = result["problems"]
    lines.append(
        f"- correctness: {'all bodies and counts as expected' if not probs else f'{len(probs)} problems'}"
    )
    lines += [f"  - {p}" for p in probs[:20]]
    return "\n".join(lines)
