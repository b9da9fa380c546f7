"""Metrics go through verl's ``Tracking`` to the configured backends (here TensorBoard and W&B, offline) while
the JSON-lines file that ``steptap plot`` and the live view read keeps every row."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from steptap.learner.engines.base import StepStats
from steptap.learner.metrics_log import MetricsLog, tracked_scalars, update_row
from steptap.learner.rows import Batch


def _row(update: int) -> dict:
    batch = Batch(samples=[], sequences=[], rewards=[0.25, 0.75], trajectory_ids=["a", "b"],
                  counts=Counter({"dropped_stale": 2}))
    stats = StepStats(loss=0.01, pg_clipfrac=0.125, ppo_kl=0.002, kl=0.0, entropy=3.5,
                      grad_norm=0.75 + update,
                      tokens=10, seq_tokens=20, seconds=0.5)
    return update_row(update, batch, stats, version=update, wall_s=0.6)


def test_tracked_scalars_are_the_rows_numbers() -> None:
    s = tracked_scalars(_row(1))
    assert (
        s["grad_norm"] == 1.75 and s["pg_clipfrac"] == 0.125 and s["entropy"] == 3.5 and s["ppo_kl"] == 0.002
    )
    assert s["counts/dropped_stale"] == 2.0 and "update" not in s and "time" not in s


def test_tensorboard_and_wandb_offline_through_verl_tracking(tmp_path: Path, monkeypatch) -> None:
    import wandb  # noqa: F401  (verl requires it, so it is always here)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    metrics = tmp_path / "m.jsonl"
    log = MetricsLog(str(metrics), tensorboard_dir=str(tmp_path / "tb"), show=False, trackers=("wandb",),
                     project="steptap-test", experiment="unit", config={"lr": 1e-3})
    for u in (1, 2):
        log.log(_row(u))
    log.close()
    assert [json.loads(line)["update"] for line in metrics.read_text().splitlines()] == [1, 2]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("grad_norm")] == [1.75, 2.75]
    assert [e.step for e in acc.Scalars("counts/dropped_stale")] == [1, 2]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))  # offline: nothing left the machine
    assert len(runs) == 1
