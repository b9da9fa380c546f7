"""Episodes as Harbor trials (`steptap tasks --sandbox harbor`, adapters/tasks/containers.py): Harbor's own
trial, agent and verifier, in its own virtualenv (Python 3.12), the agent's endpoint being the episode's
session URL. This machine has a docker client and no daemon, so the container is Harbor's environment API
implemented by a fake over bubblewrap, named by import path (tests/harbor_fakes), and so is the agent (a small
tool-calling one, as Harbor's terminus is); everything else is Harbor's: the trial's phases, the tests
uploaded only after the agent phase, the reward files it reads, the exceptions it records.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import missing, pins_differ

from steptap.middleware.client import SyncSteptapClient

FAKES = Path(__file__).parent.parent / "harbor_fakes"
FIXTURES = Path(__file__).parent.parent / "fixtures" / "tasks"
FAKE_ENV = "steptap_fake_harbor:BwrapEnvironment"


@pytest.fixture(scope="module")
def harbor_env() -> dict[str, str]:
    """The environment `steptap tasks` finds Harbor with: $STEPTAP_HARBOR_PYTHON, else the virtualenv
    `steptap tasks install-harbor` builds (once per machine, from PyPI), and the fakes on Harbor's path."""
    from steptap.adapters.tasks.containers import HarborError, install

    python = os.environ.get("STEPTAP_HARBOR_PYTHON")
    if not python:
        try:
            python = str(install())
        except (HarborError, OSError, subprocess.CalledProcessError, RuntimeError) as exc:
            missing(f"Harbor's virtualenv cannot be built: {exc}")
    return {"STEPTAP_HARBOR_PYTHON": python, "STEPTAP_HARBOR_PYTHONPATH": str(FAKES)}


def steptap(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "steptap.middleware.cli", "tasks", *args],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=900, check=False)


def test_harbors_venv_holds_the_pinned_versions(harbor_env: dict[str, str]) -> None:
    """Harbor's virtualenv is built under HARBOR_CONSTRAINTS: what harbor==0.25.0 pulls in (litellm, openai,
    ...) at the pinned versions, whatever has been released since."""
    from steptap.adapters.tasks.containers import HARBOR_CONSTRAINTS

    assert "\nlitellm==" in HARBOR_CONSTRAINTS.read_text()
    python = Path(harbor_env["STEPTAP_HARBOR_PYTHON"])
    assert pins_differ(python, HARBOR_CONSTRAINTS) == {}, (
        f"{python.parent.parent} was built before these pins (remove it: the next run rebuilds it)")


def test_check_runs_harbor_oracle_and_noop_in_the_container(harbor_env: dict[str, str]) -> None:
    out = steptap(["check", str(FIXTURES / "answer"), "--sandbox", "harbor", "--harbor-env-import", FAKE_ENV],
                  harbor_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[1].split() == ["answer", "1.000", "0.000", "ok"]


def test_harbor_installed_agents_take_the_session_url(harbor_env: dict[str, str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of Harbor's own agents for the four CLIs, built by Harbor from the request an episode sends,
    resolves its model endpoint to the episode's session URL as the containers reach the proxy (no container
    is started: what a real docker run would hand the CLI), and leaves nothing in the temp folder."""
    import asyncio

    from steptap.adapters.tasks.containers import HARBOR_AGENTS, HarborSettings, preflight

    python = Path(harbor_env["STEPTAP_HARBOR_PYTHON"])
    h = HarborSettings(container_proxy="http://172.17.0.1:8400", python=python)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the drivers' temp folder

    async def resolve_all() -> list[str]:  # side by side: each is a Harbor process's start
        return list(await asyncio.gather(*(preflight(agent, h, "http://127.0.0.1:8400", "tiny",
                                                     tmp_path / f"{agent}.log") for agent in HARBOR_AGENTS)))

    resolved = dict(zip(HARBOR_AGENTS, asyncio.run(resolve_all()), strict=True))
    assert resolved == {"claude-code": "http://172.17.0.1:8400/s/preflight",
                        **{a: "http://172.17.0.1:8400/s/preflight/v1" for a in ("codex", "openclaw", "pi")}}
    assert list(scratch.iterdir()) == []  # each preflight's logs folder removed (one was left a call)


def _task(root: Path, name: str, instruction: str, test_sh: str) -> Path:
    task = root / name
    shutil.copytree(FIXTURES / "answer", task)
    (task / "instruction.md").write_text(instruction + "\n")
    (task / "tests" / "test.sh").write_text(test_sh)
    return task


@pytest.mark.vllm
def test_a_harbor_trial_on_its_session_url(harbor_env: dict[str, str], long_proxy: Any,
                                           tmp_path: Path) -> None:
    """Harbor's trial drives the agent, whose model calls are the session's steps; its verifier's reward
    finishes the session; a verifier that writes no reward is an infrastructure error, not a 0."""
    call = {"name": "bash", "arguments": {"command": "echo 42 > /app/answer.txt; echo steptap-ran-harbor-1"}}
    suite = tmp_path / "suite"
    suite.mkdir()
    _task(suite, "answer", f"Write the answer. STEPTAP_CALL {json.dumps(call)}",
          (FIXTURES / "answer" / "tests" / "test.sh").read_text())
    _task(suite, "no-reward", f"Write the answer. STEPTAP_CALL {json.dumps(call)}", "echo checked\n")
    run_dir = tmp_path / "run"
    out = steptap(["run", str(suite), "--sandbox", "harbor", "--harbor-env-import", FAKE_ENV,
                   "--harbor-agent-import", "steptap_fake_harbor:ToolAgent", "-n", "2", "--concurrency", "2",
                   "--proxy", long_proxy.url, "--run-dir", str(run_dir), "--json"],
                  {**harbor_env, "STEPTAP_CONTROL_TOKEN": long_proxy.token})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "state.jsonl").read_text().splitlines()]
    done = sorted((r["task"], r["index"], r["attempt"], r["status"], r["reward"], r["infra_cause"])
                  for r in lines)
    assert done == [("answer", 0, 0, "finished", 1.0, None), ("answer", 1, 0, "finished", 1.0, None),
                    *[("no-reward", k, a, "infra_error", None, "verifier_crash") for k in (0, 1) for a in (0,
                    1)]]
    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    for r in lines:
        traj = client.get_session(r["session_id"])
        # the agent's calls, through the session URL Harbor handed it: the tool call, then the answer
        assert [s.finish_reason for s in traj.steps] == ["tool_calls", "stop"], traj.steps
        assert traj.metadata["task"]["name"] == r["task"]
        if r["task"] == "answer":
            assert traj.reward == 1.0 and traj.task_run is not None and traj.task_run.verifier is not None
        else:
            assert traj.status == "infra_error" and "RewardFileNotFoundError" in (traj.error or "")
