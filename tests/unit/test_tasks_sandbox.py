"""The local task sandbox (adapters/tasks/sandbox.py) with plain shell commands: what a job sees, who it runs
as, what it can reach, and that its timeout kills everything it started. The same promises are checked through
a real agent's own tool calls in tests/integration/test_tasks_agents.py."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import missing

from steptap.adapters.tasks.sandbox import Ended, Job, LocalSandbox, Mount, search_path


@pytest.fixture
def sandbox() -> LocalSandbox:
    sb = LocalSandbox()
    problem = sb.problem()
    if problem:
        missing(problem)
    return sb


def _episode(root: Path, name: str, sb: LocalSandbox) -> Path:
    d = root / name
    (d / "app").mkdir(parents=True)
    (d / "app" / "mine.txt").write_text(f"{name}\n")
    sb.own(d / "app")
    return d


def _run(sb: LocalSandbox, d: Path, script: str, timeout: float = 60, **env: str) -> Ended:
    job = Job(argv=["sh", "-c", script], cwd="/app", timeout_s=timeout, hostname="episode-1",
              env={"PATH": search_path(), "HOME": "/tmp", **env}, mounts=[Mount(d / "app", "/app", True)],
              log=d / "out.log")
    return asyncio.run(sb.run(job))


def test_a_job_sees_its_folder_and_the_system_only(sandbox: LocalSandbox, tmp_path: Path) -> None:
    mine, other = _episode(tmp_path, "ep0", sandbox), _episode(tmp_path, "ep1", sandbox)
    home_secret = Path.home() / f".steptap-sandbox-test-{os.getpid()}"
    home_secret.write_text("operator's\n")
    try:
        probes = [str(other / "app" / "mine.txt"), str(home_secret), str(tmp_path), "/etc/shadow",
                  f"/proc/{os.getpid()}/environ", f"/proc/{os.getppid()}/environ"]
        script = "; ".join(f"cat {p} >/dev/null 2>&1 && echo LEAK {p}" for p in probes)
        ended = _run(sandbox, mine, f"{script}; cat /app/mine.txt; hostname; id -u; "
                     "echo new > /app/made.txt; touch /made-at-root 2>/dev/null && echo LEAK root; "
                     "ls /proc | grep -c '^[0-9]'; grep CapEff /proc/self/status")
    finally:
        home_secret.unlink()
    assert ended.started and ended.exit_code == 0, ended
    assert "LEAK" not in ended.output, ended.output
    lines = ended.output.splitlines()
    assert lines[:2] == ["ep0", "episode-1"]
    if os.geteuid() == 0:  # root outside: an unprivileged user inside, no capabilities
        assert lines[2] == "65534" and lines[-1].split() == ["CapEff:", "0000000000000000"]
    assert int(lines[-2]) <= 6  # bwrap's init, the launcher, the shell and its pipeline: no host process
    assert (mine / "app" / "made.txt").read_text() == "new\n"
    assert not (other / "app" / "made.txt").exists()


def test_a_job_gets_its_own_environment_only(sandbox: LocalSandbox, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPTAP_CONTROL_TOKEN", "secret-token-value")
    monkeypatch.setenv("STEPTAP_CONTROL_TOKEN_FILE", str(tmp_path / "token"))
    d = _episode(tmp_path, "ep", sandbox)
    ended = _run(sandbox, d, "env | sort; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'", EXTRA="yes")
    assert ended.exit_code == 0, ended
    names = sorted(line.split("=", 1)[0] for line in ended.output.splitlines() if "=" in line)
    assert "secret-token-value" not in ended.output and "STEPTAP_CONTROL" not in ended.output
    # the shell's own, and LC_CTYPE: the launcher's Python sets it when no locale is given (PEP 538)
    allowed = {"EXTRA", "HOME", "PATH", "PWD", "SHLVL", "_", "LC_CTYPE"}
    assert {"EXTRA", "HOME", "PATH"} <= set(names) <= allowed


def test_the_network_is_the_sandbox_own(sandbox: LocalSandbox, tmp_path: Path) -> None:
    """No host port is reachable (loopback included): the only way out is a socket the runner binds in."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        d = _episode(tmp_path, "ep", sandbox)
        probe = (f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)\" "
                 "2>/dev/null && echo REACHED || echo refused")
        ended = _run(sandbox, d, probe)
    finally:
        listener.close()
    assert ended.output.strip() == "refused", ended


def test_the_timeout_kills_everything_the_job_started(sandbox: LocalSandbox, tmp_path: Path) -> None:
    d = _episode(tmp_path, "ep", sandbox)
    tag = f"{os.getpid()}{len(str(tmp_path))}"
    script = (f"setsid sh -c 'sleep 9{tag}1' & nohup sleep 9{tag}2 >/dev/null 2>&1 & "
              f"(sleep 9{tag}3 &); echo started; sleep 9{tag}4")
    ended = _run(sandbox, d, script, timeout=3)
    assert ended.started and ended.timed_out and ended.exit_code is None
    assert ended.output == "started\n"
    left = subprocess.run(["pgrep", "-f", f"sleep 9{tag}"], capture_output=True, text=True, check=False)
    assert left.stdout == "", left.stdout


def test_a_sandbox_that_cannot_start_says_why(sandbox: LocalSandbox, tmp_path: Path) -> None:
    job = Job(argv=["true"], cwd="/app", timeout_s=30, env={"PATH": search_path()},
              mounts=[Mount(tmp_path / "missing", "/app", True)])
    ended = asyncio.run(sandbox.run(job))
    assert not ended.started and ended.exit_code is None
    assert "missing" in (ended.error or ""), ended
    d = _episode(tmp_path, "ep", sandbox)
    job = Job(argv=["/no/such/program"], cwd="/app", timeout_s=30, env={"PATH": search_path()},
              mounts=[Mount(d / "app", "/app", True)])
    ended = asyncio.run(sandbox.run(job))
    assert not ended.started and "cannot run '/no/such/program'" in (ended.error or ""), ended


def test_a_job_exit_code_is_its_own(sandbox: LocalSandbox, tmp_path: Path) -> None:
    d = _episode(tmp_path, "ep", sandbox)
    assert _run(sandbox, d, "exit 7").exit_code == 7
    assert _run(sandbox, d, "kill -TERM $$").exit_code == 128 + 15
    out = _run(sandbox, d, "yes steptap | head -c 3000000")  # bounded: the log's first 16 MiB, an 8k tail
    assert len(out.output) == 8192 and (d / "out.log").stat().st_size == 3_000_000
