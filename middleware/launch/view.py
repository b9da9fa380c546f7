"""The live view of `steptap up`: what the proxy and the learner are doing, from their public outputs only.

Sources: the proxy's ``GET /metrics`` (Prometheus text) and ``GET /health`` (JSON), and the learner's metrics
file (one JSON object per update). Nothing here talks to the learner process or reads the trajectory log, so
the view can never slow the loop down or hold data back from the learner.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from steptap.middleware import health as h
from steptap.middleware import metrics as m
from steptap.middleware.client import SteptapError, SyncSteptapClient

# What the view reads from the proxy's /metrics: sample names built from the proxy's own constants (a test
# checks that a running proxy exports every one of them).
ACTIVE_SESSIONS = m.sample(m.SESSIONS_OPEN)
CALLS = m.sample(m.CALL_LATENCY, "count")  # model calls only (steptap_calls_total counts every route)
STEPS = m.sample(m.STEPS, "total")
FINISHED = m.sample(m.TRAJECTORIES, "total")
# The histogram has negative buckets, so prometheus_client omits its _sum: the proxy keeps the sum in a gauge.
REWARD_SUM = m.sample(m.REWARD_SUM)
REWARD_COUNT = m.sample(m.REWARD_VALUE, "count")
POLICY_VERSION = m.sample(m.POLICY_VERSION)
SWAPS = m.sample(m.WEIGHT_SWAPS, "total")
SWAP_SECONDS = m.sample(m.WEIGHT_SWAP_SECONDS)
STALL_MAX = m.sample(m.SWAP_STALL_MAX)
CUT = m.sample(m.SWAP_CUT_CALLS, "total")
SPANNING = m.sample(m.SPANNING_CALLS, "total")
TOKENS = m.sample(m.TOKENS_BY_VERSION, "total")
# The run's health (middleware/health.py reads them by the same names)
HEALTH = (m.sample(m.SESSIONS_OPENED, "total"), m.HELD_TRAJECTORIES, m.IDLE_MAX, m.HELD_MAX,
          m.sample(m.REPLIES_CUT, "total"))
READS = (ACTIVE_SESSIONS, CALLS, STEPS, FINISHED, REWARD_SUM, REWARD_COUNT, POLICY_VERSION, SWAPS,
         SWAP_SECONDS,
         STALL_MAX, CUT, SPANNING, *HEALTH)  # TOKENS has a sample per version, none before the first call

# Keys of the learner's metrics rows; the first one present wins.
K_UPDATE = ("update", "step", "updates")
# The learner's rows for what it consumed untrained (a group of one reward, a batch of nothing trainable): an
# older learner wrote a skipped group's reward as "reward", which counted it as an update (and its 0 in the
# reward curves), so `up --max-updates N` stopped N rows early
SKIPS = {"skipped_group", "skipped_batch"}
K_REWARD = ("reward_mean", "reward/mean", "mean_reward", "reward")
K_LOSS = ("loss", "policy_loss", "pg_loss", "actor/pg_loss")
K_VERSION = ("behaviour_version", "data_policy_version", "policy_version", "version")


def _first(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        if k in row and row[k] is not None:
            return row[k]
    return None


parse_prometheus = m.parse_text  # every sample summed over its labels, by sample name


def _pick(values: dict[str, float], name: str) -> float | None:
    return values.get(name)


class StatusBoard:
    """Polled once a second by `steptap up`; renders a rich table or one status line."""

    def __init__(self, proxy_url: str, metrics_path: Path, control_token: str | None = None) -> None:
        self.proxy_url = proxy_url
        self.client = SyncSteptapClient(proxy_url, control_token, timeout_s=2.0)
        self.metrics_path = Path(metrics_path)
        self.prom: dict[str, float] = {}
        self.health: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.evals: dict[int, float] = {}  # steptap eval's accuracy by policy version (same metrics file)
        self.batches: list[dict[str, Any]] = []  # the learner's last batch rows (health) and its stop, if any
        self._offset = 0
        self._health_at = 0.0
        self._calls: list[tuple[float, float]] = []  # (time, calls counter) for a 10 s rate
        self._rewards: list[tuple[float, float, float]] = []  # (time, reward sum, count) for a 60 s mean

    # -- polling ---------------------------------------------------------------------------------------
    def poll(self) -> None:
        text = _get(self.client, "metrics")
        if text is not None:
            try:
                self.prom = parse_prometheus(text)
            except ValueError:
                pass
        # /health asks the backends too: every 5 s is enough, and keeps vLLM's access log readable.
        body = _get(self.client, "health") if time.time() - self._health_at >= 5.0 else None
        if body is not None:
            self._health_at = time.time()
            try:
                self.health = json.loads(body)
            except ValueError:
                pass
        calls = _pick(self.prom, CALLS)
        if calls is not None:
            now = time.time()
            self._calls.append((now, calls))
            self._calls = [(t, c) for t, c in self._calls if now - t <= 10.0]
        rsum, rcount = _pick(self.prom, REWARD_SUM), _pick(self.prom, REWARD_COUNT)
        if rsum is not None and rcount is not None:
            now = time.time()
            self._rewards.append((now, rsum, rcount))
            self._rewards = [r for r in self._rewards if now - r[0] <= 60.0]
        self.read_metrics()

    def read_metrics(self) -> None:
        """New whole lines of the learner's metrics file (a partly written line waits for the next poll)."""
        try:
            with open(self.metrics_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and (isinstance(row.get("health"), dict) or "health_stop" in row):
                self.batches = [*self.batches[-63:], row]
            if not isinstance(row, dict) or SKIPS & row.keys():  # consumed untrained: not an update
                continue
            if _first(row, K_REWARD) is not None:
                self.rows.append(row)
            elif isinstance(row.get("eval_accuracy"), (int, float)):
                self.evals[int(row.get("eval_version") or 0)] = float(row["eval_accuracy"])

    # -- figures ---------------------------------------------------------------------------------------
    @property
    def updates(self) -> int:
        if not self.rows:
            return 0
        last = _first(self.rows[-1], K_UPDATE)
        return int(last) if isinstance(last, (int, float)) else len(self.rows)

    @property
    def policy_version(self) -> int | None:
        v = _pick(self.prom, POLICY_VERSION)
        if v is None and isinstance(self.health.get("policy_version"), (int, float)):
            v = self.health["policy_version"]
        return None if v is None else int(v)

    def calls_per_s(self) -> float | None:
        if len(self._calls) < 2:
            return None
        (t0, c0), (t1, c1) = self._calls[0], self._calls[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None

    def rollout_reward(self) -> float | None:
        """Mean reward of the trajectories closed at the proxy in the last minute (what agents earn now)."""
        if len(self._rewards) < 2:
            return None
        (_, s0, c0), (_, s1, c1) = self._rewards[0], self._rewards[-1]
        return (s1 - s0) / (c1 - c0) if c1 > c0 else None

    def first_reward(self, n: int) -> float | None:
        vals = [float(_first(r, K_REWARD)) for r in self.rows[:n]]
        return round(sum(vals) / len(vals), 4) if vals else None

    def recent_reward(self, n: int) -> float | None:
        vals = [float(_first(r, K_REWARD)) for r in self.rows[-n:]]
        return round(sum(vals) / len(vals), 4) if vals else None

    def recent_loss(self) -> float | None:
        for row in reversed(self.rows):
            if (loss := _first(row, K_LOSS)) is not None:
                return float(loss)
        return None

    def reward_by_version(self) -> dict[str, float]:
        """Mean reward of the updates' batches, by the policy version that sampled them."""
        acc: dict[str, list[float]] = defaultdict(list)
        for row in self.rows:
            acc[str(_first(row, K_VERSION) if _first(row, K_VERSION) is not None else "?")].append(
                float(_first(row, K_REWARD))
            )
        return {v: round(sum(x) / len(x), 4) for v, x in acc.items()}

    def eval_line(self) -> str:
        """steptap eval's accuracy for the last few policy versions."""
        return "  ".join(f"v{k}: {v:.3f}" for k, v in sorted(self.evals.items())[-6:])

    def last_swap(self) -> str:
        swaps = _pick(self.prom, SWAPS)
        secs = _pick(self.prom, SWAP_SECONDS)
        version = self.policy_version
        if not swaps and not version:
            return "none yet"
        parts = [f"version {version}"] if version is not None else []
        if swaps:
            parts.append(f"{int(swaps)} swaps")
        if secs:
            parts.append(f"last took {secs:.2f} s")
        stall, cut, spanning = (_pick(self.prom, k) for k in (STALL_MAX, CUT, SPANNING))
        if swaps and stall is not None:
            parts.append(f"longest stall {stall:.2f} s")
        if spanning:
            parts.append(f"{int(spanning)} calls spanned a swap")
        if cut:
            parts.append(f"{int(cut)} cut")
        return ", ".join(parts)

    def tokens_by_version(self) -> str:
        """Response tokens per policy version (the latest few)."""
        prefix = TOKENS + "{"
        got = sorted((int(k[len(prefix):-1]), v) for k, v in self.prom.items() if k.startswith(prefix))
        return "  ".join(f"v{k}: {int(v)}" for k, v in got[-6:]) or "-"

    def findings(self) -> list[h.Finding]:
        """What the run's health names now (the learner's rows, the proxy's counters)."""
        return h.diagnose(self.batches, h.proxy_figures(self.prom) if self.prom else None)

    def health_stop(self) -> str | None:
        """The learner's health check's diagnosis, when it stopped the run."""
        return next((str(r["health_stop"]) for r in reversed(self.batches) if "health_stop" in r), None)

    def health_line(self) -> str:
        found = self.findings()
        return "; ".join(f"{f.level} {f.cause}" for f in found) if found else "nothing to name"

    def health_figures(self) -> str:
        s = h.summary(self.batches)

        def pct(v: Any) -> str:
            return "-" if v is None else f"{100 * v:.0f}%"

        p = h.proxy_figures(self.prom)
        gap, lag = s.get("logprob_gap"), s.get("version_lag")
        learner = (f"variance {pct(s.get('groups_varied'))} of groups, {pct(s.get('tokens_trained'))} of "
                   f"tokens in the loss, {pct(s.get('replies_cut'))} cut, gap "
                   f"{'-' if gap is None else format(gap, '.3g')}, lag "
                   f"{'-' if lag is None else format(lag, '.1f')}; ") if s else ""
        return (f"{learner}sessions {p.opened} opened, {p.finished} finished, {p.aborted} aborted, {p.open} "
                f"open, {p.held} pending")

    # -- rendering -------------------------------------------------------------------------------------
    def figures(self) -> list[tuple[str, str]]:
        def fmt(v: float | None, spec: str = ".0f") -> str:
            return "-" if v is None else format(v, spec)

        by_version = self.reward_by_version()
        rollout = (
            self.rollout_reward()
        )  # needs the histogram's _sum, which a histogram with negative buckets omits
        return [
            ("active sessions", fmt(_pick(self.prom, ACTIVE_SESSIONS))),
            ("calls/s (10 s)", fmt(self.calls_per_s(), ".1f")),
            ("steps recorded", fmt(_pick(self.prom, STEPS))),
            ("trajectories closed", fmt(_pick(self.prom, FINISHED))),
            *([("agents' reward (last 60 s)", fmt(rollout, ".3f"))] if rollout is not None else []),
            ("learner updates", str(self.updates)),
            ("reward (last 3 updates)", fmt(self.recent_reward(3), ".3f")),
            (
                "reward by policy version",
                "  ".join(f"v{k}: {v:.3f}" for k, v in list(by_version.items())[-6:]) or "-",
            ),
            *([("eval accuracy by version", self.eval_line())] if self.evals else []),
            ("learner loss", fmt(self.recent_loss(), ".4f")),
            ("last weight swap", self.last_swap()),
            ("tokens by policy version", self.tokens_by_version()),
            ("run health", self.health_line()),
            ("health figures", self.health_figures()),
        ]

    def render(self, title: str) -> Any:
        from rich.table import Table

        table = Table(title=title, show_header=False, expand=False)
        table.add_column(style="bold")
        table.add_column()
        for name, value in self.figures():
            table.add_row(name, value)
        for f in self.findings():  # in words: what is wrong and what to do (docs/health.md)
            table.add_row(f"[{'red' if f.level == 'stop' else 'yellow'}]{f.cause}", f.text)
        return table


def render_line(board: StatusBoard) -> str:
    keep = {
        "active sessions",
        "calls/s (10 s)",
        "steps recorded",
        "agents' reward (last 60 s)",
        "learner updates",
        "reward (last 3 updates)",
        "eval accuracy by version",
        "learner loss",
        "last weight swap",
        "run health",
    }
    return " | ".join(f"{k} {v}" for k, v in board.figures() if k in keep)


def _get(client: SyncSteptapClient, what: str) -> str | None:
    try:
        if what == "metrics":
            return client.metrics_text()
        return json.dumps(client.health())
    except (OSError, ValueError, SteptapError):
        return None
