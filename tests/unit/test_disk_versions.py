"""Which published versions go through disk under ``weight_sync = "collective"`` (issue 42, item 4): by
default every ``checkpoint_every``-th one (10), so a replica that restarts or a learner killed mid-run finds
weights on disk at most that many versions old, beside the learner's checkpoint of the same update;
``disk_every = 0`` is never (only when a proxy asks, ``disk_wanted``); disk publishing is always disk."""

from __future__ import annotations

from steptap.learner.config import LearnerConfig


def test_collective_runs_put_every_tenth_version_on_disk_by_default() -> None:
    cfg = LearnerConfig(model_dir="m", weight_sync="collective")
    assert cfg.disk_every == cfg.checkpoint_every == 10
    assert [v for v in range(1, 31) if cfg.through_disk(v)] == [10, 20, 30]
    never = LearnerConfig(model_dir="m", weight_sync="collective", disk_every=0)
    assert not any(never.through_disk(v) for v in range(1, 31))
    assert all(LearnerConfig(model_dir="m").through_disk(v) for v in range(1, 5))  # disk: always
