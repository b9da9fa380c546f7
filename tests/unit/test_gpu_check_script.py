"""scripts/gpu_check.sh without a GPU, and the device pages true to the scripts: an unknown option and a
machine without a GPU are refused at once (the dry run itself takes minutes under the heavy lock:
docs/gpu-runbook.md has its command and times); every option the script takes is in its --help, and every
flag docs/gpu-runbook.md and docs/gpu-scale.md give the device scripts is one they take."""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts/gpu_check.sh"
PAGES = ("docs/gpu-runbook.md", "docs/gpu-scale.md")
CALL = re.compile(r"scripts/(gpu_check\.sh|[\w]+\.py)([^`\n|;&]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # no nvidia-smi here, whatever the host has
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def _first_light_options() -> set[str]:
    """The options of the first-light branch: its case labels (``--out)``, ``--dry)``, ...)."""
    text = SCRIPT.read_text()
    branch = text[text.index('if [ "${1:-}" != "--long" ]'):text.index("shift  # --long")]
    return {o for label in re.findall(r"^\s+([-\w|]+)\)", branch, re.M) for o in label.split("|")
            if o.startswith("--")}


def _flags(script: str) -> set[str]:
    """What a script takes: the gpu_check.sh case labels of both branches, or a Python script's argparse."""
    path = ROOT / "scripts" / script
    if script.endswith(".sh"):
        return set(re.findall(r"^\s+(--[\w-]+)\)", path.read_text(), re.M)) | {"--long", "--help"}
    return {"--help"} | {a.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                         and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
                         for a in n.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}


def test_an_unknown_option_and_no_gpu_are_refused_at_once(tmp_path: Path) -> None:
    bad = _run("--bogus")
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr
    no_gpu = _run("--out", str(tmp_path / "out"))
    assert no_gpu.returncode == 3 and "NO GPU (try --dry)" in no_gpu.stderr
    assert not list((tmp_path / "out").iterdir())  # nothing ran


def test_every_option_is_in_the_help() -> None:
    shown = _run("--help")
    assert shown.returncode == 0
    options = _first_light_options()
    assert {"--out", "--dry", "--skip-tool", "--skip-scale", "--scale-only"} <= options
    assert not [o for o in options - {"--help"} if o not in shown.stdout], shown.stdout
    assert "gpu_scale.json" in shown.stdout  # the fifth step is listed


def test_the_device_pages_give_the_scripts_only_flags_they_take() -> None:
    wrong, seen = [], 0
    for page in PAGES:
        for line in (ROOT / page).read_text().splitlines():
            for script, rest in CALL.findall(line):
                if not (ROOT / "scripts" / script).is_file():
                    wrong.append(f"{page}: scripts/{script} does not exist")
                    continue
                seen += 1
                wrong += [f"{page}: scripts/{script} {f}" for f in FLAG.findall(rest)
                          if f not in _flags(script)]
    assert seen >= 8, f"only {seen} script calls found: did the pages' shape change?"
    assert not wrong, "flags the scripts do not take:\n" + "\n".join(wrong)
