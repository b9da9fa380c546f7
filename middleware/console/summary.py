"""The run at a glance, for the console's overview: sessions, call rate, steps, the reward and eval curves by
policy version, the learner's last numbers (from its metrics file), the run's health (vitals.py), swaps,
replicas and the log's disk use."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from typing import Any

import msgspec
from aiohttp import web

from steptap.middleware.backend.pool import POOL_KEY
from steptap.middleware.config import CONFIG_KEY
from steptap.middleware.console import vitals
from steptap.middleware.console.index import RunIndex
from steptap.middleware.log.stream import LOG_KEY
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.sessions.control import SESSIONS_KEY
from steptap.middleware.weights.routes import SWAPPER_KEY

LEARNER_TAIL_BYTES = 512 * 1024  # the learner's file is read from its end: bounded however long the run
LEARNER_KEYS = ("update", "time", "loss", "ppo_kl", "kl", "grad_norm", "pg_clipfrac", "entropy",
                "reward_mean", "policy_version", "behaviour_version", "counts")
_PUBLIC_REPLICA = ("healthy", "state", "in_flight", "calls", "taken_out")  # no URL: it may be a socket path


class Rate:
    """Steps per second over the last minute of polls."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=64)

    def add(self, value: float) -> float | None:
        now = time.monotonic()
        while self.samples and now - self.samples[0][0] > 60:
            self.samples.popleft()
        self.samples.append((now, value))
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 - t0 >= 1.0 else None


def learner_rows(path: str | None, n: int = 200) -> list[dict[str, Any]]:
    """The last ``n`` update rows of the learner's metrics file (only the keys the console draws)."""
    if not path or not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - LEARNER_TAIL_BYTES))
        lines = f.read().splitlines()[-n:]
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the first line of the tail is cut, or a line being written
        if isinstance(row, dict) and "update" in row:
            rows.append({k: row.get(k) for k in LEARNER_KEYS})
    return rows


async def run_summary(app: web.Application, index: RunIndex, rate: Rate) -> dict[str, Any]:
    manager, swapper, pool, log = app[SESSIONS_KEY], app[SWAPPER_KEY], app[POOL_KEY], app[LOG_KEY]
    steps = sum(app[METRICS_KEY].steps.values())  # a Tally: steps by status
    weights = swapper.state()
    if weights.version > (index.swaps[-1]["version"] if index.swaps else 0):
        index.swaps.append({"version": weights.version, "at": weights.last_swap_at,
                            "paused_s": weights.last_paused_s, "swap_s": weights.last_swap_s})
    health = await pool.health()
    learner = learner_rows(app[CONFIG_KEY].console_learner_metrics)
    return {
        "time": time.time(),
        "sessions_open": len(manager.sessions),
        "sessions_finished": index.finished,
        "steps": int(steps),
        "calls_per_s": rate.add(steps),
        "policy_version": int(swapper.version),
        "reward_curve": index.curve("train"),
        "eval_curve": index.curve("eval"),
        "learner": learner,
        "health": vitals.health(app),
        "swaps": {"count": weights.swaps, "failures": weights.failures, "last_at": weights.last_swap_at,
                  "last_paused_s": weights.last_paused_s, "last_swap_s": weights.last_swap_s,
                  "mode": weights.swap_mode, "history": list(index.swaps)},
        "replicas": [{k: r[k] for k in _PUBLIC_REPLICA if k in r} for r in health["replicas"]],
        "log": {"disk_bytes": log.disk_bytes, "degraded": log.degraded},
    }


def dump(data: Any) -> bytes:
    return msgspec.json.encode(data)
