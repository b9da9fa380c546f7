"""Codex's own sandbox with the home `steptap run --agent codex` gives it (issue 39), no model needed: Codex
>= 0.169 refuses to create its sandbox helpers (`codex-linux-sandbox`, symlinks to itself) when ``CODEX_HOME``
is in the temp directory, and every sandboxed command then fails (``bwrap: execvp codex-linux-sandbox``). With
``agents.new_agent_home`` (never in the temp directory) a ``workspace-write`` command that redirects into the
working directory runs; the same command with ``CODEX_HOME`` under the temp directory (what ``steptap run``
did before) fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from steptap.adapters import agents

COMMAND = ["sandbox", "-c", 'sandbox_mode="workspace-write"', "--", "sh", "-c",
           "echo steptap-wrote > out.txt && cat out.txt"]


def _sandboxed(cli: Path, home: Path, work: Path) -> subprocess.CompletedProcess[str]:
    launch = agents.prepare("codex", base_url="http://127.0.0.1:9/v1", api_key="unused", model="m", home=home,
                            args=COMMAND, cli=cli)
    return subprocess.run(launch.argv, env={**os.environ, **launch.env}, cwd=work, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, check=False)


def test_codex_runs_a_sandboxed_write_with_the_agent_home_and_not_under_the_temp_dir(
        agent_cli: Any, tmp_path: Path) -> None:
    cli = agent_cli("codex")
    homes = agents.new_agent_home()
    try:
        work = tmp_path / "work"
        work.mkdir()
        out = _sandboxed(cli, homes / "agent-0", work)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout == "steptap-wrote\n" and (work / "out.txt").read_text() == "steptap-wrote\n"
        assert "Refusing to create helper binaries" not in out.stderr
        # CODEX_HOME in the temp directory: Codex says so and its sandbox cannot start its helper
        (work / "out.txt").unlink()
        bad = _sandboxed(cli, tmp_path / "home", work)
        assert bad.returncode != 0 and not (work / "out.txt").exists()
        assert "Refusing to create helper binaries under temporary dir" in bad.stderr
        assert "codex-linux-sandbox" in bad.stderr
    finally:
        shutil.rmtree(homes)
