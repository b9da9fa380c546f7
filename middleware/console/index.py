"""``RunIndex``: what the console lists and draws, kept from the log: a bounded summary of each finished
trajectory (where its record starts, so the viewer reads it back), every curation mark, and the mean reward
by policy version (train and eval). Loaded once at start (one scan, in a thread), then brought up to date
from the log when the console reads it (``current``: nothing runs per model call); marks are added as they
are written."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict, deque
from typing import Any

import msgspec

from steptap.middleware.curation import MAX_MARKS_PER_TRAJECTORY, CurationState, fold
from steptap.middleware.log.reader import Found, Skipped
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import (
    Curation,
    PolicyVersion,
    Step,
    StepVersions,
    Trajectory,
    newest_version,
    step_versions_decoder,
    trajectory_msgpack_decoder,
)

logger = logging.getLogger("steptap.console")

MAX_METADATA_CHARS = 2000  # a summary's metadata, as JSON, for listing and search (the viewer shows it all)
MAX_TASKS = 10_000  # the solve grid's tasks (each a few counters per policy version); the oldest go first
SOLVED_AT = 1.0  # a task episode solved it with a reward of at least this (steptap tasks' default threshold)


class Summary(msgspec.Struct, kw_only=True):
    id: str
    at: str  # the cursor where its Trajectory record starts
    group_id: str | None
    status: str
    mode: str
    reward: float
    rewards: dict[str, float]
    steps: int
    version: int  # the newest policy version among its steps
    created_at: float
    finished_at: float | None
    metadata: str  # JSON, cut at MAX_METADATA_CHARS
    error: str | None = None
    anonymous: bool = False
    task: tuple[str, str, str] | None = None  # a task episode's (dataset, name, hash): metadata["task"]
    infra_cause: str | None = None
    verdict: float = 0.0  # a task episode's score for the solve grid (task_verdict)


def task_of(metadata: dict[str, Any]) -> tuple[str, str, str] | None:
    """A task episode's identity from its metadata (``steptap tasks``), or None for any other session."""
    task = metadata.get("task")
    if isinstance(task, dict):
        parts = tuple(task.get(k) for k in ("dataset", "name", "hash"))
        if all(isinstance(p, str) and len(p) <= 256 for p in parts):
            return parts  # type: ignore[return-value]
    return None


def task_verdict(traj: Trajectory) -> float:
    """What a task episode scored, as ``steptap tasks`` counts its pass rate (docs/tasks.md): its verifier's
    rewards, i.e. the trajectory's but a judge's (a reward whose provenance names a rubric); an episode that a
    judge alone scored: the judge's."""
    judges = {name for name, p in traj.reward_provenance.items() if "rubric_sha256" in p}
    own = [v for name, v in traj.rewards.items() if name not in judges]
    return float(sum(own)) if own else traj.reward


def summarize(traj: Trajectory, at: str, version: int) -> Summary:
    meta = json.dumps(traj.metadata, default=str)
    return Summary(id=traj.id, at=at, group_id=traj.group_id, status=traj.status, mode=traj.mode,
                   reward=traj.reward, rewards=dict(traj.rewards),
                   steps=len(traj.step_refs) or len(traj.steps),
                   version=version, created_at=traj.created_at, finished_at=traj.finished_at,
                   metadata=meta[:MAX_METADATA_CHARS], error=traj.error, anonymous=traj.anonymous,
                   task=task_of(traj.metadata), infra_cause=traj.infra_cause, verdict=task_verdict(traj))


class RunIndex:
    def __init__(self, log: TrajectoryLog, max_trajectories: int = 20_000, max_marked: int = 100_000) -> None:
        self.log = log
        self.max_trajectories = max_trajectories
        self.max_marked = max_marked
        self.summaries: OrderedDict[str, Summary] = OrderedDict()
        self.marks: OrderedDict[str, list[Curation]] = OrderedDict()
        # mode -> version -> [reward sum, count]: the curves (kept for every trajectory, evicted or not)
        self.by_version: dict[str, dict[int, list[float]]] = {"train": {}, "eval": {}}
        # (mode, dataset, name, hash) -> version -> [episodes, solved, infrastructure errors]: the solve grid
        self.tasks: OrderedDict[tuple[str, str, str, str], dict[int, list[int]]] = OrderedDict()
        self.finished = 0
        self.swaps: deque[dict[str, Any]] = deque(maxlen=100)  # version, at (and pause times, seen live)
        self.cursor: str | None = None  # read up to here (``load``, then ``current``)
        self._reading = asyncio.Lock()

    # ---- building ----------------------------------------------------------------------------------------

    def load(self) -> str:
        """Scan the log (a thread, before serving): summaries and marks; the cursor to follow from."""
        end = self.log.end_cursor
        versions: dict[str, int] = {}  # an open trajectory's newest step version so far
        for at, record in self.log.located_records():
            if isinstance(record, Step):
                tid = record.trajectory_id
                versions[tid] = max(versions.get(tid, 0), newest_version(record))
            elif isinstance(record, Trajectory) and record.status != "running":
                version = versions.pop(record.id, max(map(newest_version, record.steps), default=0))
                self.add_trajectory(summarize(record, at, version))
            elif isinstance(record, Curation):
                self.add_mark(record)
            elif isinstance(record, PolicyVersion):
                self.swaps.append({"version": record.version, "at": record.at, "paused_s": None,
                                   "swap_s": None})
        self.cursor = end
        return end

    async def current(self) -> None:
        """Catch up with the log before a read: add each trajectory that finished since the last one. Run on
        a read of the console (its page polls every 2 s while open), never per model call: a follower woken
        by every commit cost each call a thread hop and a decode on the event loop (issue 45)."""
        if self.cursor is None or self.cursor == self.log.end_cursor:
            return
        async with self._reading:  # one catch-up at a time; a second reader waits for it and finds it done
            while self.cursor != self.log.end_cursor:
                summaries, cursor = await asyncio.to_thread(self._summaries_after, self.cursor)
                for summary in summaries:
                    self.add_trajectory(summary)
                if cursor == self.cursor:
                    break
                self.cursor = cursor

    def _summaries_after(self, cursor: str) -> tuple[list[Summary], str]:
        """Thread: the summaries of a chunk of the trajectories finished after ``cursor``; where it ends."""
        found, end = self.log.finished_after(cursor)
        out: list[Summary] = []
        for after, item in found:
            if isinstance(item, Skipped):
                logger.warning("console: an undecodable trajectory before %s left out", after)
                continue
            assert isinstance(item, Found)
            try:
                traj = trajectory_msgpack_decoder.decode(item.payload)
                # its steps' versions alone: a summary reads no prompt ids, and building them
                # (a session's first prompt whole) cost 0.36 ms per 20k ids
                steps: list[Step | StepVersions] = list(traj.steps)  # embedded (before v4)
                steps += [step_versions_decoder.decode(p) for p in item.steps]
                version = max(map(newest_version, steps), default=0)
            except (ValueError, msgspec.DecodeError) as exc:
                logger.warning("console: a trajectory before %s left out: %s", after, exc)
                continue
            out.append(summarize(traj, self.log.start_of(after, item.payload), version))
        return out, end

    def add_trajectory(self, summary: Summary) -> None:
        self.finished += 1
        self.summaries.pop(summary.id, None)  # a session id used again: the newer one
        self.summaries[summary.id] = summary
        while len(self.summaries) > self.max_trajectories:
            self.summaries.popitem(last=False)
        if summary.mode in self.by_version and summary.status == "finished":
            cell = self.by_version[summary.mode].setdefault(summary.version, [0.0, 0])
            cell[0] += summary.reward
            cell[1] += 1
        if summary.task is not None and summary.status in ("finished", "infra_error"):
            self._add_episode(summary)

    def _add_episode(self, s: Summary) -> None:
        assert s.task is not None
        key = (s.mode, *s.task)
        versions = self.tasks.setdefault(key, {})
        self.tasks.move_to_end(key)
        while len(self.tasks) > MAX_TASKS:
            self.tasks.popitem(last=False)
        cell = versions.setdefault(s.version, [0, 0, 0])
        if s.status == "infra_error":  # not an attempt: counted apart, never as a failure
            cell[2] += 1
        else:
            cell[0] += 1
            cell[1] += s.verdict >= SOLVED_AT

    def room_for_mark(self, tid: str) -> bool:
        return len(self.marks.get(tid, ())) < MAX_MARKS_PER_TRAJECTORY

    def add_mark(self, mark: Curation) -> None:
        marks = self.marks.setdefault(mark.trajectory_id, [])
        marks.append(mark)
        self.marks.move_to_end(mark.trajectory_id)
        while len(self.marks) > self.max_marked:
            self.marks.popitem(last=False)

    # ---- reading -----------------------------------------------------------------------------------------

    def state(self, tid: str) -> CurationState:
        return fold(self.marks.get(tid, []))

    def task_grid(self) -> dict[str, Any]:
        """The solve grid: each task's episodes, solved ones and infrastructure errors per policy version."""
        rows = [{"mode": mode, "dataset": dataset, "name": name, "hash": hash_,
                 "versions": {str(v): {"episodes": n, "solved": ok, "infra_errors": bad}
                              for v, (n, ok, bad) in sorted(versions.items())}}
                for (mode, dataset, name, hash_), versions in sorted(self.tasks.items())]
        versions = sorted({v for versions in self.tasks.values() for v in versions})
        return {"tasks": rows, "versions": versions, "solved_at": SOLVED_AT}

    def curve(self, mode: str) -> list[dict[str, float]]:
        """Mean reward per policy version, in version order."""
        return [{"version": v, "mean": s / n, "n": n}
                for v, (s, n) in sorted(self.by_version[mode].items()) if n]

    def query(self, *, group: str | None = None, status: str | None = None, mode: str | None = None,
              min_reward: float | None = None, max_reward: float | None = None, text: str | None = None,
              tag: str | None = None, excluded: bool | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Finished trajectories matching every filter given, newest first (at most ``limit``)."""
        out: list[dict[str, Any]] = []
        for s in reversed(self.summaries.values()):
            if len(out) >= limit:
                break
            if ((group is not None and s.group_id != group) or (status is not None and s.status != status)
                    or (mode is not None and s.mode != mode)
                    or (min_reward is not None and s.reward < min_reward)
                    or (max_reward is not None and s.reward > max_reward)):
                continue
            cur = self.state(s.id)
            if tag is not None and tag not in cur.tags:
                continue
            if excluded is not None and cur.excluded != excluded:
                continue
            if text and text.lower() not in f"{s.id} {s.group_id or ''} {s.metadata}".lower():
                continue
            out.append({**msgspec.to_builtins(s), "curation": msgspec.to_builtins(cur)})
        return out

    async def trajectory(self, tid: str) -> Trajectory | None:
        """The finished trajectory ``tid`` read back from the log (None: unknown, or compacted away)."""
        s = self.summaries.get(tid)
        if s is None:
            return None
        try:
            return await asyncio.to_thread(self.log.trajectory_at, s.at)
        except (ValueError, msgspec.DecodeError):
            return None
