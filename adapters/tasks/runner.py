"""A task run: each task a GRPO group of ``n`` episodes per round, at most ``concurrency`` at once, resumable.

The run directory holds ``run.json`` (the run's id and settings), ``state.jsonl`` (one line per episode
attempt that ended, fsync'd) and the episodes' folders. A group's id is fixed by the run, the task and the
round, so a run started again after a crash or Ctrl-C runs only the episodes without a verdict (none, or an
infrastructure error), in the groups they belong to, and the learner completes those groups as if nothing
happened. An infrastructure error is no member of its group (docs/tasks.md): the episode is run again in its
place, up to ``infra_retries`` times in a run; a group still short is trained on the members it has once the
learner's group timeout passes (when at least its ``min_group_members`` are there; else it is dropped and
counted), and the run's summary counts both.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

from steptap.adapters.tasks.episode import Episode, Result, Settings
from steptap.adapters.tasks.format import Task
from steptap.middleware.files import append_durable, atomic_write

VERDICT = ("finished", "aborted")  # an episode with one of these is done; any other is run again


class RunDirError(ValueError):
    """The run directory holds another run: one line for the user."""


@dataclass
class Plan:
    """The run's shape, kept in run.json: a resumed run must have the same."""

    run_id: str
    dataset: str
    n: int
    rounds: int
    mode: str
    agent: str | None
    created: float
    judge: str | None = None  # the judge's rubric's sha256 (--reward-judge): a resumed run is judged alike


def open_run(run_dir: Path, plan: Plan, fresh: bool) -> Plan:
    """The run directory's plan: made for a new run, read back (and checked against ``plan``) to resume."""
    path = run_dir / "run.json"
    if fresh and run_dir.exists():
        for name in ("run.json", "state.jsonl"):
            (run_dir / name).unlink(missing_ok=True)
    if path.exists():
        try:
            held = Plan(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise RunDirError(f"{path}: not a task run's file ({exc}); use another --run-dir") from None
        for key in ("dataset", "n", "rounds", "mode", "agent", "judge"):
            if getattr(held, key) != getattr(plan, key):
                raise RunDirError(f"{run_dir} holds a run with {key} {getattr(held, key)!r}, not "
                                  f"{getattr(plan, key)!r}: resume it as it was, or pass --fresh or another "
                                  "--run-dir")
        return held
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(asdict(plan), indent=2) + "\n", mode=0o644)
    return plan


def load_state(run_dir: Path) -> list[dict[str, Any]]:
    """Every episode attempt recorded so far (a line cut by a crash is skipped: that attempt is redone)."""
    path = run_dir / "state.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and {"task", "hash", "round", "index", "status"} <= rec.keys():
            out.append(rec)
    return out


def state_line(r: Result) -> dict[str, Any]:
    return {"task": r.task, "hash": r.hash, "round": r.round, "index": r.index, "attempt": r.attempt,
            "group_id": r.group_id, "session_id": r.session_id, "status": r.status, "reward": r.reward,
            "rewards": r.rewards, "infra_cause": r.infra_cause, "error": r.error, "steps": r.steps,
            "calls": r.calls, "policy_version": r.policy_version, "judge": r.judged,
            "agent": msgspec.to_builtins(r.agent) if r.agent else None, "at": time.time()}


def _key(rec: dict[str, Any]) -> tuple[str, str, int, int]:
    return rec["task"], rec["hash"], int(rec["round"]), int(rec["index"])


class TaskRunner:
    def __init__(self, tasks: list[Task], settings: Settings, client: Any, *, rounds: int = 1,
                 concurrency: int = 4, infra_retries: int = 1,
                 on_result: Callable[[dict[str, Any]], None] | None = None) -> None:
        if settings.n < 1 or rounds < 1 or concurrency < 1 or infra_retries < 0:
            raise ValueError("n, rounds and concurrency must be at least 1, infra_retries at least 0")
        problem = unscored(tasks, settings.judge)
        if problem:
            raise ValueError(problem)
        self.tasks, self.s, self.client = tasks, settings, client
        self.rounds, self.concurrency, self.infra_retries = rounds, concurrency, infra_retries
        self.on_result = on_result
        self.state = load_state(settings.run_dir)
        self.results: list[dict[str, Any]] = []  # this invocation's lines
        self.not_started = self.infra_errors = 0

    def todo(self) -> list[tuple[int, Task, int, int]]:
        """(round, task, episode index, next attempt) of every episode without a verdict."""
        done = {_key(r) for r in self.state if r["status"] in VERDICT}
        attempts: dict[tuple[str, str, int, int], int] = {}
        for r in self.state:
            attempts[_key(r)] = max(attempts.get(_key(r), -1), int(r.get("attempt", 0)))
        out = []
        for rnd in range(self.rounds):
            for task in self.tasks:
                for k in range(self.s.n):
                    key = (task.name, task.id.hash, rnd, k)
                    if key not in done:
                        out.append((rnd, task, k, attempts.get(key, -1) + 1))
        return out

    def group_id(self, task: Task, rnd: int) -> str:
        return f"{self.s.run_id}-{task.name}-{task.id.hash[:8]}-r{rnd}"

    async def run(self) -> list[dict[str, Any]]:
        slots = asyncio.Semaphore(self.concurrency)
        feed = asyncio.Semaphore(2 * self.concurrency)  # tasks in flight: a large dataset is not all at once
        running: set[asyncio.Task[None]] = set()
        try:
            for rnd, task, k, attempt in self.todo():
                await feed.acquire()
                t = asyncio.create_task(self._episode(slots, rnd, task, k, attempt))
                running.add(t)
                t.add_done_callback(running.discard)
                t.add_done_callback(lambda _: feed.release())
            while running:
                await asyncio.gather(*list(running))
        finally:
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        return self.results

    async def _episode(self, slots: asyncio.Semaphore, rnd: int, task: Task, k: int, attempt: int) -> None:
        for tries in range(self.infra_retries + 1):
            episode = Episode(self.s, self.client, task, self.group_id(task, rnd), rnd, k, attempt + tries)
            try:
                async with slots:
                    result = await episode.run()
            except asyncio.CancelledError:  # its session finished as interrupted: recorded, run on resume
                if episode.r.status:
                    self._record(episode.r)
                raise
            if not result.status:  # no session (the proxy is gone): not recorded, run again on resume
                self.not_started += 1
                return
            self._record(result)
            if result.status != "infra_error":
                return

    def _record(self, result: Result) -> None:
        line = state_line(result)
        append_durable(self.s.run_dir / "state.jsonl", json.dumps(line) + "\n", mode=0o644)
        self.state.append(line)
        self.results.append(line)
        self.infra_errors += result.status == "infra_error"
        if self.on_result is not None:
            self.on_result(line)


def unscored(tasks: list[Task], judge: Any) -> str | None:
    """Why the run cannot score its tasks (a task with no verifier, and no judge), or None."""
    bare = [t.name for t in tasks if not t.verifier]
    if bare and judge is None:
        return (f"{len(bare)} task(s) have no verifier ({', '.join(bare[:3])}): give --reward-judge RUBRIC "
                "to have a judge score them (docs/judge.md)")
    return None


def new_run_id() -> str:
    return f"tasks-{uuid.uuid4().hex[:10]}"
