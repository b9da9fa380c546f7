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


# A stand-in agent (named as such): it walks up its ancestors and looks for the token in each one's initial
# environment block (/proc/PID/environ: what the kernel shows, whatever the process did to os.environ since)
ANCESTORS = """
import os, sys
token, found, pid = sys.argv[1].encode(), [], os.getppid()
while pid > 1:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if token in f.read():
                found.append(pid)
        with open(f"/proc/{pid}/status") as f:
            pid = int([l for l in f if l.startswith("PPid:")][0].split()[1])
    except OSError as exc:
        found.append(f"{pid}: {exc}")
        break
open(sys.argv[2], "w").write(repr(found))
"""


def test_no_ancestor_of_an_agent_keeps_the_token_in_its_environment_block(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "STEPTAP_LOG_LEVEL": "WARNING"}
    serve = subprocess.Popen([*STEPTAP, "serve", "--backend", "http://127.0.0.1:9", "--port", str(port),
                              "--log", str(tmp_path / "log"), "--control-token-file",
                              str(_token_file(tmp_path))],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(serve, port)
        (tmp_path / "agent.py").write_text(ANCESTORS)
        out = subprocess.run([*STEPTAP, "run", "--proxy", url, "--", "sh", "-c",
                              f"{sys.executable} {tmp_path / 'agent.py'} {TOKEN} {tmp_path / 'found'}"],
                             env={**env, "STEPTAP_CONTROL_TOKEN": TOKEN}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert (tmp_path / "found").read_text() == "[]", "an ancestor of the agent shows the control token"
    finally:
        serve.terminate()
        serve.wait(30)


def test_forgetting_the_token_leaves_the_process_undumpable_and_its_block_clean(tmp_path: Path) -> None:
    probe = ("import ctypes, os, sys\n"
             "from steptap.middleware.client import default_control_token, forget_control_token\n"
             "token = default_control_token()\n"
             "forget_control_token()\n"
             "block = open('/proc/self/environ', 'rb').read()\n"
             "dumpable = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)\n"  # PR_GET_DUMPABLE
             "print(token == sys.argv[1], token.encode() in block, dumpable,\n"
             "      'STEPTAP_CONTROL_TOKEN' in os.environ, os.environ['X_OTHER'])\n")
    out = subprocess.run([sys.executable, "-c", probe, TOKEN], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "STEPTAP_CONTROL_TOKEN": TOKEN, "X_OTHER": "kept"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "0", "False", "kept"]


def _token_file(tmp_path: Path) -> Path:
    path = tmp_path / "control_token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def _wait_listening(proc: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "steptap serve did not come up"
            time.sleep(0.2)
