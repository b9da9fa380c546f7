"""Task datasets: Harbor task directories, or JSONL/parquet rows naming a folder, an instruction and a
verifier.

A **Harbor task** is a directory (Harbor's format, as Terminal-Bench 2.0 and its adapters write it)::

    instruction.md        what the agent is told
    task.toml             [agent] timeout_sec, [verifier] timeout_sec and env, [environment] cpus, memory_mb,
                          workdir, docker_image, ... (every key optional)
    environment/          a Dockerfile or compose file for container runs; the local sandbox builds
                          nothing: its working folder starts as environment/app/ when that exists
                          (``COPY app/ /app/``), else as environment/'s files other than its container
                          files (``COPY . /app/``)
    tests/test.sh         the verifier: copied to /tests only after the agent is gone; it writes a number
                          to /logs/verifier/reward.txt or a JSON object of named numbers to
                          /logs/verifier/reward.json
    solution/solve.sh     the reference solution (``steptap tasks check`` runs it)

A **dataset** is a directory of such task directories (each immediate subdirectory holding ``instruction.md``
or ``task.toml``), one task directory, or a ``.jsonl`` / ``.parquet`` file of rows::

    {"name": "fix-add", "instruction": "...", "folder": "repos/calc", "tests": "tests/calc",
     "verifier": "python -m pytest -q /tests", "solution": "sed -i s/-/+/ calc.py",
     "agent_timeout_s": 300, "verifier_timeout_s": 60}

``folder`` (copied to the working folder), ``tests`` (copied to /tests for the verifier only) and relative
paths are resolved from the file's directory; ``verifier`` is a shell command that writes the reward file as
test.sh does; only ``instruction`` is required: a row with no ``verifier`` (``null`` or absent) is scored by
a judge alone (``steptap tasks run --reward-judge``, docs/judge.md). Other columns are ignored.

A task's identity is its dataset's name, its own name and a content hash of everything that defines it (the
folder's files, names, modes and link targets; a row's fields too), so a solve rate by task can be computed
from the log alone and an edited task is never mistaken for the old one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKDIR = "/app"  # Harbor's tasks' WORKDIR; task.toml's [environment] workdir may say otherwise
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
VERIFIER_DIR = "/logs/verifier"
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 600.0  # Harbor's own default
MAX_INSTRUCTION = 256 * 1024  # characters: an instruction is a prompt, not a payload
MAX_TASKS = 100_000
# The files of environment/ that describe a container rather than the working folder
CONTAINER_FILES = frozenset({"Dockerfile", "Containerfile", ".dockerignore", "docker-compose.yaml",
                             "docker-compose.yml", "compose.yaml", "compose.yml"})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class TaskError(ValueError):
    """A task or dataset that cannot be run: its message is one line naming the file and the problem."""


@dataclass(frozen=True)
class TaskId:
    dataset: str
    name: str
    hash: str  # 16 hex digits of the sha256 of everything that defines the task

    def metadata(self) -> dict[str, str]:
        return {"dataset": self.dataset, "name": self.name, "hash": self.hash}


@dataclass
class Task:
    id: TaskId
    instruction: str
    verifier: str  # a shell command run in the working folder, /tests beside it ("": none, a judge scores it)
    app: Path | None = None  # copied to the working folder (None: it starts empty)
    app_exclude: frozenset[str] = frozenset()  # names left out at app's top level
    tests: Path | None = None  # copied to /tests for the verifier only
    solution: str | None = None  # a shell command (the reference solution), run in the working folder
    solution_dir: Path | None = None  # copied to /solution for it
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    verifier_timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S
    workdir: str = WORKDIR
    verifier_env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)
    root: Path | None = None  # the Harbor task directory (containers build from its environment/)
    config: dict[str, Any] = field(default_factory=dict)  # task.toml as read

    @property
    def name(self) -> str:
        return self.id.name


@dataclass
class Dataset:
    name: str
    path: Path
    tasks: list[Task]

    def select(self, names: list[str] | None) -> list[Task]:
        """The tasks named (all when ``names`` is empty); an unknown name is a ``TaskError``."""
        if not names:
            return list(self.tasks)
        by_name = {t.name: t for t in self.tasks}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise TaskError(f"{self.path}: no task named {', '.join(map(repr, unknown))}")
        return [by_name[n] for n in names]


# -- hashing -------------------------------------------------------------------------------------------------

def _walk(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(filenames) + [d for d in dirnames if (base / d).is_symlink()]:
            yield base / name


def tree_hash(root: Path, h: Any) -> None:
    """Feed ``root``'s files (relative names, executable bits, contents; link targets) to ``h``. A FIFO or
    device is a ``TaskError``: a task folder holds files."""
    for path in _walk(root):
        rel = path.relative_to(root).as_posix()
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            h.update(f"L {rel}\0{os.readlink(path)}\0".encode())
        elif stat.S_ISREG(st.st_mode):
            h.update(f"F {rel}\0{int(bool(st.st_mode & 0o111))}\0{st.st_size}\0".encode())
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        elif not stat.S_ISDIR(st.st_mode):
            raise TaskError(f"{path}: not a regular file, directory or link")


def _digest(h: Any) -> str:
    return str(h.hexdigest()[:16])


# -- Harbor task directories ---------------------------------------------------------------------------------

def is_task_dir(path: Path) -> bool:
    return (path / "instruction.md").is_file() or (path / "task.toml").is_file()


def _positive(value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def _number(config: dict[str, Any], section: str, key: str, where: Path) -> float | None:
    value = config.get(section, {}).get(key)
    if value is None:
        return None
    if not _positive(value):
        raise TaskError(f"{where}: [{section}] {key} must be a positive number, not {value!r}")
    return float(value)


def _env(config: dict[str, Any], section: str, where: Path) -> dict[str, str]:
    env = config.get(section, {}).get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise TaskError(f"{where}: [{section}] env must be a table of strings")
    return dict(env)


def _read_config(path: Path) -> dict[str, Any]:
    toml_path = path / "task.toml"
    if not toml_path.is_file():
        return {}
    try:
        config = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TaskError(f"{toml_path}: not valid TOML ({exc})") from None
    for section in ("agent", "verifier", "environment", "solution", "metadata"):
        if not isinstance(config.get(section, {}), dict):
            raise TaskError(f"{toml_path}: [{section}] must be a table")
    return config


def _instruction(text: str, where: Path) -> str:
    if not text.strip():
        raise TaskError(f"{where}: the instruction is empty")
    if len(text) > MAX_INSTRUCTION:
        raise TaskError(f"{where}: the instruction is longer than {MAX_INSTRUCTION} characters")
    return text


def load_task_dir(path: Path, dataset: str) -> Task:
    """One Harbor task directory, checked; every problem is a one-line ``TaskError``."""
    path = path.resolve()
    name = path.name
    if not _NAME.match(name):
        raise TaskError(f"{path}: a task's directory name is letters, digits, '.', '_' and '-' (at most 128)")
    config = _read_config(path)
    instruction_path = path / "instruction.md"
    if not instruction_path.is_file():
        raise TaskError(f"{path}: no instruction.md")
    try:
        instruction = _instruction(instruction_path.read_text(encoding="utf-8"), instruction_path)
    except UnicodeDecodeError:
        raise TaskError(f"{instruction_path}: not UTF-8 text") from None
    tests = path / "tests"
    if not (tests / "test.sh").is_file():
        raise TaskError(f"{path}: no tests/test.sh (the verifier)")
    toml_path = path / "task.toml"
    workdir = config.get("environment", {}).get("workdir") or WORKDIR
    if not isinstance(workdir, str) or not workdir.startswith("/") or ".." in workdir.split("/"):
        raise TaskError(f"{toml_path}: [environment] workdir must be an absolute path, not {workdir!r}")
    env_dir = path / "environment"
    app, exclude = (env_dir / "app", frozenset[str]()) if (env_dir / "app").is_dir() else (
        (env_dir, CONTAINER_FILES) if env_dir.is_dir() else (None, frozenset()))
    solve = path / "solution" / "solve.sh"
    h = hashlib.sha256(b"harbor-task\0")
    tree_hash(path, h)
    return Task(
        id=TaskId(dataset, name, _digest(h)),
        instruction=instruction,
        verifier=f"bash {TESTS_DIR}/test.sh",
        app=app,
        app_exclude=exclude,
        tests=tests,
        solution=f"bash {SOLUTION_DIR}/solve.sh" if solve.is_file() else None,
        solution_dir=solve.parent if solve.is_file() else None,
        agent_timeout_s=_number(config, "agent", "timeout_sec", toml_path) or DEFAULT_AGENT_TIMEOUT_S,
        verifier_timeout_s=(_number(config, "verifier", "timeout_sec", toml_path)
                            or DEFAULT_VERIFIER_TIMEOUT_S),
        workdir=workdir.rstrip("/") or "/",
        verifier_env=_env(config, "verifier", toml_path),
        solution_env=_env(config, "solution", toml_path),
        root=path,
        config=config,
    )


# -- rows ----------------------------------------------------------------------------------------------------

def _row_path(value: Any, key: str, base: Path, where: str) -> Path | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise TaskError(f"{where}: {key} must be a path")
    path = (base / value).resolve()
    if not path.is_dir():
        raise TaskError(f"{where}: {key} {value!r} is not a directory (paths are relative to {base})")
    return path


def _row_timeout(value: Any, key: str, where: str, default: float) -> float:
    if value is None:
        return default
    if not _positive(value):
        raise TaskError(f"{where}: {key} must be a positive number, not {value!r}")
    return float(value)


def task_from_row(row: dict[str, Any], index: int, base: Path, dataset: str, where: str) -> Task:
    """One row (a dict) as a task; paths resolved from ``base``."""
    where = f"{where} row {index}"
    name = row.get("name") or f"row-{index}"
    if not isinstance(name, str) or not _NAME.match(name):
        raise TaskError(f"{where}: name is letters, digits, '.', '_' and '-' (at most 128), not {name!r}")
    instruction, verifier = row.get("instruction"), row.get("verifier")
    if not isinstance(instruction, str):
        raise TaskError(f"{where}: no instruction (a string)")
    if verifier is not None and (not isinstance(verifier, str) or not verifier.strip()):
        raise TaskError(f"{where}: verifier must be a shell command that writes {VERIFIER_DIR}/reward.txt "
                        "(or none: the run's judge scores the row)")
    solution = row.get("solution")
    if solution is not None and not isinstance(solution, str):
        raise TaskError(f"{where}: solution must be a shell command")
    app = _row_path(row.get("folder"), "folder", base, where)
    tests = _row_path(row.get("tests"), "tests", base, where)
    h = hashlib.sha256(b"task-row\0")
    fields = {k: row.get(k) for k in ("name", "instruction", "verifier", "solution", "agent_timeout_s",
                                      "verifier_timeout_s")}
    h.update(json.dumps(fields, sort_keys=True).encode())
    for label, folder in (("folder", app), ("tests", tests)):
        h.update(f"\0{label}\0".encode())
        if folder is not None:
            tree_hash(folder, h)
    return Task(
        id=TaskId(dataset, name, _digest(h)),
        instruction=_instruction(instruction, Path(where)),
        verifier=verifier or "",
        app=app,
        tests=tests,
        solution=solution or None,
        agent_timeout_s=_row_timeout(row.get("agent_timeout_s"), "agent_timeout_s", where,
                                     DEFAULT_AGENT_TIMEOUT_S),
        verifier_timeout_s=_row_timeout(row.get("verifier_timeout_s"), "verifier_timeout_s", where,
                                        DEFAULT_VERIFIER_TIMEOUT_S),
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise TaskError(f"{path} line {n}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise TaskError(f"{path} line {n}: a row is a JSON object")
            rows.append(row)
            if len(rows) > MAX_TASKS:
                raise TaskError(f"{path}: more than {MAX_TASKS} rows")
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TaskError("parquet datasets need pyarrow: pip install 'steptap[env]'") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise TaskError(f"{path}: not a parquet file ({exc})") from None
    if table.num_rows > MAX_TASKS:
        raise TaskError(f"{path}: more than {MAX_TASKS} rows")
    return list(table.to_pylist())


# -- datasets ------------------------------------------------------------------------------------------------

def _unique(tasks: list[Task], where: Path) -> list[Task]:
    seen: set[str] = set()
    for task in tasks:
        if task.name in seen:
            raise TaskError(f"{where}: two tasks are named {task.name!r}")
        seen.add(task.name)
    return tasks


def load(path: str | Path, name: str | None = None) -> Dataset:
    """A dataset: a directory of Harbor task directories, one task directory, or a .jsonl / .parquet file of
    rows. ``name`` (default: the directory's or file's name) is the dataset part of each task's identity."""
    path = Path(path)
    if not path.exists():
        raise TaskError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix not in (".jsonl", ".parquet"):
            raise TaskError(f"{path}: a dataset is a directory of tasks, a .jsonl or a .parquet file")
        dataset = name or path.stem
        rows = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
        if not rows:
            raise TaskError(f"{path}: no rows")
        base = path.resolve().parent
        return Dataset(dataset, path, _unique(
            [task_from_row(row, i, base, dataset, str(path)) for i, row in enumerate(rows)], path))
    if is_task_dir(path):
        dataset = name or path.resolve().parent.name
        return Dataset(dataset, path, [load_task_dir(path, dataset)])
    dataset = name or path.resolve().name
    dirs = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".") and is_task_dir(p))
    if not dirs:
        raise TaskError(f"{path}: no task directories in it (each holds instruction.md and tests/test.sh)")
    if len(dirs) > MAX_TASKS:
        raise TaskError(f"{path}: more than {MAX_TASKS} tasks")
    return Dataset(dataset, path, _unique([load_task_dir(d, dataset) for d in dirs], path))
