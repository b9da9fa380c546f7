"""What the user sees: a progress bar, one status line per update, metrics as JSON lines, optional
TensorBoard.

Each update appends one JSON object to the metrics file (flushed at once, so ``steptap plot`` and ``steptap
up``'s live view can read it while the learner runs). Keys: ``update``, ``time``, ``reward_mean``,
``reward_std``, ``loss``, ``pg_clipfrac``, ``ppo_kl``, ``kl``, ``entropy``, ``grad_norm``, ``tokens``,
``tokens_per_s``, ``policy_version`` (the learner's, after this update's publish), ``behaviour_version`` (the
version that sampled most of the batch), the batch's drop/break counts by cause, and its ``health``
(learner/health.py, docs/health.md). A batch with nothing to train writes a row too (``skipped_batch``, its
counts and health, no ``update``), and the health check's stop a row ``{"health_stop", "cause"}``.

Besides that file (which the live view and ``steptap plot`` read), every update goes through verl's
``verl.utils.tracking.Tracking`` to the backends named in ``trackers`` (console, tensorboard, wandb, mlflow,
...): the numbers that move on-policy, where the loss stays near 0 (grad norm, ``ppo_kl`` = KL from the
behaviour policy, clip fraction, entropy), the reward, throughput and the counts (``counts/<cause>``).
``tensorboard_dir`` alone turns on the tensorboard backend there; W&B runs offline unless ``WANDB_MODE`` says
otherwise (nothing leaves the machine unasked).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from steptap.learner.engines.base import StepStats
from steptap.learner.rows import Batch


def update_row(update: int, batch: Batch, stats: StepStats | None, version: int, wall_s: float) -> dict[str,
                                                                                                        Any]:
    versions = Counter(s.policy_version for s in batch.samples)
    row: dict[str, Any] = {
        "update": update,
        "time": time.time(),
        "reward_mean": statistics.fmean(batch.rewards) if batch.rewards else None,
        "reward_std": statistics.pstdev(batch.rewards) if len(batch.rewards) > 1 else 0.0,
        "trajectories": len(batch.rewards),
        "policy_version": version,
        "behaviour_version": versions.most_common(1)[0][0] if versions else None,
        "wall_s": round(wall_s, 3),
    }
    if stats is not None:
        row.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in stats._asdict().items()})
        row["tokens_per_s"] = round(stats.seq_tokens / stats.seconds, 1) if stats.seconds > 0 else None
    row["counts"] = {k: v for k, v in sorted(batch.counts.items())}
    return row


def status_line(row: dict[str, Any]) -> str:
    def f(key: str, spec: str) -> str:
        v = row.get(key)
        return "-" if v is None else format(v, spec)

    c = row["counts"]
    stale = c.get("dropped_stale", 0) + c.get("downweighted_stale", 0)
    return (f"update {row['update']:>5}  reward {f('reward_mean', '.3f')}  loss {f('loss', '+.4f')}  "
            f"clip {f('pg_clipfrac', '.3f')}  kl {f('ppo_kl', '+.4f')}/{f('kl', '.4f')}  "
            f"tok/s {f('tokens_per_s', '.0f')}  stale {stale}  version {row['policy_version']}")


def tracked_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers for a tracker: flat names, counts under ``counts/``."""
    out = {k: float(v) for k, v in row.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("update", "time")}
    out |= {f"counts/{k}": float(v) for k, v in row.get("counts", {}).items()}
    health = row.get("health") or {}
    out |= {f"health/{k}": float(v) for k, v in health.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out |= {f"health/tokens/{k}": float(v) for k, v in (health.get("tokens") or {}).items()}
    return out


def make_tracking(trackers: tuple[str, ...] | list[str], tensorboard_dir: str = "", project: str = "steptap",
                  experiment: str = "learn", config: dict[str, Any] | None = None) -> Any:
    """verl's ``Tracking`` over ``trackers`` (plus tensorboard when ``tensorboard_dir`` is set), or None."""
    backends = list(dict.fromkeys([*trackers, *(["tensorboard"] if tensorboard_dir else [])]))
    if not backends:
        return None
    if tensorboard_dir:
        os.environ["TENSORBOARD_DIR"] = tensorboard_dir  # where verl's tensorboard adapter writes
    if "wandb" in backends:
        os.environ.setdefault("WANDB_MODE", "offline")
    from verl.utils.tracking import Tracking

    return Tracking(project_name=project, experiment_name=experiment, default_backend=backends,
                    config={"trainer": {}, "steptap": config or {}})


class MetricsLog:
    def __init__(self, path: str, tensorboard_dir: str = "", show: bool = True, total: int = 0,
                 trackers: tuple[str, ...] | list[str] = (), project: str = "steptap",
                 experiment: str = "learn",
                 config: dict[str, Any] | None = None) -> None:
        self.path = path
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self._fh = open(path, "a", encoding="utf-8")
        try:
            self._tracking = make_tracking(trackers, tensorboard_dir, project, experiment, config)
        except ImportError as exc:  # a backend's package is not installed: say which, keep the JSON lines
            print(f"tracking is off: {exc} (install the backend's package)")
            self._tracking = None
        self.console = Console(stderr=True)
        self._progress = None
        if show:
            self._progress = Progress(TextColumn("[bold]learning"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("updates"), TimeElapsedColumn(), console=self.console,
                                      transient=False)
            self._task = self._progress.add_task("updates", total=total or None)
            self._progress.start()

    def log(self, row: dict[str, Any]) -> None:
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()  # readers (steptap plot, steptap up) tail this file while we run
        if self._tracking is not None:
            self._tracking.log(tracked_scalars(row), step=row["update"])
        self.console.print(status_line(row), highlight=False)  # above the bar when there is one
        if self._progress is not None:
            self._progress.update(self._task, advance=1)

    def log_batch(self, row: dict[str, Any]) -> None:
        """A row that is no update (a batch with nothing to train, the health check's stop): the file only."""
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def note(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tracking is not None:
            self._tracking.finish()
            self._tracking = None
        self._fh.close()
