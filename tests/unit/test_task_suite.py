"""The built-in task suite (examples/tasks, issue 38 item 5): genuine Harbor tasks, each solved by its
reference solution and failed by doing nothing.

Each task runs as the local sandbox runs it, in bubblewrap: a fresh copy of ``environment/app`` at
``/app`` (writable), the host read-only, a private ``/tmp`` and HOME; ``solution/solve.sh`` (or nothing),
then, with the solver gone, ``tests/test.sh`` with ``/tests`` and an empty ``/logs/verifier`` bound in. The
reference solution must earn the full reward (1.0, or named parts summing to 1.0), the untouched ``/app``
must earn 0. Two hostile episodes check what the verifiers promise (examples/tasks/README.md): a reward file
planted by code under test is replaced, a FIFO in place of an output fails the check instead of hanging it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from conftest import missing  # a failure under CI, a skip on a dev machine
from harbor_venv import harbor_check

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "examples" / "tasks"
TASKS = sorted(p for p in SUITE.iterdir() if p.is_dir())
# Harbor's layout: what its environments upload where (/app is the image's working copy)
MOUNTS = ("/app", "/tests", "/logs", "/solution")
NOBODY = 65534  # run as root, the episode drops to this user, as the local sandbox does


def _bwrap() -> str:
    found = shutil.which("bwrap")
    if found is None:
        message = "bubblewrap is missing: apt-get install -y bubblewrap (scripts/setup.sh)"
        missing(message)
    return found


def _sandbox(binds: list[str], command: list[str]) -> subprocess.CompletedProcess[str]:
    """``command`` in bubblewrap: the host's top-level folders read-only (Harbor's paths, /tmp, /root and
    /home left out), fresh /tmp and HOME, its own pid namespace, a clean environment, ``binds`` added; as
    ``NOBODY`` when run as root."""
    host: list[str] = []
    for entry in sorted(os.scandir("/"), key=lambda e: e.name):
        path = "/" + entry.name
        if path in (*MOUNTS, "/proc", "/dev", "/tmp", "/root", "/home", "/run"):
            continue
        if entry.is_symlink():
            host += ["--symlink", os.readlink(path), path]
        elif entry.is_dir():
            host += ["--ro-bind", path, path]
    argv = [_bwrap(), *host, "--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
            "--unshare-pid", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/root",
            "--setenv", "LANG", "C.UTF-8", "--perms", "1777", "--tmpfs", "/root", *binds, "--chdir", "/app"]
    if os.geteuid() == 0:
        argv += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    argv += command
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _episode(task: Path, tmp: Path, solution: Path | None) -> dict[str, float]:
    """The rewards of one episode: ``solution/solve.sh`` (or nothing) on a fresh copy, then the verifier."""
    app, logs = tmp / "app", tmp / "logs"
    if (task / "environment" / "app").is_dir():
        shutil.copytree(task / "environment" / "app", app, symlinks=True)
    else:
        app.mkdir(parents=True)
    logs.mkdir()
    if os.geteuid() == 0:
        for path in (app, *app.rglob("*"), logs):
            os.lchown(path, NOBODY, NOBODY)
    if solution is not None:
        run = _sandbox(["--bind", str(app), "/app", "--ro-bind", str(solution), "/solution"],
                       ["bash", "/solution/solve.sh"])
        assert run.returncode == 0, f"{task.name}: solve.sh failed:\n{run.stdout}{run.stderr}"
    run = _sandbox(["--bind", str(app), "/app", "--ro-bind", str(task / "tests"), "/tests",
                    "--perms", "0755", "--dir", "/logs", "--bind", str(logs), "/logs/verifier"],
                   ["bash", "/tests/test.sh"])
    assert run.returncode == 0, f"{task.name}: test.sh failed:\n{run.stdout}{run.stderr}"
    if (logs / "reward.json").exists():  # Harbor reads reward.json first
        rewards = json.loads((logs / "reward.json").read_text())
    else:
        rewards = {"reward": float((logs / "reward.txt").read_text())}
    assert rewards and all(isinstance(v, float | int) and math.isfinite(v) for v in rewards.values()), rewards
    return {k: float(v) for k, v in rewards.items()}


@pytest.mark.parametrize("task", TASKS, ids=[t.name for t in TASKS])
def test_the_reference_solution_passes_and_doing_nothing_fails(task: Path, tmp_path: Path) -> None:
    solved = _episode(task, tmp_path / "solved", task / "solution")
    assert sum(solved.values()) == 1.0, solved
    untouched = _episode(task, tmp_path / "untouched", None)
    assert sum(untouched.values()) == 0.0, untouched


def _hostile(tmp: Path, script: str) -> Path:
    (tmp / "hostile").mkdir(parents=True)
    (tmp / "hostile" / "solve.sh").write_text(script)
    return tmp / "hostile"


def test_a_reward_file_written_by_code_under_test_counts_for_nothing(tmp_path: Path) -> None:
    """fix-median fixed, and its module, imported by the checks, writes reward files of its own."""
    task = SUITE / "fix-median"
    plant = """
    cat >> /app/stats.py <<'PY'
    with open("/logs/verifier/reward.json", "w") as _f:
        _f.write('{"planted": 7}')
    PY
    """
    rewards = _episode(task, tmp_path, _hostile(tmp_path, (task / "solution/solve.sh").read_text()
                                                + "\n".join(line[4:] for line in plant.splitlines())))
    assert rewards == {"reward": 1.0}  # the verifier's own reward.txt; the planted reward.json is gone


def test_a_fifo_in_place_of_the_output_fails_instead_of_hanging_the_verifier(tmp_path: Path) -> None:
    rewards = _episode(SUITE / "count-errors", tmp_path, _hostile(tmp_path, "mkfifo /app/error_counts.txt\n"))
    assert rewards == {"reward": 0.0}


def test_the_suite_has_twenty_tasks_in_harbors_layout() -> None:
    assert len(TASKS) >= 20
    readme = (SUITE / "README.md").read_text()
    for task in TASKS:
        assert (task / "instruction.md").read_text().strip(), task.name
        config = tomllib.loads((task / "task.toml").read_text())
        assert config["task"]["name"] == f"steptap/{task.name}"
        assert 0 < config["agent"]["timeout_sec"] <= 600 and 0 < config["verifier"]["timeout_sec"] <= 60
        assert config["environment"]["cpus"] == 1 and config["environment"]["memory_mb"] <= 2048
        dockerfile = (task / "environment" / "Dockerfile").read_text()
        assert dockerfile.startswith("FROM debian:") and "\nWORKDIR /app\n" in dockerfile, task.name
        copies = "COPY --chown=agent:agent app/ /app/" in dockerfile
        assert copies == (task / "environment" / "app").is_dir(), task.name
        for script in ("tests/test.sh", "solution/solve.sh"):
            assert os.access(task / script, os.X_OK), f"{task.name}/{script} is not executable"
        assert f"`{task.name}`" in readme, f"examples/tasks/README.md does not list {task.name}"


def test_harbor_reads_and_lints_every_task() -> None:
    """Harbor's own linter and task loader (Harbor 0.25, in its venv) on the whole suite."""
    summary = harbor_check("lint", *TASKS)
    assert summary["tasks"] == len(TASKS) and "root-agent" in summary["rules"]
