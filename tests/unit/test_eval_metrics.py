"""`steptap plot` draws `steptap eval` rows at the update that published their policy version."""

from __future__ import annotations

import json
from pathlib import Path

from steptap.learner.plot import eval_points, kind_points, main


def test_eval_rows_land_on_the_update_that_published_their_version(tmp_path: Path) -> None:
    updates = [{"update": u, "policy_version": u, "reward_mean": 0.1 * u, "loss": 0.0} for u in range(1, 7)]
    evals = [
        {"eval_version": 0, "eval_accuracy": 0.25},
        {"eval_version": 3, "eval_accuracy": 0.5},
        {"eval_version": 9, "eval_accuracy": 1.0},
    ]  # not yet published by any update: left out
    assert eval_points(updates, evals) == [(0, 0.25), (3, 0.5)]

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [*updates, *evals]))
    assert main([str(metrics), "-o", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_task_familys_kinds_get_a_line_each(tmp_path: Path) -> None:
    updates = [{"update": u, "policy_version": u, "reward_mean": 0.1, "loss": 0.0} for u in range(1, 6)]
    evals = [
        {"eval_version": 0, "eval_accuracy": 0.0, "eval_tool_call_rate": 0.0,
         "eval_accuracy_by_kind": {"count": 0.0, "product": 0.0}},
        {"eval_version": 5, "eval_accuracy": 0.5, "eval_tool_call_rate": 1.0,
         "eval_accuracy_by_kind": {"count": 0.25, "product": 1.0, "offbyone": 0.0}},  # a kind first seen at 5
    ]
    assert kind_points(updates, evals) == {"count": [(0, 0.0), (5, 0.25)], "offbyone": [(5, 0.0)],
                                           "product": [(0, 0.0), (5, 1.0)]}
    one = [{**e, "eval_accuracy_by_kind": {"product": e["eval_accuracy"]}} for e in evals]
    assert kind_points(updates, one) == {}  # one kind: its line is the accuracy's
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [*updates, *evals]))
    assert main([str(metrics), "-o", str(tmp_path / "k.png")]) == 0
    assert (tmp_path / "k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_live_view_shows_eval_accuracy_beside_the_training_reward(tmp_path: Path) -> None:
    from steptap.middleware.launch.view import StatusBoard, render_line

    path = tmp_path / "metrics.jsonl"
    rows = [
        {"time": 1.0, "eval_version": 0, "eval_accuracy": 0.25, "eval_episodes": 4},
        {"update": 1, "reward_mean": 0.5, "loss": 0.1, "policy_version": 1},
        {"time": 2.0, "eval_version": 1, "eval_accuracy": 0.75, "eval_episodes": 4},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    board = StatusBoard("http://127.0.0.1:9", path)  # nothing listens: the proxy's figures stay empty
    board.read_metrics()
    assert board.updates == 1 and board.recent_reward(3) == 0.5  # eval rows are not training updates
    assert board.evals == {0: 0.25, 1: 0.75}
    assert "eval accuracy by version v0: 0.250  v1: 0.750" in render_line(board)


def test_the_live_view_counts_updates_not_what_the_learner_set_aside(tmp_path: Path) -> None:
    """A skipped group's row (``skip_uniform_groups``) and a batch of nothing trainable are not updates: `up
    --max-updates N` counts the learner's updates, and the reward curves hold only trained batches."""
    from steptap.middleware.launch.view import StatusBoard

    path = tmp_path / "metrics.jsonl"
    rows = [
        {"time": 1.0, "skipped_group": "g0", "cause": "no_variance", "group_reward": 0.0, "trajectories": 8,
         "policy_version": 0},
        {"time": 1.5, "skipped_group": "g1", "cause": "no_variance", "reward": 0.0, "trajectories": 8,
         "policy_version": 0},  # as an older learner wrote it
        {"time": 2.0, "skipped_batch": 8, "policy_version": 0, "counts": {"dropped_no_variance": 8}},
        {"update": 1, "reward_mean": 0.5, "loss": 0.1, "policy_version": 1},
        {"time": 3.0, "skipped_group": "g2", "cause": "no_variance", "reward": 1.0, "policy_version": 1},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    board = StatusBoard("http://127.0.0.1:9", path)
    board.read_metrics()
    assert board.updates == 1 and board.first_reward(2) == 0.5 and board.recent_reward(3) == 0.5
    assert board.reward_by_version() == {"1": 0.5}


def test_a_tool_environments_eval_rows_get_their_own_panel(tmp_path: Path) -> None:
    updates = [{"update": u, "policy_version": u, "reward_mean": 0.1, "loss": 0.0} for u in range(1, 5)]
    evals = [
        {"eval_version": v, "eval_accuracy": 0.1 * v, "eval_tool_call_rate": 0.2 * v,
         "eval_well_formed_rate": 0.15 * v, "eval_turns_mean": 1 + 0.2 * v}
        for v in (0, 2, 4)
    ]
    assert eval_points(updates, evals, "eval_tool_call_rate") == [(0, 0.0), (2, 0.4), (4, 0.8)]
    assert eval_points(updates, [{"eval_version": 0, "eval_accuracy": 0.5}], "eval_turns_mean") == []
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [*updates, *evals]))
    assert main([str(metrics), "-o", str(tmp_path / "t.png")]) == 0
    from PIL import Image

    with Image.open(tmp_path / "t.png") as img:
        assert img.size[1] == 800  # three panels: reward, loss, the tool panel (2 + 2 * 3 inches at 100 dpi)
