"""Task runs through a real proxy (in process, no vLLM: these agents are shell commands that make no model
call, or one through the bridge): groups rewarded by their verifiers only, the bridge's one route, every
infrastructure failure recorded as such (never a reward, never trained, counted by cause in the proxy and the
learner), and a rerun that runs only the episodes without a verdict, in the groups they belong to."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import missing

from steptap.adapters.tasks.episode import Settings
from steptap.adapters.tasks.format import load
from steptap.adapters.tasks.runner import Plan, RunDirError, TaskRunner, open_run
from steptap.adapters.tasks.sandbox import LocalSandbox
from steptap.middleware.client import SteptapClient

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tasks"
NO_BACKEND = "http://127.0.0.1:9"  # nothing listens: the proxy opens and finishes sessions without vLLM
# Episodes 0 and 1 solve the answer task; the others plant rewards wherever they can: that changes nothing
SOLVE_TWO = ('if [ "$STEPTAP_EPISODE" -lt 2 ]; then echo 42 > answer.txt; else echo 1 > reward.txt; '
             "echo '{\"reward\": 1}' > reward.json; mkdir -p /logs/verifier 2>/dev/null; "
             "echo 1 > /logs/verifier/reward.txt 2>/dev/null; fi; true")


@pytest.fixture
def sandbox() -> LocalSandbox:
    sb = LocalSandbox()
    if sb.problem():
        missing(sb.problem() or "")
    return sb


async def _stream(client: SteptapClient, count: int) -> list[Any]:
    out = []
    async for d in client.trajectories("tasks-test", follow=True):
        out.append(d.trajectory)
        if len(out) == count:
            break
    return out


async def _run(proxy: Any, sb: LocalSandbox, tasks: list[Any], run_dir: Path, command: list[str],
               n: int = 4, **options: Any) -> TaskRunner:
    settings = Settings(proxy_url=proxy.url, sandbox=sb, run_dir=run_dir, n=n, command=command,
                        run_id="run-1", **options)
    async with SteptapClient(proxy.url, proxy.token) as client:
        runner = TaskRunner(tasks, settings, client, concurrency=4)
        await runner.run()
    return runner


async def test_a_group_is_rewarded_by_its_verifier_only(make_proxy: Any, sandbox: LocalSandbox,
                                                        tmp_path: Path) -> None:
    proxy = await make_proxy(NO_BACKEND)
    task = load(FIXTURES).select(["answer"])[0]
    runner = await _run(proxy, sandbox, [task], tmp_path / "run", ["sh", "-c", SOLVE_TWO])
    by_index = {r["index"]: r for r in runner.results}
    assert [by_index[k]["reward"] for k in range(4)] == [1.0, 1.0, 0.0, 0.0]
    assert {r["status"] for r in runner.results} == {"finished"}
    async with SteptapClient(proxy.url, proxy.token) as client:
        trajs = sorted(await _stream(client, 4), key=lambda t: t.metadata["episode"])
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 0.0]
    assert {t.group_id for t in trajs} == {runner.group_id(task, 0)} and {t.group_size for t in trajs} == {4}
    for k, t in enumerate(trajs):
        assert t.metadata == {"task": {"dataset": "tasks", "name": "answer", "hash": task.id.hash},
                              "episode": k, "round": 0, "attempt": 0, "run": "run-1"}
        assert t.status == "finished" and t.infra_cause is None and t.task_run is not None
        agent, verifier = t.task_run.agent, t.task_run.verifier
        assert agent is not None and verifier is not None
        assert (agent.exit_code, agent.timed_out) == (0, False)
        assert (verifier.exit_code, verifier.timed_out) == (0, False)
        # timed from when the sandbox said it started (read in a thread), not from when the event loop got
        # to it: a verifier of a few milliseconds read 0.0 on a loaded machine when timed from the loop
        assert isinstance(verifier.seconds, float) and verifier.seconds > 0, verifier
    # each episode's folders: its logs kept, its working folder and home removed (no --keep)
    ep = tmp_path / "run" / "episodes" / "answer" / "r0-e2-a0"
    assert (ep / "verifier" / "reward.txt").read_text().strip() == "0"
    assert not (ep / "app").exists() and not (ep / "home").exists()


async def test_the_bridge_passes_the_session_url_only(make_proxy: Any, sandbox: LocalSandbox,
                                                      tmp_path: Path) -> None:
    proxy = await make_proxy(NO_BACKEND)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, urllib.request, urllib.error\n"
        "base = 'http://127.0.0.1:8400'\n"
        "sid = os.environ['STEPTAP_SESSION_ID']\n"
        "for path in (f'/s/{sid}/v1/models', '/health', '/metrics', '/sessions/' + sid,\n"
        "             '/s/other/v1/models', f'/s/{sid}x/v1/models', '/console/'):\n"
        "    try:\n"
        "        code = urllib.request.urlopen(base + path, timeout=30).status\n"
        "    except urllib.error.HTTPError as e:\n"
        "        code = e.code\n"
        "    print(path.replace(sid, 'SID'), code, flush=True)\n")
    app = tmp_path / "task" / "answer"  # the answer task, with the probe in its working folder
    shutil.copytree(FIXTURES / "answer", app)
    shutil.copy(probe, app / "environment" / "app" / "probe.py")
    task = load(app).tasks[0]
    runner = await _run(proxy, sandbox, [task], tmp_path / "run", ["python3", "/app/probe.py"], n=1)
    (line,) = runner.results
    printed = line["agent"]["output"]
    assert all(len(ln.split()) == 2 for ln in printed.splitlines()), printed
    out = dict(ln.rsplit(" ", 1) for ln in printed.splitlines())
    assert out.pop("/s/SID/v1/models") != "403"  # passed to the proxy (which answers for itself)
    assert out == {"/health": "403", "/metrics": "403", "/sessions/SID": "403", "/s/other/v1/models": "403",
                   "/s/SIDx/v1/models": "403", "/console/": "403"}
    assert line["calls"] == 0 and line["status"] == "finished"  # GETs are no model calls


def _rows(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def test_infrastructure_failures_are_never_rewards(make_proxy: Any, sandbox: LocalSandbox,
                                                         tmp_path: Path) -> None:
    from steptap.learner.config import LearnerConfig
    from steptap.learner.daemon import Grouper
    from steptap.learner.rows import build_batch

    proxy = await make_proxy(NO_BACKEND)
    ds = load(_rows(tmp_path, [
        {"name": "crash", "instruction": "go", "verifier": "echo oops; exit 3"},
        {"name": "bad-reward", "instruction": "go", "verifier": "echo nan > /logs/verifier/reward.txt"},
        {"name": "slow", "instruction": "go", "verifier": "sleep 60", "verifier_timeout_s": 1},
        {"name": "dies", "instruction": "die", "verifier": "echo 1 > /logs/verifier/reward.txt"},
    ]))
    # the agent: exits 1 on the "die" instruction (before any model call), else does nothing
    command = ["sh", "-c", 'case "$0" in die) echo dying; exit 1;; esac; true']
    runner = await _run(proxy, sandbox, ds.tasks, tmp_path / "run", command, n=1)
    lines = runner.results
    assert all(r["status"] == "infra_error" and r["reward"] is None for r in lines), lines
    causes = {(r["task"], r["attempt"]): r["infra_cause"] for r in lines}
    assert causes == {("crash", 0): "verifier_crash", ("crash", 1): "verifier_crash",
                      ("bad-reward", 0): "verifier_crash", ("bad-reward", 1): "verifier_crash",
                      ("slow", 0): "verifier_timeout", ("slow", 1): "verifier_timeout",
                      ("dies", 0): "agent_start", ("dies", 1): "agent_start"}  # each retried once
    reasons = {r["task"]: r["error"] for r in lines}
    assert "exited 3 without a reward in /logs/verifier: oops" in reasons["crash"]
    assert "a reward must be a finite number" in reasons["bad-reward"]
    assert reasons["slow"] == "the verifier ran past its timeout of 1 s"
    assert reasons["dies"] == "the agent exited 1 before its first model call: dying"
    async with SteptapClient(proxy.url, proxy.token) as client:
        trajs = await _stream(client, 8)
    assert {t.status for t in trajs} == {"infra_error"} and all(t.rewards == {} for t in trajs)
    assert sorted(t.infra_cause for t in trajs) == sorted(causes.values())
    # the learner: no group member, never trained, counted by cause
    grouper = Grouper(LearnerConfig())
    assert [grouper.add(t) for t in trajs] == [False] * 8 and not grouper.open
    batch = build_batch(trajs, version=0, train_aborted=True)
    assert batch.samples == [] and batch.counts["dropped_infra_error"] == 8
    assert (batch.counts["infra_error_verifier_crash"], batch.counts["infra_error_verifier_timeout"],
            batch.counts["infra_error_agent_start"]) == (4, 2, 2)


async def test_a_sandbox_that_does_not_start_is_an_infrastructure_error(make_proxy: Any, http: Any,
                                                                       tmp_path: Path) -> None:
    proxy = await make_proxy(NO_BACKEND)
    sb = LocalSandbox()
    sb.bwrap = str(tmp_path / "no-bwrap")  # an injected fault: bubblewrap gone between the check and the run
    task = load(FIXTURES).select(["answer"])[0]
    runner = await _run(proxy, sb, [task], tmp_path / "run", ["true"], n=1)
    assert [(r["status"], r["infra_cause"]) for r in runner.results] == [("infra_error", "sandbox")] * 2
    assert "the agent's sandbox did not start: cannot start bubblewrap" in runner.results[0]["error"]
    async with http.get(f"{proxy.url}/metrics") as resp:
        text = await resp.text()
    assert 'steptap_infra_errors_total{cause="sandbox"} 2.0' in text
    assert 'steptap_trajectories_total{status="infra_error"} 2.0' in text


async def test_a_rerun_runs_only_the_episodes_without_a_verdict(make_proxy: Any, sandbox: LocalSandbox,
                                                               tmp_path: Path) -> None:
    proxy = await make_proxy(NO_BACKEND)
    task = load(FIXTURES).select(["answer"])[0]
    run_dir = tmp_path / "run"
    first = await _run(proxy, sandbox, [task], run_dir, ["sh", "-c", SOLVE_TWO])
    assert len(first.results) == 4
    again = await _run(proxy, sandbox, [task], run_dir, ["sh", "-c", SOLVE_TWO])
    assert again.todo() == [] and again.results == []  # all four have their verdict
    # a crash before episode 3's line was durable (its line cut short), and episode 1's lost
    state = run_dir / "state.jsonl"
    lines = state.read_text().splitlines()
    kept = [ln for ln in lines if json.loads(ln)["index"] not in (1, 3)]
    cut = next(ln for ln in lines if json.loads(ln)["index"] == 3)[:40]
    state.write_text("\n".join([*kept, cut]) + "\n")
    resumed = await _run(proxy, sandbox, [task], run_dir, ["sh", "-c", SOLVE_TWO])
    assert sorted(r["index"] for r in resumed.results) == [1, 3]
    assert {r["group_id"] for r in resumed.results} == {first.results[0]["group_id"]}
    assert {r["index"]: r["reward"] for r in resumed.results} == {1: 1.0, 3: 0.0}


def test_a_run_folder_resumes_only_the_same_run(tmp_path: Path) -> None:
    def plan(run_id: str, n: int = 4, judge: str | None = None) -> Plan:
        return Plan(run_id, "suite", n, 1, "train", "pi", 0.0, judge)

    assert open_run(tmp_path, plan("tasks-a"), fresh=False) == plan("tasks-a")
    assert open_run(tmp_path, plan("tasks-b"), fresh=False).run_id == "tasks-a"  # resumed: its own id
    with pytest.raises(RunDirError, match="holds a run with n 4, not 8: resume it as it was, or pass"):
        open_run(tmp_path, plan("tasks-c", 8), fresh=False)
    with pytest.raises(RunDirError, match="holds a run with judge None, not 'abc'"):  # judged alike, or not
        open_run(tmp_path, plan("tasks-c", judge="abc"), fresh=False)
    assert open_run(tmp_path, plan("tasks-c", 8), fresh=True).run_id == "tasks-c"


async def test_a_judge_that_cannot_score_is_an_infrastructure_error_never_a_zero(
        make_proxy: Any, sandbox: LocalSandbox, http: Any, tmp_path: Path) -> None:
    """--reward-judge in a task run: a row with a verifier and one without (the judge alone scores it). The
    agent makes no model call, so the judge has nothing to score: each episode (and its retry) ends
    infra_error, cause reward_unavailable, with the judge's error, and none of the verifier's rewards."""
    from steptap.adapters.judge import Judge, JudgeConfig

    proxy = await make_proxy(NO_BACKEND)
    ds = load(_rows(tmp_path, [
        {"name": "verified", "instruction": "go",
         "verifier": "echo '{\"reward\": 1, \"style\": 0.5}' > /logs/verifier/reward.json"},
        {"name": "judged", "instruction": "go"},
    ]))
    judge = Judge(JudgeConfig(rubric="Score the answer."))
    runner = await _run(proxy, sandbox, ds.tasks, tmp_path / "run", ["true"], n=1, judge=judge)
    lines = runner.results
    assert sorted((r["task"], r["attempt"], r["status"], r["infra_cause"]) for r in lines) == [
        (task, attempt, "infra_error", "reward_unavailable") for task in ("judged", "verified")
        for attempt in (0, 1)]
    for r in lines:
        assert r["reward"] is None and r["judge"] is None
        assert r["error"] == f"judge: session {r['session_id']} has no step to judge"
    # the verifier ran (its verdict is in the episode's folder), but its rewards were never posted
    assert json.loads((tmp_path / "run" / "episodes" / "verified" / "r0-e0-a0" / "verifier" /
                       "reward.json").read_text()) == {"reward": 1, "style": 0.5}
    assert not (tmp_path / "run" / "episodes" / "judged" / "r0-e0-a0" / "verifier").exists()
    async with SteptapClient(proxy.url, proxy.token) as client:
        trajs = await _stream(client, 4)
    assert {t.status for t in trajs} == {"infra_error"} and all(t.rewards == {} for t in trajs)
    async with http.get(f"{proxy.url}/metrics") as resp:
        assert 'steptap_infra_errors_total{cause="reward_unavailable"} 4.0' in await resp.text()


def test_a_task_with_no_verifier_needs_a_judge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from steptap.adapters.tasks import cli
    from steptap.adapters.tasks.runner import unscored

    rows = _rows(tmp_path, [{"name": "open-ended", "instruction": "write a poem"}])
    ds = load(rows)
    settings = Settings(proxy_url=NO_BACKEND, sandbox=LocalSandbox(), run_dir=tmp_path / "run")
    with pytest.raises(ValueError, match=r"1 task\(s\) have no verifier \(open-ended\): give --reward-judge"):
        TaskRunner(ds.tasks, settings, client=None)
    assert unscored(ds.tasks, judge=object()) is None
    base = ["run", str(rows), "--proxy", NO_BACKEND, "--control-token", "t", "--run-dir", str(tmp_path / "r")]
    assert cli.main([*base, "--", "true"]) == 2  # before any proxy call
    assert "have no verifier (open-ended): give --reward-judge RUBRIC" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:  # the judge's flags as steptap run reads them
        cli.main([*base, "--reward-judge", str(tmp_path / "missing.md"), "--", "true"])
    assert bad.value.code == 2 and "--reward-judge: " in capsys.readouterr().err
    from steptap.adapters.tasks.check import check_task

    checked = asyncio.run(check_task(LocalSandbox(), ds.tasks[0], tmp_path / "check", 1.0))
    assert checked.problem is not None and checked.problem.startswith("no verifier: a judge scores it")


async def test_ctrl_c_records_the_episodes_interrupted_and_a_rerun_runs_them(make_proxy: Any,
                                                                            sandbox: LocalSandbox,
                                                                            tmp_path: Path) -> None:
    """`steptap tasks run` stopped mid-episode (SIGINT): the agents are killed, their sessions end as
    infrastructure errors (interrupted: never trained), recorded; the same command again runs just them."""
    import asyncio
    import os
    import signal
    import sys

    proxy = await make_proxy(NO_BACKEND)
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "steptap.middleware.cli", "tasks", "run", str(FIXTURES / "answer"),
            "-n", "2", "--proxy", proxy.url, "--run-dir", str(run_dir), "--json", "--"]
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": proxy.token}
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(*args, "sh", "-c", "echo busy; sleep 600", env=env,
                                                stdout=pipe, stderr=pipe)

    def running() -> bool:  # both agents are running: each printed into its episode's log
        logs = list((run_dir / "episodes" / "answer").glob("*/agent.log"))
        return len(logs) == 2 and all(p.read_text() for p in logs)

    async with SteptapClient(proxy.url, proxy.token) as client:
        while not running() and proc.returncode is None:
            await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = await proc.communicate()
        assert proc.returncode == 130, err.decode()[-2000:]
        summary = json.loads(out.decode().strip().splitlines()[-1])
        assert summary["interrupted"] and summary["infra_errors"] == {"interrupted": 2}
        lines = [json.loads(ln) for ln in (run_dir / "state.jsonl").read_text().splitlines()]
        assert sorted((r["index"], r["attempt"], r["status"], r["infra_cause"]) for r in lines) == [
            (0, 0, "infra_error", "interrupted"), (1, 0, "infra_error", "interrupted")]
        for r in lines:
            traj = await client.get_session(r["session_id"])
            assert traj.status == "infra_error" and traj.error == "the run was interrupted"
        again = await asyncio.create_subprocess_exec(*args, "sh", "-c", "echo 42 > answer.txt", env=env,
                                                     stdout=pipe, stderr=pipe)
        out, err = await again.communicate()
    assert again.returncode == 0, err.decode()[-2000:]
    lines = [json.loads(ln) for ln in (run_dir / "state.jsonl").read_text().splitlines()]
    assert sorted((r["index"], r["attempt"], r["status"], r["reward"]) for r in lines[2:]) == [
        (0, 1, "finished", 1.0), (1, 1, "finished", 1.0)]
    assert json.loads(out.decode().strip().splitlines()[-1])["tasks"][0]["passed"] == 2
