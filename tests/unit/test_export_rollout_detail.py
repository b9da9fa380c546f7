"""``steptap export --format rollout-detail`` (issue 38 item 6): trajectories in the shapes Harbor keeps its
own in (``AgentContext.rollout_details``, ``VerifierResult.rewards``), from a log written by the real
TrajectoryLog, and read back by Harbor's own pydantic models in Harbor's venv (tests/harbor_check.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from harbor_venv import harbor_check

from steptap.adapters import export
from steptap.adapters.rollout_detail import FILE_NAME
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import Curation, ImageRef, Step, Trajectory, Usage


def _step(tid: str, index: int, **kw: object) -> Step:
    base = dict(trajectory_id=tid, index=index, prompt_token_ids=[1, 2, 10 * index],
                response_token_ids=[100 + index, 200 + index], response_logprobs=[-0.5, -0.25 * index],
                policy_version=3, served_model="tiny", finish_reason="stop",
                usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5))
    return Step(**{**base, **kw})  # type: ignore[arg-type]


def _session(tid: str) -> Trajectory:
    """A main line (0, 1) with a side call (2) and a failed call (3) beside it, a compaction's new branch
    (4, 5), and a call of n=2 (6, its choices 0 and 1)."""
    steps = [
        _step(tid, 0, rewards={"tool": 0.5}),
        _step(tid, 1, prefix="extends", version_spans=[[3, 0], [4, 1]], response_logprobs=[-0.5, math.nan]),
        _step(tid, 2, call_class="side", served_model="small", finish_reason="length"),
        _step(tid, 3, status="failed", response_token_ids=[], response_logprobs=[], usage=Usage()),
        _step(tid, 4, call_class="branch", branch=1, images=[ImageRef(sha256="ab" * 32, mime="image/png")]),
        _step(tid, 5, branch=1, prefix="extends"),
        _step(tid, 6, branch=1),
        _step(tid, 6, choice=1, branch=1, response_token_ids=[7], response_logprobs=[-3.0]),
    ]
    return Trajectory(id=tid, group_id="g", group_size=2, status="finished", rewards={"reward": 1.0},
                      reward_sources={"reward": "http"}, metadata={"task": "fix-median"}, steps=steps)


async def _log(tmp_path: Path) -> Path:
    log = await TrajectoryLog.open(str(tmp_path / "log"), segment_bytes=1 << 20)
    await log.append(_session("a"))
    await log.append(_session("b"))
    await log.append(Trajectory(id="c", status="finished", rewards={"reward": 0.0},
                                steps=[_step("c", 0)]))
    await log.append(Curation(trajectory_id="b", action="reward", value=0.25))
    await log.append(Curation(trajectory_id="b", step=5, action="exclude", reason="loop"))
    await log.append(Curation(trajectory_id="c", action="exclude"))
    await log.close()
    return tmp_path / "log"


def _export(log: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[dict, dict]:
    assert export.main(["--log", str(log), "--out", str(out), "--format", "rollout-detail", *extra]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lines = [json.loads(line) for line in (out / FILE_NAME).read_text().splitlines()]
    return summary, {line["trajectory_id"]: line for line in lines}


async def test_each_trajectory_is_one_line_of_harbors_shapes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = await _log(tmp_path)
    summary, lines = _export(log, tmp_path / "out", capsys)
    assert sorted(lines) == ["a", "b"]  # c: excluded by curation
    assert summary["files"] == [FILE_NAME] and summary["trajectories"] == 2
    assert summary["excluded_trajectories"] == 1 and summary["excluded_steps"] == 1
    assert summary["failed_steps"] == 2 and summary["rows"] == 7 + 6  # a: 7 turns, b: 6 (5 left out)
    a = lines["a"]
    assert (a["group_id"], a["group_size"], a["mode"], a["status"]) == ("g", 2, "train", "finished")
    agent = a["agent_result"]
    # the main line's branches first (0, then 1), then one segment per side call and per other choice
    details = agent["rollout_details"]
    assert [d["extra"]["step_index"] for d in details] == [[0, 1], [4, 5, 6], [2], [6]]
    assert [d["extra"]["choice"] for d in details] == [[0, 0], [0, 0, 0], [0], [1]]
    main = details[0]
    assert main["prompt_token_ids"] == [[1, 2, 0], [1, 2, 10]]
    assert main["completion_token_ids"] == [[100, 200], [101, 201]]
    assert main["logprobs"][0] == [-0.5, -0.0] and math.isnan(main["logprobs"][1][1])
    assert main["extra"]["version_spans"] == [[], [[3, 0], [4, 1]]]
    assert main["extra"]["rewards"] == [{"tool": 0.5}, {}]
    assert main["extra"]["policy_version"] == [3, 3] and main["extra"]["finish_reason"] == ["stop", "stop"]
    assert "images" not in main["extra"] and details[1]["extra"]["images"] == [["ab" * 32], [], []]
    assert details[1]["extra"]["call_class"] == ["branch", "main", "main"]
    assert details[2]["extra"]["call_class"] == ["side"] and details[3]["completion_token_ids"] == [[7]]
    assert agent["n_input_tokens"] == 7 * 3 and agent["n_output_tokens"] == 7 * 2
    assert agent["model_usage"] == {
        "tiny": {"n_input_tokens": 18, "n_cache_tokens": 0, "n_output_tokens": 12, "cost_usd": None},
        "small": {"n_input_tokens": 3, "n_cache_tokens": 0, "n_output_tokens": 2, "cost_usd": None}}
    steptap = agent["metadata"]["steptap"]
    assert steptap["metadata"] == {"task": "fix-median"} and steptap["failed_steps"] == 1
    assert a["verifier_result"] == {"rewards": {"reward": 1.0}} and steptap["curation"] is None
    # curation applied as the learner applies it: the edited reward, the excluded step left out
    b = lines["b"]
    assert b["verifier_result"] == {"rewards": {"reward": 0.25}}
    assert b["agent_result"]["metadata"]["steptap"]["rewards"] == {"reward": 1.0}  # as recorded
    assert b["agent_result"]["metadata"]["steptap"]["curation"]["reasons"] == ["loop"]
    assert [d["extra"]["step_index"] for d in b["agent_result"]["rollout_details"]] == [[0, 1], [4, 6], [2],
                                                                                        [6]]
    # Harbor's own models read every line, drop and coerce nothing
    assert harbor_check("rollout", tmp_path / "out" / FILE_NAME) == {"lines": 2, "turns": 13}


async def test_kept_exclusions_and_the_overwrite_guard(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    log = await _log(tmp_path)
    out = tmp_path / "out"
    _export(log, out, capsys)
    with pytest.raises(SystemExit) as refused:
        export.main(["--log", str(log), "--out", str(out), "--format", "rollout-detail"])
    assert refused.value.code == 2 and "--overwrite" in capsys.readouterr().err
    summary, lines = _export(log, out, capsys, "--overwrite", "--keep-excluded")
    assert sorted(lines) == ["a", "b", "c"] and summary["kept_excluded"]
    b_steps = [d["extra"]["step_index"] for d in lines["b"]["agent_result"]["rollout_details"]]
    assert b_steps == [[0, 1], [4, 5, 6], [2], [6]]
    assert oct((out / FILE_NAME).stat().st_mode & 0o777) == "0o600"
    assert not list(out.glob(".*tmp*"))  # the temporary file was renamed into place
