"""The run's health as the proxy shows it (middleware/health.py has the rules, docs/health.md the meaning):
its own figures (sessions opened, closed, open, held for a pending reward; how long the quietest open
session and the oldest held trajectory have waited) and, when it knows the learner's metrics file
(``--console-learner-metrics``), the learner's latest batches; their findings on the console's overview and
in ``/metrics``.

Read when someone looks (a console poll, a scrape), never on the model-call path: one pass over the open and
held sessions, and the learner's file re-read only when it changed (its size or time).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily

from steptap.middleware import metrics as m
from steptap.middleware.config import CONFIG_KEY
from steptap.middleware.health import ProxyFigures, Thresholds, as_dicts, diagnose, summary
from steptap.middleware.sessions.control import SESSIONS_KEY
from steptap.middleware.sessions.manager import SessionManager

TAIL_BYTES = 256 * 1024  # the learner's file is read from its end: bounded however long the run
ROWS = 64  # batch rows kept: the rules read the last few (Thresholds.window)


def proxy_figures(manager: SessionManager, metrics: m.Metrics) -> ProxyFigures:
    """This proxy's figures, now."""
    now_m, now = time.monotonic(), time.time()
    named = [s for s in manager.sessions.values() if not s.trajectory.anonymous]
    closed = metrics.trajectories  # Tallies: counts by label (metrics.Tally)
    error = next((t.error for t in reversed(manager.recent.values()) if t.status != "finished" and t.error),
                 "")
    return ProxyFigures(
        opened=int(metrics.sessions_opened.value("false")),
        finished=int(closed.get("finished", 0)),
        aborted=int(sum(v for k, v in closed.items() if k != "finished")),
        open=len(named), held=len(manager.held),
        idle_s=max((now_m - s.last_active for s in named if not s.inflight), default=0.0),
        held_s=max((now - h.at for h in manager.held.values()), default=0.0),
        replies=int(sum(metrics.steps.values())),
        cut=int(metrics.replies_cut.value()),
        error=error or "",
    )


class LearnerTail:
    """The learner's last batch rows (those with a ``health`` dict), re-read only when its file changed."""

    def __init__(self) -> None:
        self.key: tuple[str, int, int] | None = None
        self.rows: list[dict[str, Any]] = []

    def read(self, path: str | None) -> list[dict[str, Any]]:
        if not path:
            return []
        try:
            st = os.stat(path)
        except OSError:
            return []
        key = (path, st.st_size, st.st_mtime_ns)
        if key != self.key:
            self.key, self.rows = key, _tail(path)
        return self.rows


def _tail(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            lines = f.read().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the first line of the tail is cut, or a line being written
        if isinstance(row, dict) and (isinstance(row.get("health"), dict) or "health_stop" in row):
            rows.append(row)
    return rows[-ROWS:]


TAIL_KEY = web.AppKey("steptap_learner_tail", LearnerTail)


def health(app: web.Application) -> dict[str, Any]:
    """The console's block: the proxy's figures, the learner's latest, the findings and the learner's stop."""
    config = app[CONFIG_KEY]
    rows = app[TAIL_KEY].read(config.console_learner_metrics)
    figures = proxy_figures(app[SESSIONS_KEY], app[m.METRICS_KEY])
    found = diagnose(rows, figures, Thresholds(stall_s=config.health_stall_s))
    stop = next((r for r in reversed(rows) if "health_stop" in r), None)
    return {"proxy": figures._asdict(), "learner": summary(rows), "findings": as_dicts(found),
            "stopped": None if stop is None else {"cause": stop.get("cause"), "text": stop["health_stop"]}}


class HealthCollector:
    """``/metrics``: the health gauges (metrics.py names them), computed at scrape time."""

    def __init__(self, app: web.Application) -> None:
        self.app = app

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        if SESSIONS_KEY not in self.app:  # before the log is open
            return
        block = health(self.app)
        yield GaugeMetricFamily(m.IDLE_MAX, "the longest an open session has gone without a call (seconds)",
                                block["proxy"]["idle_s"])
        yield GaugeMetricFamily(m.HELD_MAX, "the oldest held trajectory's wait for its reward (seconds)",
                                block["proxy"]["held_s"])
        learner = block["learner"]
        for name, key, text in (
                (m.HEALTH_GROUPS_VARIED, "groups_varied", "the learner's latest batch: share of groups with "
                                                          "reward variance"),
                (m.HEALTH_TOKENS_TRAINED, "tokens_trained", "... share of generated tokens in the loss"),
                (m.HEALTH_REPLIES_CUT, "replies_cut", "... share of replies cut by max_tokens"),
                (m.HEALTH_LOGPROB_GAP, "logprob_gap", "... mean |vLLM - learner| logprob (nats)"),
                (m.HEALTH_VERSION_LAG, "version_lag", "... mean policy versions the trained tokens lag")):
            if learner.get(key) is not None:
                yield GaugeMetricFamily(name, text, float(learner[key]))
        found = GaugeMetricFamily(m.HEALTH_FINDING, "1 for each thing the run's health names "
                                  "(docs/health.md)", labels=["cause", "level"])
        for f in block["findings"]:
            found.add_metric([f["cause"], f["level"]], 1.0)
        yield found
