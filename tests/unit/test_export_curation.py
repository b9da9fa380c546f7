"""``steptap export --log`` writes what was curated (issue 22, Build 4): a real log written by the real
TrajectoryLog, with curation marks before and after the trajectories' records; the export leaves out what
the marks exclude (or keeps it flagged with ``--keep-excluded``), shows edited rewards beside the recorded
ones and the tags."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from steptap.adapters import export
from steptap.middleware.curation import MAX_MARKS_PER_TRAJECTORY
from steptap.middleware.log.offline import LogReader
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import Curation, Step, Trajectory


def _traj(tid: str, steps: int = 2) -> Trajectory:
    return Trajectory(
        id=tid, group_id="g", status="finished", rewards={"reward": 1.0},
        steps=[Step(trajectory_id=tid, index=i, prompt_token_ids=[1, 2, i], response_token_ids=[7, 8 + i],
                    response_logprobs=[-0.5, -0.25], rewards={"process": 0.5}) for i in range(steps)],
    )


def _mark(tid: str, action: str, step: int | None = None, **kw: object) -> Curation:
    return Curation(trajectory_id=tid, action=action, step=step, **kw)  # type: ignore[arg-type]


async def _log(tmp_path: Path) -> Path:
    log = await TrajectoryLog.open(str(tmp_path / "log"), segment_bytes=4096)
    await log.append(_mark("b", "tag", tags=["early"]))  # a mark before the trajectory's record
    for tid in ("a", "b", "c", "d"):
        await log.append(_traj(tid))
    await log.append(_mark("a", "exclude", reason="off topic"))
    await log.append(_mark("b", "reward", value=-1.0))
    await log.append(_mark("b", "reward", 1, value=2.0, name="process"))
    await log.append(_mark("b", "tag", tags=["judge", "early"]))
    await log.append(_mark("c", "exclude", 0, reason="loop"))
    await log.append(_mark("d", "exclude"))
    await log.append(_mark("d", "include"))  # the latest wins: d is in
    await log.close()
    return tmp_path / "log"


def _export(log: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str
            ) -> tuple[dict, dict[tuple[str, int], dict]]:
    assert export.main(["--log", str(log), "--out", str(out), *extra]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {(r["trajectory_id"], r["step_index"]): r for r in pq.read_table(out).to_pylist()}
    return summary, rows


async def test_export_leaves_out_what_curation_excluded_and_shows_edits_and_tags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = await _log(tmp_path)
    summary, rows = _export(log, tmp_path / "out", capsys)
    assert sorted(rows) == [("b", 0), ("b", 1), ("c", 1), ("d", 0), ("d", 1)]  # a, and c's step 0: out
    assert summary["trajectories"] == 3 and summary["rows"] == 5
    assert summary["excluded_trajectories"] == 1 and summary["excluded_steps"] == 1
    b0, b1 = rows[("b", 0)], rows[("b", 1)]
    # recorded rewards kept, the edited ones beside them
    assert b0["trajectory_reward"] == 1.0 and b0["curated_reward"] == -1.0
    assert b1["step_reward"] == 0.5 and b1["curated_step_reward"] == 2.0 and b0["curated_step_reward"] == 0.5
    assert b0["curation_tags"] == ["early", "judge"] and not b0["curation_excluded"]
    state = json.loads(b0["curation"])
    assert state["rewards"] == {"reward": -1.0} and state["step_rewards"] == {"1": {"process": 2.0}}
    d0 = rows[("d", 0)]
    assert not d0["curation_excluded"] and d0["curated_reward"] == d0["trajectory_reward"] == 1.0
    assert d0["curation_tags"] == [] and json.loads(d0["curation"])["marks"] == 2
    assert rows[("c", 1)]["curation"] is not None and not rows[("c", 1)]["curation_excluded"]


async def test_keep_excluded_keeps_the_rows_flagged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = await _log(tmp_path)
    summary, rows = _export(log, tmp_path / "out", capsys, "--keep-excluded")
    assert len(rows) == 8 and summary["excluded_trajectories"] == 1 and summary["kept_excluded"]
    flagged = sorted(k for k, r in rows.items() if r["curation_excluded"])
    assert flagged == [("a", 0), ("a", 1), ("c", 0)]
    assert json.loads(rows[("a", 0)]["curation"])["reasons"] == ["off topic"]


async def test_a_trajectory_s_marks_past_the_cap_are_counted_not_held(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path / "log"), segment_bytes=1 << 20)
    await log.append(_traj("a"))
    for _ in range(MAX_MARKS_PER_TRAJECTORY + 3):
        await log.append(_mark("a", "tag", tags=["x"]))
    await log.close()
    notes = LogReader(str(tmp_path / "log")).annotations()
    assert len(notes.marks["a"]) == MAX_MARKS_PER_TRAJECTORY and notes.marks_over == 3
