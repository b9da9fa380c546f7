"""``steptap tasks check``: each task's reference solution passes its verifier, and doing nothing fails it.

Both run as an episode would, without a model: a fresh copy of the working folder, the solution
(``solution/solve.sh``, at /solution) or nothing in the agent's place, in the same sandbox, then the verifier.
A task passes the check when the solution's reward reaches the threshold and the no-op's does not; a task
without a solution, a verifier that crashes or times out, or a sandbox that does not start fails it, with the
reason. No proxy is needed. With ``--sandbox harbor`` both are Harbor trials in the task's container
(Harbor's ``oracle`` and ``nop`` agents).
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path

from steptap.adapters.tasks import containers
from steptap.adapters.tasks.containers import HarborSettings
from steptap.adapters.tasks.episode import Infra, read_verdict, run_verifier
from steptap.adapters.tasks.format import SOLUTION_DIR, Task
from steptap.adapters.tasks.sandbox import Job, Mount, Sandbox, copy_tree, search_path


@dataclass
class Checked:
    task: str
    solution: float | None = None  # the reference solution's reward
    noop: float | None = None  # doing nothing's
    problem: str | None = None  # why the check failed (None: it passed)

    @property
    def ok(self) -> bool:
        return self.problem is None


async def _attempt(sb: Sandbox, task: Task, folder: Path, solve: bool, timeout: float | None,
                   harbor: HarborSettings | None = None) -> float:
    """One attempt's reward: the solution (or nothing), then the verifier; ``Infra`` when either fails."""
    shutil.rmtree(folder, ignore_errors=True)
    if harbor is not None:
        return await containers.reference(task, harbor, folder, solve)
    folder.mkdir(parents=True)
    copy_tree(task.app, folder / "app", task.app_exclude)
    sb.own(folder / "app")
    if solve and task.solution is not None:
        mounts = [Mount(folder / "app", task.workdir, True)]
        if task.solution_dir is not None:
            mounts.append(Mount(task.solution_dir, SOLUTION_DIR))
        env = {"PATH": search_path(), "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
               **task.solution_env}
        ended = await sb.run(Job(argv=["sh", "-c", task.solution], cwd=task.workdir, env=env, mounts=mounts,
                                 timeout_s=timeout or task.agent_timeout_s, hostname="solution",
                                 log=folder / "solution.log"))
        if not ended.started:
            raise Infra("sandbox", f"the solution's sandbox did not start: {ended.error}")
        if ended.timed_out or ended.exit_code != 0:
            why = "timed out" if ended.timed_out else f"exited {ended.exit_code}"
            last = (ended.output.strip().splitlines() or [""])[-1]
            raise Infra("other", f"the reference solution {why}: {last[:300]}")
    v_timeout = task.verifier_timeout_s
    ended = await run_verifier(sb, task, folder, v_timeout)
    rewards = read_verdict(folder / "verifier", ended, v_timeout)
    return float(sum(rewards.values()))


async def check_task(sb: Sandbox, task: Task, work: Path, threshold: float,
                     timeout: float | None = None, harbor: HarborSettings | None = None) -> Checked:
    out = Checked(task.name)
    if not task.verifier:
        out.problem = "no verifier: a judge scores it (steptap tasks run --reward-judge), nothing to check"
        return out
    if task.solution is None:
        out.problem = "no reference solution (solution/solve.sh)"
        return out
    try:
        out.solution = await _attempt(sb, task, work / task.name / "solution", True, timeout, harbor)
        out.noop = await _attempt(sb, task, work / task.name / "noop", False, timeout, harbor)
    except Infra as exc:
        out.problem = str(exc)
        return out
    if out.solution < threshold:
        out.problem = f"the reference solution's reward {out.solution:g} is below {threshold:g}"
    elif out.noop >= threshold:
        out.problem = f"doing nothing passes (reward {out.noop:g})"
    return out


async def check_all(sb: Sandbox, tasks: list[Task], work: Path, threshold: float, concurrency: int,
                    timeout: float | None = None, harbor: HarborSettings | None = None) -> list[Checked]:
    slots = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> Checked:
        async with slots:
            return await check_task(sb, task, work, threshold, timeout, harbor)

    return list(await asyncio.gather(*(one(t) for t in tasks)))
