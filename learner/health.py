"""The run's health as the learner sees it: each batch's figures (its metrics row's ``health`` dict, written
with each update and for a batch with nothing to train), and the check that warns after the first update and
stops a run that cannot learn, with the diagnosis in plain words. The rules are middleware/health.py's, the
same the console, ``/metrics``, ``steptap up``'s view and ``steptap doctor`` apply; docs/health.md says what
each figure means.

Every figure is counted from what the learner already holds (the batch, the engine's step statistics): no
extra pass over the data, no extra forward pass on the torch engine (its logprob gap is read off the first
epoch's forward, before the update).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import Any

from steptap.learner.engines.base import StepStats
from steptap.learner.rows import Batch
from steptap.middleware.health import CAUSES, Finding, Thresholds, diagnose, learner_findings

logger = logging.getLogger("steptap.learner")

# Estimators whose advantage compares a sample with the batch, not with its group: variance over the batch
BATCH_SCOPE = frozenset({"gae", "reinforce_plus_plus"})
ROWS_KEPT = 64  # batch rows the check remembers (it reads the last `window`)
PROXY_CAUSES = frozenset({"sessions_unfinished", "rewards_pending", "aborted"})


def gap_sums(mine: Any, recorded: Any, fresh: Any) -> tuple[float, int]:
    """The logprob gap of one pass: mean |recorded - mine| over the ``fresh`` positions (bool tensors of one
    shape: the trained tokens the current version sampled), and their count. Engines call it on what they
    computed anyway."""
    fresh = fresh.to(mine.device)
    n = int(fresh.sum())
    return (float((mine[fresh].float() - recorded.to(mine.device)[fresh]).abs().sum()) / n if n else 0.0), n


class HealthStop(RuntimeError):
    """The check found that nothing can be learned; its message is the diagnosis."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.text)
        self.finding = finding


def figures(batch: Batch, stats: StepStats | None, algorithm: str) -> dict[str, Any]:
    """One batch's health figures (middleware/health.py reads them)."""
    returns: dict[str, set[float]] = {}
    for s in batch.samples:
        returns.setdefault(s.group if algorithm not in BATCH_SCOPE else "batch", set()).add(round(s.ret, 9))
    lags = [batch.version - s.policy_version for s in batch.samples]
    cut = sum(batch.cut.values())
    out: dict[str, Any] = {
        "scope": "batch" if algorithm in BATCH_SCOPE else "group",
        "groups": len(returns),
        "groups_varied": sum(len(r) > 1 for r in returns.values()),
        "trajectories": len(batch.rewards),
        "reward_min": min(batch.rewards, default=None),
        "reward_max": max(batch.rewards, default=None),
        "unrewarded": batch.unrewarded,
        "tokens": dict(batch.tokens),
        "replies": batch.replies,
        "replies_cut": cut,
        "cut_max_tokens": batch.cut.most_common(1)[0][0] if cut else None,
        "version_lag_mean": round(statistics.fmean(lags), 3) if lags else None,
        "version_lag_max": max(lags, default=None),
        "newest_version": max((s.policy_version for s in batch.samples), default=None),
        "logprob_gap": None,
        "gap_tokens": 0,
    }
    if stats is not None and stats.gap_tokens:
        out["logprob_gap"], out["gap_tokens"] = round(stats.logprob_gap, 6), stats.gap_tokens
    return out


class HealthCheck:
    """Reads each batch's row; says what is wrong once per cause (a note, after the first update), and raises
    ``HealthStop`` when a stop rule holds and ``mode`` is ``stop``."""

    def __init__(self, mode: str, thresholds: Thresholds, note: Callable[[str], None]) -> None:
        self.mode, self.t, self.note = mode, thresholds, note
        self.rows: list[dict[str, Any]] = []
        self.said: set[str] = set()  # causes warned about and not cleared since

    def batch(self, row: dict[str, Any]) -> None:
        """A batch's row, before its weights are published: a stop here publishes nothing."""
        if self.mode == "off":
            return
        self.rows = [*self.rows[-(ROWS_KEPT - 1):], row]
        found = learner_findings(self.rows, self.t)
        self.said -= set(CAUSES) - PROXY_CAUSES - {f.cause for f in found}  # cleared: may be said again
        self._say(found)

    def proxies(self, figures: list[Any]) -> None:
        """The proxies' figures (middleware/health.ProxyFigures), read while no batch comes."""
        if self.mode == "off":
            return
        found = [f for p in figures for f in diagnose([], p, self.t)]
        self.said -= PROXY_CAUSES - {f.cause for f in found}
        self._say(found)

    def _say(self, found: list[Finding]) -> None:
        for f in found:
            if f.level == "stop" and self.mode == "stop":
                self.note(f"[red]health: stopping the run[/red]: {f.text}")
                logger.error("health: stopping the run: %s", f.text)
                raise HealthStop(f)
            if f.cause not in self.said:
                self.said.add(f.cause)
                self.note(f"[yellow]health[/yellow] ({f.cause}): {f.text}")
                logger.warning("health (%s): %s", f.cause, f.text)
