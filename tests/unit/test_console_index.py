"""The console's ``RunIndex`` over a real log (no vLLM): loaded at start (trajectories, marks, swaps), brought
up to date from the log when it is read (``current``), filtered, read back by where each trajectory starts;
the curves by version."""

from __future__ import annotations

import asyncio
from pathlib import Path

from steptap.middleware.console.index import RunIndex
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import (
    Curation,
    PolicyVersion,
    Sampling,
    Step,
    Trajectory,
    msgpack_encoder,
    newest_version,
    step_versions_decoder,
)


def _traj(tid: str, reward: float, version: int, *, mode: str = "train", group: str = "g",
          meta: dict | None = None) -> Trajectory:
    step = Step(trajectory_id=tid, index=0, policy_version=version, prompt_token_ids=[1, 2],
                response_token_ids=[7, 8, 9], response_logprobs=[-0.1, -1.0, -3.0], sampling=Sampling())
    return Trajectory(id=tid, group_id=group, mode=mode, status="finished", steps=[step],  # type: ignore[arg-type]
                      rewards={"reward": reward}, metadata=meta or {})


async def test_the_index_loads_follows_filters_and_reads_back(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    await log.append(_traj("a", 1.0, 0, meta={"task": "<b>sum</b>"}))
    await log.append(_traj("b", 0.0, 0, group="h"))
    await log.append(_traj("e", 1.0, 0, mode="eval"))
    await log.append(PolicyVersion(version=1))
    await log.append(Curation(trajectory_id="b", action="exclude", reason="loops"))
    await log.append(Curation(trajectory_id="a", action="tag", tags=["good"]))

    index = RunIndex(log)
    cursor = await asyncio.to_thread(index.load)
    assert list(index.summaries) == ["a", "b", "e"] and index.finished == 3
    assert index.curve("train") == [{"version": 0, "mean": 0.5, "n": 2}]
    assert index.curve("eval") == [{"version": 0, "mean": 1.0, "n": 1}]
    assert [s["version"] for s in index.swaps] == [1]
    assert index.state("b").excluded and index.state("a").tags == ["good"]

    def ids(**filters: object) -> list[str]:
        return [row["id"] for row in index.query(**filters)]  # type: ignore[arg-type]

    assert ids() == ["e", "b", "a"]  # newest first
    assert ids(mode="train", excluded=False) == ["a"]
    assert ids(group="h") == ["b"] and ids(tag="good") == ["a"] and ids(text="SUM") == ["a"]
    assert ids(min_reward=0.5, mode="train") == ["a"] and ids(max_reward=0.5) == ["b"]
    assert ids(limit=1) == ["e"]

    assert index.cursor == cursor == log.end_cursor
    try:
        await log.append(_traj("c", 0.25, 1))
        await log.append(Step(trajectory_id="open", index=0, sampling=Sampling()))  # not finished: not listed
        assert "c" not in index.summaries  # nothing runs per record: read on the next read of the console
        await index.current()
        assert index.cursor == log.end_cursor and list(index.summaries) == ["a", "b", "e", "c"]
        await index.current()  # nothing new: nothing read
        assert index.finished == 4
        assert index.summaries["c"].version == 1
        assert index.curve("train")[-1] == {"version": 1, "mean": 0.25, "n": 1}  # a point for the new version
        back = await index.trajectory("c")
        assert back is not None and back.steps[0].response_token_ids == [7, 8, 9]
        assert await index.trajectory("nobody") is None
    finally:
        await log.close()


async def test_a_session_of_delta_steps_is_summarized_as_logged(tmp_path: Path) -> None:
    from steptap.middleware.delta import compress
    from steptap.middleware.records import StepRef

    log = await TrajectoryLog.open(str(tmp_path / "log"))
    index = RunIndex(log)
    await asyncio.to_thread(index.load)
    try:
        first = Step(trajectory_id="d", index=0, policy_version=2, prompt_token_ids=list(range(100, 5000)),
                     response_token_ids=[7, 8], sampling=Sampling())
        nxt = Step(trajectory_id="d", index=1, policy_version=3, response_token_ids=[5], sampling=Sampling(),
                   prompt_token_ids=[*range(100, 5000), 7, 8, 9], prefix="extends")
        refs = [StepRef(at=(await log.append_at(s))[0]) for s in (first, compress(nxt, first))]
        await log.append(Trajectory(id="d", group_id="g", status="finished", step_refs=refs,
                                    rewards={"reward": 0.5}))
        await index.current()
        summary = index.summaries["d"]
        assert summary.steps == 2 and summary.version == 3 and summary.reward == 0.5
        back = await index.trajectory("d")  # the viewer reads it back in full
        assert back is not None and back.steps[1].prompt_token_ids == nxt.prompt_token_ids
    finally:
        await log.close()


def test_a_logged_steps_versions_are_read_without_its_prompt() -> None:
    """The console's index reads a finished session's steps for their newest version alone
    (``StepVersions``): the same answer as the whole step's, across a keep swap's spans."""
    for spans, want in (([], 3), ([[0, 3], [2, 4]], 4), ([[0, 3], [9, 5]], 3)):  # a span past the end: none
        step = Step(policy_version=3, prompt_token_ids=list(range(1000, 21000)), response_token_ids=[7, 8, 9],
                    version_spans=spans, request={"messages": [{"role": "user", "content": "x" * 1000}]})
        logged = msgpack_encoder.encode(step)
        view = step_versions_decoder.decode(logged)
        assert newest_version(view) == newest_version(step) == want
        assert view.response_token_ids == [7, 8, 9]
