"""What a dataset, a tool or a grader may reach (issue 25, item 8). A parquet row is data: its ``agent_name``
names a registered environment, never a file or module to import (that takes ``--trust-dataset-code``). The
control token (it posts rewards) leaves the environment of ``steptap run`` / ``env run`` / ``eval`` once read,
so no tool, agent or grader inherits it; the reward command gets the trajectory on stdin instead.

Real processes: a real ``steptap serve`` (sessions need no backend: the agent here makes no model call) and
``steptap run`` with a real shell reward command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port

from steptap.adapters.env.dataset import Row
from steptap.adapters.env.runner import DatasetRunner, RunConfig

STEPTAP = [sys.executable, "-m", "steptap.middleware.cli"]
TOKEN = "stc-" + "t" * 40


def _evil(tmp_path: Path) -> Path:
    f = tmp_path / "evil.py"
    f.write_text(f"open({str(tmp_path / 'imported')!r}, 'w').write('yes')\nmake = object\n")
    return f


def _runner(rows: list[Row], **kw: object) -> DatasetRunner:
    return DatasetRunner(rows, RunConfig(proxy_url="http://127.0.0.1:9", control_token=TOKEN,
                                         **kw))  # type: ignore[arg-type]


def test_a_row_naming_a_file_is_refused_and_never_imported(tmp_path: Path) -> None:
    row = Row(index=0, prompt="hi", agent_name=f"{_evil(tmp_path)}:make")
    with pytest.raises(ValueError, match="--trust-dataset-code"):
        _runner([row])._factory(row)
    assert not (tmp_path / "imported").exists()
    with pytest.raises(ValueError, match="--trust-dataset-code"):
        _runner([row])._factory(Row(index=1, prompt="hi", agent_name="os.path:join"))


def test_a_row_naming_a_file_runs_when_trusted_and_a_flag_may_name_one(tmp_path: Path) -> None:
    row = Row(index=0, prompt="hi", agent_name=f"{_evil(tmp_path)}:make")
    assert _runner([row], trust_dataset_code=True)._factory(row) is object
    other = Row(index=1, prompt="hi", agent_name="os.path:join")
    assert _runner([other], env="os.path:join")._factory(other) is os.path.join  # --env is the user's own


def test_the_reward_command_gets_the_trajectory_on_stdin_and_never_the_token(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": TOKEN, "STEPTAP_LOG_LEVEL": "WARNING"}
    serve = subprocess.Popen([*STEPTAP, "serve", "--backend", "http://127.0.0.1:9", "--port", str(port),
                              "--log",
                              str(tmp_path / "log")], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60  # up once it answers (503 without a backend: sessions still work)
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert serve.poll() is None and time.monotonic() < deadline, "steptap serve did not come up"
                time.sleep(0.2)
        grader = f"env > {tmp_path / 'grader.env'}; cat > {tmp_path / 'stdin.json'}; echo 0.5"
        agent = f"env > {tmp_path / 'agent.env'}"
        out = subprocess.run([*STEPTAP, "run", "--proxy", url, "--reward-cmd", grader, "--", "sh", "-c",
                              agent],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        for name in ("agent.env", "grader.env"):
            assert TOKEN not in (tmp_path / name).read_text(), f"the {name[:-4]} inherited the control token"
        traj = json.loads((tmp_path / "stdin.json").read_text())
        assert traj["id"] and traj["id"] in (tmp_path / "grader.env").read_text()  # STEPTAP_TRAJECTORY_ID too
    finally:
        serve.terminate()
        serve.wait(30)
