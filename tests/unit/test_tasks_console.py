"""The console's task solve grid (middleware/console/index.py, ``GET /console/api/tasks``): task episodes
counted by their metadata's task identity and policy version, infrastructure errors apart; each episode's
agent and verifier output in the trajectory the viewer reads."""

from __future__ import annotations

import asyncio
from typing import Any

from steptap.middleware.client import SteptapClient
from steptap.middleware.records import ProcessEnd, TaskRun

TASK = {"dataset": "suite", "name": "answer", "hash": "0123456789abcdef"}


async def _grid(http: Any, proxy: Any, episodes: int) -> dict[str, Any]:
    for _ in range(2000):  # each read brings the index up to date from the log
        async with http.get(f"{proxy.url}/console/api/tasks", headers=proxy.control) as resp:
            assert resp.status == 200
            grid = await resp.json()
        cells = [c for t in grid["tasks"] for c in t["versions"].values()]
        counted = sum(c["episodes"] + c["infra_errors"] for c in cells)
        if counted >= episodes:
            return dict(grid)
        await asyncio.sleep(0.05)
    raise AssertionError(f"the grid never counted {episodes} episodes: {grid}")


async def test_the_solve_grid_counts_episodes_by_task_and_version(make_proxy: Any, http: Any) -> None:
    proxy = await make_proxy("http://127.0.0.1:9")
    run = TaskRun(verifier=ProcessEnd(exit_code=0, seconds=0.4, output="1 passed in 0.01s"))
    async with SteptapClient(proxy.url, proxy.token) as client:
        for k, (reward, status) in enumerate([(1.0, "finished"), (0.0, "finished"), (None, "infra_error")]):
            s = await client.open_session(group_id="g", group_size=3,
                                          metadata={"task": TASK, "episode": k})
            await client.finish(s.id, reward=reward, status=status, task_run=run,
                                error="the verifier crashed" if reward is None else None,
                                infra_cause="verifier_crash" if reward is None else None)
        plain = await client.open_session()  # not a task episode: not in the grid
        await client.finish(plain.id, reward=1.0)
        last = s.id
    grid = await _grid(http, proxy, 3)
    assert grid == {"tasks": [{"mode": "train", **TASK, "versions": {
        "0": {"episodes": 2, "solved": 1, "infra_errors": 1}}}], "versions": [0], "solved_at": 1.0}
    async with http.get(f"{proxy.url}/console/api/sessions/{last}", headers=proxy.control) as resp:
        traj = await resp.json()
    assert traj["status"] == "infra_error" and traj["infra_cause"] == "verifier_crash"
    assert traj["task_run"]["verifier"]["output"] == "1 passed in 0.01s"
    url = f"{proxy.url}/console/api/sessions?status=infra_error"
    async with http.get(url, headers=proxy.control) as resp:
        listed = (await resp.json())["sessions"]
    assert [r["id"] for r in listed] == [last] and listed[0]["infra_cause"] == "verifier_crash"


async def test_the_solve_grid_reads_the_verifiers_verdict_not_a_judges(make_proxy: Any, http: Any) -> None:
    """A judge's reward beside the verifier's (``steptap tasks run --reward-judge``) trains but does not solve
    a task: the grid reads the verifier's rewards; an episode scored by a judge alone, the judge's."""
    proxy = await make_proxy("http://127.0.0.1:9")
    judge = {"model": "tiny", "rubric_sha256": "ab" * 32}
    async with SteptapClient(proxy.url, proxy.token) as client:
        for k, (verifier, judged) in enumerate([(0.0, 7.0), (1.0, 2.0), (None, 4.0), (None, 0.5)]):
            s = await client.open_session(metadata={"task": TASK, "episode": k})
            await client.add_reward(s.id, judged, name="judge", provenance=judge)
            await client.finish(s.id, reward=verifier)
            if k == 0:
                traj = await client.get_session(s.id)
                assert traj.reward == 7.0  # what trains: the sum
    grid = await _grid(http, proxy, 4)
    assert grid["tasks"][0]["versions"] == {"0": {"episodes": 4, "solved": 2, "infra_errors": 0}}
