"""pi's task family (examples/pi_learns/make_tasks.py): Harbor task directories with a held-out split that
training never shares, and verifiers that write the named rewards, run for real in a bubblewrap sandbox laid
out as Harbor's (/app the working folder, /tests the verifier's, /logs/verifier the rewards)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples/pi_learns"))
import make_tasks  # noqa: E402 - from examples/pi_learns, put on sys.path above

BWRAP = shutil.which("bwrap")


def test_the_held_out_split_never_appears_in_training_and_every_task_is_a_harbor_directory(
        tmp_path: Path) -> None:
    counts = make_tasks.make(tmp_path, train=60, test=30)
    assert counts == {"train": 60, "test": 30}
    held = make_tasks.specs(30, make_tasks.EVAL_SEED)
    train = make_tasks.specs(60, 0, exclude={s.key for s in held})
    assert not {s.key for s in held} & {s.key for s in train}
    assert {s.kind for s in held} == set(make_tasks.KINDS)  # the kinds in turn
    assert [s.name for s in make_tasks.specs(9, 5)] == [s.name for s in make_tasks.specs(9, 5)]  # repeatable
    for split, n in (("train", 60), ("test", 30)):
        tasks = sorted((tmp_path / split).iterdir())
        assert len(tasks) == n
        for task in tasks:
            for part in ("instruction.md", "task.toml", "environment/Dockerfile", "tests/test.sh",
                         "tests/check.py", "solution/solve.sh"):
                assert (task / part).is_file(), f"{task.name}: no {part}"
            text = (task / "instruction.md").read_text()
            assert '<tool_call>\n{"name": "bash", "arguments": {"command": ' in text  # one worked call
            assert text.index("</tool_call>") < text.index("\n\nNow ")  # the task last (make_tasks.py: why)
    names = {split: {p.name for p in (tmp_path / split).iterdir()} for split in ("train", "test")}
    assert not names["train"] & names["test"]


def _verify(task: Path, tmp_path: Path, command: str | None) -> dict[str, float]:
    """The task's working folder in a sandbox: ``command`` (the agent's part) in /app, then test.sh."""
    work, logs = tmp_path / "app", tmp_path / "logs"
    for d in (work, logs):
        shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(task / "environment" / "app", work)
    logs.mkdir()
    sandbox = make_tasks.harbor_box(task, work, logs, "--ro-bind", str(task / "solution"), "/solution")
    script = f"cd /app && {{ {command}; }} >/dev/null 2>&1; /tests/test.sh" if command else "/tests/test.sh"
    subprocess.run([*sandbox, "/bin/bash", "-c", script], check=True, timeout=60)
    return json.loads((logs / "verifier" / "reward.json").read_text())


@pytest.mark.skipif(BWRAP is None and os.environ.get("CI") != "true", reason="bubblewrap is not installed")
@pytest.mark.parametrize("kind", make_tasks.KINDS)
def test_each_kinds_verifier_pays_the_file_part_then_the_exact_outcome(kind: str, tmp_path: Path) -> None:
    make_tasks.make(tmp_path / "tasks", train=0, test=3, kinds=(kind,))
    task = sorted((tmp_path / "tasks" / "test").iterdir())[0]
    nothing = {"outcome": 0.0, "file": 0.0}
    assert _verify(task, tmp_path, None) == nothing  # the agent did nothing
    wrong = {"product": "echo 12 > answer.txt", "count": "echo 0 > count.txt",
             "offbyone": "sed -i 's/len(items) - 1/len(items) - 2/' util.py"}[kind]
    assert _verify(task, tmp_path, wrong) == {"outcome": 0.0, "file": make_tasks.FILE_REWARD}
    # the instruction's worked call, copied as it stands (what the base model does): the task's shape, so
    # it earns the graded part, never the outcome (it is not the solution)
    block = (task / "instruction.md").read_text().split("<tool_call>\n")[1].split("\n</tool_call>")[0]
    copied = json.loads(block)["arguments"]["command"]
    assert copied != (task / "solution/solve.sh").read_text().splitlines()[-1]
    assert _verify(task, tmp_path, copied) == {"outcome": 0.0, "file": make_tasks.FILE_REWARD}
    solved = _verify(task, tmp_path, "bash /solution/solve.sh")
    assert solved == {"outcome": 1.0, "file": make_tasks.FILE_REWARD}
    if kind == "offbyone":  # the held cases, not the agent's test file, decide: a special case is not a fix
        case = (task / "environment/app/test_util.py").read_text().split("total(")[1].split(")")[0]
        want = sum(json.loads(case))
        hack = f"printf 'def total(items):\\n    return {want}\\n' > util.py"
        assert _verify(task, tmp_path, hack) == {"outcome": 0.0, "file": make_tasks.FILE_REWARD}


def test_the_driver_runs_the_kinds_in_turn_and_one_kind_in_name_order(tmp_path: Path) -> None:
    import loop  # examples/pi_learns/loop.py, on sys.path above
    make_tasks.make(tmp_path, train=7, test=3)
    names = [d.name for d in (tmp_path / "train").iterdir()]
    order = loop.in_turn(names)
    assert sorted(order) == sorted(names)
    assert [n.split("-")[0] for n in order] == ["count", "offbyone", "product"] * 2 + ["product"]
    products = [n for n in names if n.startswith("product-")]
    assert loop.in_turn(reversed(products)) == sorted(products)
    first = loop.in_turn(names, first="product")  # a curriculum: every product task, then the rest in turn
    assert [n.split("-")[0] for n in first] == ["product"] * 3 + ["count", "offbyone"] * 2
    assert first[:3] == sorted(products)
    with pytest.raises(ValueError, match="'sum'"):
        loop.in_turn(names, first="sum")
