"""The run's health (middleware/health.py, learner/health.py, adapters/doctor.py) over recorded rows: each
batch's figures from real ``build_batch`` batches, each silent-failure cause named by the rules (and stopped
at the window, or at once for a logprob gap), the learner's check warning once and stopping, the proxy's
figures from its ``/metrics`` and from its log, and ``steptap doctor`` over a run's files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from steptap.adapters import doctor
from steptap.learner.engines.base import StepStats
from steptap.learner.health import HealthCheck, HealthStop, figures
from steptap.learner.rows import build_batch
from steptap.middleware import health as h
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import Metrics, parse_text
from steptap.middleware.records import Held, Sampling, SessionOpened, Step, Trajectory

T = h.Thresholds(window=3)


def _traj(tid: str, group: str, reward: float | None, *, temperature: float = 1.0, cut: bool = False,
          mode: str = "train", n_steps: int = 1) -> Trajectory:
    steps = [Step(trajectory_id=tid, index=i, prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5, 6, 7],
                  response_logprobs=[-1.0] * 4, finish_reason="length" if cut else "stop",
                  sampling=Sampling(temperature=temperature, max_tokens=4)) for i in range(n_steps)]
    return Trajectory(id=tid, group_id=group, group_size=2, status="finished", mode=mode, steps=steps,
                      rewards={} if reward is None else {"reward": reward})


def _row(batch, stats=None, update: int | None = 1, version: int = 0) -> dict:
    row = {"policy_version": version, "health": figures(batch, stats, "grpo")}
    if update is not None:
        row["update"] = update
    return row


def test_figures_count_variance_tokens_by_cause_cut_replies_and_rewardless_episodes() -> None:
    batch = build_batch([
        _traj("a", "g1", 0.0, cut=True), _traj("b", "g1", 0.0, cut=True),  # equal rewards, both cut
        _traj("c", "g2", None), _traj("d", "g2", 1.0),  # varied (no reward counts as 0)
        _traj("e", "g3", 1.0, temperature=0.0), _traj("f", "g3", 1.0, temperature=0.0),  # greedy: dropped
        _traj("x", "gx", 1.0, mode="judge"), _traj("y", "gy", 1.0, mode="eval"),  # never trained, not counted
    ], version=0, dropped=[(_traj("z", "gz", 1.0), "skipped_anonymous")])
    f = figures(batch, StepStats(0, 0, 0, 0, 0, 0, 16, 28, 1.0, logprob_gap=0.25, gap_tokens=16), "grpo")
    assert (f["groups"], f["groups_varied"], f["scope"]) == (2, 1, "group")
    assert f["tokens"] == {"generated": 28, "trained": 16, "dropped_greedy": 8, "skipped_anonymous": 4}
    assert (f["replies"], f["replies_cut"], f["cut_max_tokens"]) == (7, 2, 4)
    assert (f["unrewarded"], f["trajectories"], f["reward_min"], f["reward_max"]) == (1, 4, 0.0, 1.0)
    assert (f["logprob_gap"], f["gap_tokens"], f["version_lag_mean"]) == (0.25, 16, 0.0)
    assert batch.counts["dropped_judge"] == 1 and batch.counts["dropped_eval"] == 1
    assert {s.trajectory_id for s in batch.samples} == {"a", "b", "c", "d"}  # nor the anonymous one
    # a batch-level estimator compares samples across the batch: one "group"
    assert figures(batch, None, "reinforce_plus_plus")["groups"] == 1


def _equal(update: int) -> dict:
    pair = [_traj(f"a{update}", "g", 0.0, cut=True), _traj(f"b{update}", "g", 0.0, cut=True)]
    return _row(build_batch(pair, version=0), update=update)


def test_equal_rewards_warn_after_the_first_update_and_stop_at_the_window() -> None:
    rows = [_equal(1)]
    (first, cut) = h.learner_findings(rows, T)
    assert (first.cause, first.level) == ("no_variance", "warn") and cut.cause == "cut"
    assert "0 of the last 1 updates had a group with reward variance: every episode got 0" in first.text
    assert "100% of the replies were cut at max_tokens=4" in first.text
    rows += [_equal(2), _equal(3)]
    stop = h.learner_findings(rows, T)[0]
    assert (stop.cause, stop.level) == ("no_variance", "stop")
    assert stop.text.startswith("0 of the last 3 updates")
    # no reward at all reached them: said so
    silent = [_row(build_batch([_traj(f"s{i}", "g", None), _traj(f"t{i}", "g", None)], version=0), update=i)
              for i in range(3)]
    assert "no reward reached any of them (your reward command printed nothing" in \
        h.learner_findings(silent, T)[0].text
    # a group with variance clears it
    varied = _row(build_batch([_traj("u", "g", 0.0), _traj("v", "g", 1.0)], version=0), update=4)
    assert h.learner_findings([*rows, varied], T) == []


def _all(update: int, reward: float) -> dict:
    pair = [_traj(f"a{update}", "g", reward, cut=True), _traj(f"b{update}", "g", reward, cut=True)]
    return _row(build_batch(pair, version=0), update=update)


def test_a_batch_at_the_runs_best_reward_after_variance_is_solved_not_a_fault() -> None:
    varied = _row(build_batch([_traj("u", "g", 0.0), _traj("v", "g", 1.0)], version=0), update=1)
    # the demo's last update: every episode got 1 after batches that varied; nothing to say
    assert h.learner_findings([varied, _all(2, 1.0)], T) == []
    # at the top for the whole window: said once, as solved, never a stop
    (solved,) = h.learner_findings([varied, *[_all(u, 1.0) for u in (2, 3, 4)]], T)
    assert (solved.cause, solved.level) == ("solved", "warn") and "every episode got 1" in solved.text
    # all at 0 after variance is a fault still, and so is a top that was never left (no variance ever)
    assert h.learner_findings([varied, _all(2, 0.0)], T)[0].cause == "no_variance"
    assert h.learner_findings([_all(1, 1.0)], T)[0].cause == "no_variance"


def test_nothing_in_the_loss_is_named_by_cause_and_stops_at_the_window() -> None:
    greedy = [_row(build_batch([_traj(f"a{i}", "g", 1.0, temperature=0.0)], version=0), update=None)
              for i in range(3)]
    (warn,) = h.learner_findings(greedy[:1], T)
    assert (warn.cause, warn.level) == ("nothing_trained", "warn")
    assert "0 of 4 generated tokens reached the loss" in warn.text and "4 dropped_greedy" in warn.text
    assert "temperature 0" in warn.text
    (stop,) = h.learner_findings(greedy, T)
    assert (stop.cause, stop.level) == ("nothing_trained", "stop")
    # some trained, most not: a warning only
    mixed = _row(build_batch([_traj("m", "g", 1.0), *[_traj(f"q{i}", "g", 1.0, temperature=0.0)
                                                       for i in range(3)]], version=0))
    (few,) = [f for f in h.learner_findings([mixed], T) if f.cause != "no_variance"]
    assert (few.cause, few.level) == ("few_trained", "warn") and "4 of 16 generated tokens" in few.text


def test_a_logprob_gap_stops_at_the_first_batch_and_warns_later() -> None:
    batch = build_batch([_traj("a", "g", 0.0), _traj("b", "g", 1.0)], version=0)

    def row(gap: float) -> dict:
        return _row(batch, StepStats(0, 0, 0, 0, 0, 0, 8, 12, 1.0, logprob_gap=gap, gap_tokens=8))

    (stop,) = h.learner_findings([row(2.3)], T)
    assert (stop.cause, stop.level) == ("logprob_gap", "stop")
    assert stop.text.startswith("the learner's logprobs differ from vLLM's by 2.3 nats on average over 8 "
                                "tokens")
    assert h.learner_findings([row(0.001)], T) == []
    (later,) = h.learner_findings([row(0.001), row(0.9)], T)
    assert (later.cause, later.level) == ("logprob_gap", "warn")


def test_versions_that_never_reach_the_agents_are_named() -> None:
    batch = build_batch([_traj("a", "g", 0.0), _traj("b", "g", 1.0)], version=0)
    rows = [_row(batch, update=i, version=i) for i in range(1, 6)]  # published 1..5, trained tokens all v0
    (stuck,) = h.learner_findings(rows, T)
    assert stuck.cause == "versions_stuck" and "newest trained token is still version 0" in stuck.text


def test_proxy_figures_name_unfinished_sessions_pending_rewards_and_aborts() -> None:
    quiet = h.ProxyFigures(opened=3, open=3, idle_s=400.0)
    assert [f.cause for f in h.proxy_findings(quiet)] == ["sessions_unfinished"]
    assert h.proxy_findings(quiet._replace(idle_s=10.0)) == []
    pending = h.proxy_findings(h.ProxyFigures(held=2, held_s=900.0))
    assert [f.cause for f in pending] == ["rewards_pending"] and "2 finished sessions wait" in pending[0].text
    aborted = h.proxy_findings(h.ProxyFigures(finished=1, aborted=5, error="judge: no score"))
    assert [f.cause for f in aborted] == ["aborted"] and "judge: no score" in aborted[0].text


def test_proxy_figures_from_metrics_text() -> None:
    m = Metrics()
    m.sessions_opened["false"] += 4  # tallies (metrics.Tally), read back through the exposition text
    m.sessions_opened["true"] += 9
    m.trajectories["finished"] += 2
    m.trajectories["aborted"] += 1
    m.sessions_open.set(2)
    m.held.set(1)
    m.replies_cut[()] += 3
    m.steps["ok", "false"] += 5
    p = h.proxy_figures(parse_text(m.render().decode()))
    assert (p.opened, p.finished, p.aborted, p.open, p.held, p.replies, p.cut) == (4, 2, 1, 2, 1, 5, 3)
    # the console's own figures read the same tallies in the process (no scrape)
    from steptap.middleware.console.vitals import proxy_figures

    mine = proxy_figures(SimpleNamespace(sessions={}, recent={}, held={}), m)  # type: ignore[arg-type]
    assert (mine.opened, mine.finished, mine.aborted, mine.replies, mine.cut) == (4, 2, 1, 5, 3)


def test_the_check_warns_once_per_cause_and_stops_only_in_stop_mode() -> None:
    said: list[str] = []
    check = HealthCheck("stop", T, said.append)
    check.batch(_equal(1))
    check.batch(_equal(2))
    assert [s.split(": ", 1)[0] for s in said] == ["[yellow]health[/yellow] (no_variance)",
                                                  "[yellow]health[/yellow] (cut)"]  # once each
    with pytest.raises(HealthStop) as stop:
        check.batch(_equal(3))
    assert stop.value.finding.cause == "no_variance"
    warn_only = HealthCheck("warn", T, said.append)
    for i in range(1, 5):
        warn_only.batch(_equal(i))  # never raises
    check.proxies([h.ProxyFigures(held=1, held_s=1e6)])
    check.proxies([h.ProxyFigures(held=1, held_s=1e6)])
    assert sum("rewards_pending" in s for s in said) == 1
    off = HealthCheck("off", T, said.append)
    off.batch(_equal(1))


async def _write_log(path: Path) -> None:
    log = await TrajectoryLog.open(str(path))
    t0 = 1_000_000.0
    for sid in ("open", "held", "done", "bad"):
        await log.append(SessionOpened(trajectory_id=sid, at=t0))
    await log.append(Step(trajectory_id="open", started_at=t0 + 10, latency_s=1.0, finish_reason="length"))
    await log.append(Step(trajectory_id="done", started_at=t0 + 20, latency_s=1.0, finish_reason="stop"))
    await log.append(Trajectory(id="done", status="finished", finished_at=t0 + 30))
    await log.append(Trajectory(id="bad", status="aborted", error="judge: no score", finished_at=t0 + 40))
    await log.append(Held(trajectory=Trajectory(id="held", status="finished"), at=t0 + 50))
    await log.append(Trajectory(id="end", status="finished", anonymous=True, finished_at=t0 + 1000))
    await log.close()


async def test_doctor_reads_a_runs_log_and_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    run = tmp_path / "run"
    await _write_log(run / "trajectories")
    p = doctor.log_figures(str(run / "trajectories"))
    assert (p.opened, p.finished, p.aborted, p.open, p.held, p.replies, p.cut) == (4, 2, 1, 1, 1, 2, 1)
    assert (p.idle_s, p.held_s, p.error) == (1000 - 11, 1000 - 50, "judge: no score")
    rows = [_equal(i) for i in range(1, 4)]
    stop = {"time": 0, "health_stop": "0 of the last 3 updates had ...", "cause": "no_variance"}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, stop]) + "not json\n")
    assert doctor.main([str(run), "--window", "3"]) == doctor.STOP_EXIT
    out = capsys.readouterr().out
    assert "stop  no_variance: 0 of the last 3 updates" in out and "warn  cut:" in out
    assert "warn  sessions_unfinished:" in out and "warn  rewards_pending:" in out
    assert "the learner's health check stopped the run" in out
    assert doctor.main([str(run), "--json", "--stall-s", "5000"]) == doctor.STOP_EXIT
    d = json.loads(capsys.readouterr().out)
    assert {f["cause"] for f in d["findings"]} == {"no_variance", "cut"} and d["updates"] == 3
    (run / "metrics.jsonl").write_text(json.dumps(_row(build_batch(
        [_traj("u", "g", 0.0), _traj("v", "g", 1.0)], version=0))) + "\n")
    assert doctor.main(["--metrics", str(run / "metrics.jsonl")]) == 0
    assert "nothing to name" in capsys.readouterr().out
    with pytest.raises(SystemExit) as nothing:
        doctor.main([str(tmp_path / "nothing")])
    assert nothing.value.code == 2 and "nothing to read" in capsys.readouterr().err
