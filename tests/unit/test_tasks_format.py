"""Task datasets (adapters/tasks/format.py): Harbor task directories and JSONL/parquet rows read into tasks
with an identity (dataset, name, content hash); every bad dataset is one line naming the file and the
problem."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from steptap.adapters.tasks.format import (
    CONTAINER_FILES,
    DEFAULT_AGENT_TIMEOUT_S,
    TaskError,
    load,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tasks"


def _copy(tmp_path: Path, name: str = "answer") -> Path:
    dest = tmp_path / "suite" / name
    shutil.copytree(FIXTURES / name, dest)
    return dest


def test_a_folder_of_harbor_tasks() -> None:
    ds = load(FIXTURES)
    assert ds.name == "tasks" and [t.name for t in ds.tasks] == ["answer", "fix-add"]
    answer, fix = ds.tasks
    assert answer.instruction.startswith("Write the number 42")
    assert (answer.agent_timeout_s, answer.verifier_timeout_s) == (120.0, 30.0)
    assert answer.verifier == "bash /tests/test.sh" and answer.solution == "bash /solution/solve.sh"
    assert answer.app == (FIXTURES / "answer" / "environment" / "app").resolve() and answer.workdir == "/app"
    assert answer.tests == (FIXTURES / "answer" / "tests").resolve()
    assert answer.config["environment"]["memory_mb"] == 512
    assert answer.id.metadata() == {"dataset": "tasks", "name": "answer", "hash": answer.id.hash}
    assert len(answer.id.hash) == 16 and answer.id.hash != fix.id.hash
    assert load(FIXTURES).tasks[0].id == answer.id  # the hash is the content's, stable


def test_the_hash_follows_the_content(tmp_path: Path) -> None:
    task = _copy(tmp_path)
    before = load(task).tasks[0].id
    assert before.dataset == "suite"  # one task folder: the dataset is the folder holding it
    assert load(task).tasks[0].id == before
    (task / "tests" / "test.sh").write_text((task / "tests" / "test.sh").read_text() + "\n# edited\n")
    assert load(task).tasks[0].id.hash != before.hash
    edited = load(task).tasks[0].id.hash
    os.chmod(task / "solution" / "solve.sh", 0o755)  # the executable bit is content too
    assert load(task).tasks[0].id.hash != edited


def test_the_working_folder_without_an_app_folder_is_environment_minus_its_container_files(
        tmp_path: Path) -> None:
    task = _copy(tmp_path)
    shutil.rmtree(task / "environment" / "app")
    (task / "environment" / "data.csv").write_text("a,b\n")
    loaded = load(task).tasks[0]
    assert loaded.app == (task / "environment").resolve() and loaded.app_exclude == CONTAINER_FILES
    shutil.rmtree(task / "environment")
    (task / "task.toml").write_text('[environment]\nworkdir = "/work/repo"\n')
    loaded = load(task).tasks[0]
    assert loaded.app is None and loaded.workdir == "/work/repo"
    assert loaded.agent_timeout_s == DEFAULT_AGENT_TIMEOUT_S


def test_rows_of_a_jsonl_file(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "a.txt").write_text("1\n")
    (tmp_path / "checks").mkdir()
    rows = [{"name": "sum", "instruction": "Add the numbers.", "folder": "repo", "tests": "checks",
             "verifier": "echo 1 > /logs/verifier/reward.txt", "agent_timeout_s": 30, "extra": {"x": 1}},
            {"instruction": "Do nothing.", "verifier": "true"}]
    data = tmp_path / "set.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ds = load(data)
    assert ds.name == "set" and [t.name for t in ds.tasks] == ["sum", "row-1"]
    first, second = ds.tasks
    assert first.app == (tmp_path / "repo").resolve() and first.tests == (tmp_path / "checks").resolve()
    assert first.agent_timeout_s == 30.0 and first.solution is None and first.root is None
    assert second.app is None and second.verifier == "true"
    before = first.id.hash
    (tmp_path / "repo" / "a.txt").write_text("2\n")  # the folder's content is part of the row's identity
    assert load(data).tasks[0].id.hash != before


def test_rows_of_a_parquet_file(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"name": ["p1", "p2"], "instruction": ["one", "two"], "verifier": ["true", "true"]})
    pq.write_table(table, tmp_path / "rows.parquet")
    ds = load(tmp_path / "rows.parquet")
    assert [(t.name, t.instruction) for t in ds.tasks] == [("p1", "one"), ("p2", "two")]


def _problem(path: Path) -> str:
    with pytest.raises(TaskError) as err:
        load(path)
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_bad_task_folders_are_one_line_each(tmp_path: Path) -> None:
    task = _copy(tmp_path)
    (task / "instruction.md").unlink()
    assert _problem(task) == f"{task.resolve()}: no instruction.md"
    (task / "instruction.md").write_text("   \n")
    assert _problem(task).endswith("instruction.md: the instruction is empty")
    (task / "instruction.md").write_text("Do it.")
    (task / "tests" / "test.sh").unlink()
    assert _problem(task) == f"{task.resolve()}: no tests/test.sh (the verifier)"
    (task / "tests" / "test.sh").write_text("true\n")
    (task / "task.toml").write_text("[agent\ntimeout_sec = 3\n")
    assert "task.toml: not valid TOML" in _problem(task)
    (task / "task.toml").write_text("[agent]\ntimeout_sec = -3\n")
    assert _problem(task).endswith("task.toml: [agent] timeout_sec must be a positive number, not -3")
    (task / "task.toml").write_text('[verifier]\ntimeout_sec = "soon"\n')
    assert _problem(task).endswith("[verifier] timeout_sec must be a positive number, not 'soon'")
    (task / "task.toml").write_text('[environment]\nworkdir = "app"\n')
    assert "[environment] workdir must be an absolute path" in _problem(task)
    (task / "task.toml").write_text('[verifier]\nenv = {A = 1}\n')
    assert _problem(task).endswith("task.toml: [verifier] env must be a table of strings")
    (task / "task.toml").write_text('agent = 3\n')
    assert _problem(task).endswith("task.toml: [agent] must be a table")
    (task / "task.toml").write_text("")
    os.mkfifo(task / "environment" / "app" / "pipe")
    assert _problem(task).endswith("pipe: not a regular file, directory or link")


def test_bad_datasets_are_one_line_each(tmp_path: Path) -> None:
    assert _problem(tmp_path / "none") == f"{tmp_path / 'none'}: no such file or directory"
    (tmp_path / "empty").mkdir()
    assert "no task directories in it" in _problem(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("x")
    assert "a dataset is a directory of tasks, a .jsonl or a .parquet" in _problem(tmp_path / "notes.txt")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"instruction": "x", "verifier": "true"}\n{not json\n')
    assert _problem(rows).startswith(f"{rows} line 2: not JSON")
    rows.write_text('[1, 2]\n')
    assert _problem(rows) == f"{rows} line 1: a row is a JSON object"
    rows.write_text('{"instruction": "x", "verifier": " "}\n')
    assert "row 0: verifier must be a shell command" in _problem(rows)
    rows.write_text('{"instruction": "x"}\n{"instruction": "y", "verifier": null}\n')
    assert [t.verifier for t in load(rows).tasks] == ["", ""]  # no verifier: a judge scores them (run)
    rows.write_text('{"verifier": "true"}\n')
    assert _problem(rows) == f"{rows} row 0: no instruction (a string)"
    rows.write_text('{"instruction": "x", "verifier": "true", "folder": "missing"}\n')
    assert "row 0: folder 'missing' is not a directory" in _problem(rows)
    rows.write_text('{"instruction": "x", "verifier": "true", "name": "../up"}\n')
    assert "row 0: name is letters, digits" in _problem(rows)
    rows.write_text('{"instruction": "x", "verifier": "true", "name": "a"}\n' * 2)
    assert _problem(rows) == f"{rows}: two tasks are named 'a'"
    rows.write_text('{"instruction": "x", "verifier": "true", "agent_timeout_s": 0}\n')
    assert "agent_timeout_s must be a positive number, not 0" in _problem(rows)
    rows.write_text("\n")
    assert _problem(rows) == f"{rows}: no rows"


def test_selecting_tasks_by_name() -> None:
    ds = load(FIXTURES)
    assert [t.name for t in ds.select(["fix-add"])] == ["fix-add"]
    assert [t.name for t in ds.select(None)] == ["answer", "fix-add"]
    with pytest.raises(TaskError, match="no task named 'nope'"):
        ds.select(["nope"])
