"""Curation marks: folded in log order (middleware/curation.py), honoured by rows.build_batch (dropped and
counted, rewards edited), said by the learner's note; the console's login codes (one use, expiring)."""

from __future__ import annotations

import time

import msgspec
import pytest

from steptap.learner.curation import note
from steptap.learner.rows import build_batch
from steptap.middleware.console.access import Access
from steptap.middleware.curation import CurationBody, fold
from steptap.middleware.records import Curation, LogRecord, Sampling, Step, Trajectory, log_decoder


def _traj(tid: str, n: int = 2, reward: float = 1.0) -> Trajectory:
    steps = [Step(trajectory_id=tid, index=i, prompt_token_ids=[1, 2, i], response_token_ids=[10 + i, 11],
                  response_logprobs=[-0.5, -0.6], sampling=Sampling()) for i in range(n)]
    return Trajectory(id=tid, group_id="g", steps=steps, rewards={"reward": reward}, status="finished")


def _mark(action: str, step: int | None = None, **kw) -> Curation:
    return Curation(trajectory_id="a", action=action, step=step, **kw)  # type: ignore[arg-type]


def test_latest_exclude_or_include_wins_and_tags_accumulate() -> None:
    s = fold([_mark("exclude", reason="off topic"), _mark("tag", tags=["x"]), _mark("include"),
              _mark("exclude", 1, reason="loop"), _mark("tag", tags=["x", "y"])])
    assert not s.excluded and s.excluded_steps == [1] and s.tags == ["x", "y"] and s.reasons == ["loop"]
    assert fold([_mark("include"), _mark("exclude", reason="bad")]).excluded


def test_a_mark_is_a_log_record() -> None:
    mark = _mark("reward", 0, value=0.25, name="judge", by="console")
    back = log_decoder.decode(msgspec.msgpack.encode(mark))
    assert isinstance(back, Curation) and back == mark
    assert Curation in LogRecord.__args__  # type: ignore[attr-defined]


def test_build_batch_drops_excluded_trajectories_and_steps_and_counts_them() -> None:
    marks = {"a": fold([_mark("exclude", reason="bad")]),
             "b": fold([Curation(trajectory_id="b", action="exclude", step=1)])}
    batch = build_batch([_traj("a"), _traj("b"), _traj("c")], version=0, curation=marks)
    assert batch.counts["dropped_curated"] == 1 and batch.counts["dropped_curated_step"] == 1
    assert {(s.trajectory_id, s.step_index) for s in batch.samples} == {("b", 0), ("c", 0), ("c", 1)}
    assert batch.trajectory_ids == ["a", "b", "c"]  # consumed all the same (acknowledged, never re-delivered)
    plain = build_batch([_traj("a"), _traj("b"), _traj("c")], version=0)
    assert len(plain.samples) == 6 and "dropped_curated" not in plain.counts


def test_reward_edits_replace_the_recorded_reward_of_the_trajectory_and_of_a_step() -> None:
    marks = {"a": fold([_mark("reward", value=-1.0), _mark("reward", 0, value=0.5, name="judge")])}
    batch = build_batch([_traj("a", reward=1.0)], version=0, curation=marks)
    assert batch.rewards == [-1.0] and batch.counts["curated_reward_edits"] == 1
    assert [s.ret for s in batch.samples] == [-0.5, -1.0]  # step 0: its 0.5 + the final -1.0 (gamma 1)


def test_the_learner_says_what_curation_dropped_and_why() -> None:
    trajs = [_traj("a"), _traj("b"), _traj("c")]
    marks = {"a": fold([_mark("exclude", reason="leaks a secret")]),
             "b": fold([Curation(trajectory_id="b", action="exclude", step=0)]), "c": fold([])}
    assert note(trajs, marks) == "curation dropped a (excluded: leaks a secret), b steps [0]"
    assert note(trajs, {"c": fold([])}) is None


@pytest.mark.parametrize("body, why", [
    ({"action": "reward"}, "finite 'value'"),
    ({"action": "exclude", "value": 1.0}, "'value' belongs"),
    ({"action": "tag"}, "needs 'tags'"),
])
def test_bad_marks_are_refused_before_anything_is_written(body: dict, why: str) -> None:
    parsed = msgspec.json.decode(msgspec.json.encode(body), type=CurationBody)
    assert why in (parsed.check() or "")


def test_a_login_code_works_once_and_expires() -> None:
    access = Access()
    code = access.mint_code("viewer")
    assert access.redeem(code) == "viewer"
    assert access.redeem(code) is None  # spent
    old = access.mint_code("control", ttl_s=-1.0)
    assert access.redeem(old) is None  # expired
    cookie = access.open_session("control")
    assert access.session_role(cookie) == "control" and access.session_role("forged") is None
    access.tables["control"][cookie] = ("control", time.time() - 1)
    assert access.session_role(cookie) is None
