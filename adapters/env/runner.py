"""Running a dataset through the proxy: GRPO groups of sessions, resumable, and evaluation by policy version.

Each row (times ``epochs``) becomes one group of ``n`` sessions (``group_id`` per row and epoch,
``group_size=n``); at most ``concurrency`` episodes run at once. With a state file, each finished group is
appended to it (one JSON line, fsync'd), and a restarted run skips the groups it lists: finished rows are
never redone. A group counts as finished once every member's session was closed (``finished`` or
``aborted``); one whose sessions could not even be opened (proxy down) is not written and is run again next
time.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from steptap.adapters.env.base import AgentEnv
from steptap.adapters.env.dataset import Row, resolve_env
from steptap.adapters.env.loop import AgentEnvLoop, AgentFlowBase, FlowContext
from steptap.adapters.env.tally import Episode, Tally, accuracy_by_version
from steptap.adapters.session import MODEL_ENV, async_session, served_model


@dataclass
class RunConfig:
    proxy_url: str
    control_token: str
    n: int = 1  # members per group
    concurrency: int = 16  # episodes at once
    epochs: int = 1
    mode: str = "train"  # "eval": never trained on
    env: str | Callable[[], Any] | None = None  # overrides each row's agent_name (a name, or a factory)
    trust_dataset_code: bool = False  # rows' agent_name may name module:attr / file.py:attr (imported)
    model: str | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    max_steps: int | None = None  # overrides the environment's
    state_file: str | None = None
    idle_timeout_s: float | None = 600.0
    name: str = "data"  # group ids start with it
    keep_episodes: int = 10_000  # Episode objects kept in DatasetRunner.episodes (counts cover them all)
    judge: Any = None  # a judge (adapters/judge.py) scoring each episode besides its environment's reward
    lockstep: int = 0  # groups a batch, then wait for the update they feed (0: every group at once)
    update_timeout_s: float = 3600.0  # lockstep: how long a batch waits for its update before going on


def as_flow(obj: Any) -> AgentFlowBase:
    if isinstance(obj, AgentFlowBase):
        return obj
    if isinstance(obj, AgentEnv):
        return AgentEnvLoop(lambda: obj)
    raise TypeError(
        f"an environment factory must return an AgentEnv or an AgentFlowBase, got {type(obj).__name__}"
    )


def _total(reward: Any) -> float | None:
    if reward is None:
        return None
    if isinstance(reward, dict):
        return float(sum(float(v) for v in reward.values()))
    return float(reward)


def policy_version(url: str, token: str) -> int | None:
    """The proxy's policy version now (a 503's body has it too); None when it does not answer."""
    from steptap.middleware.client import SteptapError, SyncSteptapClient

    try:
        return int(SyncSteptapClient(url, token).health().get("policy_version", 0))
    except (OSError, ValueError, TypeError, SteptapError):
        return None


LOCKSTEP_POLL_S = 1.0  # how often a lockstep batch asks the proxy for the policy version


class DatasetRunner:
    def __init__(
        self, rows: list[Row], cfg: RunConfig, on_episode: Callable[[Episode], None] | None = None
    ) -> None:
        if cfg.n < 1 or cfg.concurrency < 1 or cfg.epochs < 1:
            raise ValueError("n, concurrency and epochs must be at least 1")
        self.rows, self.cfg, self.on_episode = rows, cfg, on_episode
        self.episodes: list[Episode] = []  # the first cfg.keep_episodes, for callers that want details
        self.tally = Tally()
        self.done = self._load_state()
        self._factories: dict[str, Any] = {}
        self._model: str | None = cfg.model or os.environ.get(MODEL_ENV)
        self._model_lock = asyncio.Lock()

    # ---- the durable state -------------------------------------------------------------------------------

    def _load_state(self) -> set[tuple[int, int]]:
        path = self.cfg.state_file
        if not path or not Path(path).exists():
            return set()
        done = set()
        for line in Path(path).read_text().splitlines():
            try:
                rec = json.loads(line)
                done.add((int(rec["epoch"]), int(rec["row"])))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash: that group is redone
        return done

    def _record(self, epoch: int, row: int, members: list[Episode]) -> None:
        if not self.cfg.state_file:
            return
        line = json.dumps(
            {
                "epoch": epoch,
                "row": row,
                "group_id": members[0].group_id,
                "rewards": [m.reward for m in members],
                "statuses": [m.status for m in members],
            }
        )
        with open(self.cfg.state_file, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def todo(self) -> list[tuple[int, Row]]:
        return [(e, r) for e in range(self.cfg.epochs) for r in self.rows if (e, r.index) not in self.done]

    # ---- running -----------------------------------------------------------------------------------------

    async def run(self) -> list[Episode]:
        cfg = self.cfg
        if cfg.state_file:
            Path(cfg.state_file).parent.mkdir(parents=True, exist_ok=True)
        member_slots = asyncio.Semaphore(cfg.concurrency)
        group_slots = asyncio.Semaphore(-(-cfg.concurrency // cfg.n) + 1)  # bounds the tasks in flight
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        from steptap.middleware.client import SteptapClient

        todo = self.todo()
        size = cfg.lockstep or len(todo) or 1
        batches = [todo[i:i + size] for i in range(0, len(todo), size)]
        async with aiohttp.ClientSession(timeout=timeout) as http:
            client = SteptapClient(cfg.proxy_url, cfg.control_token, session=http)
            tasks: set[asyncio.Task[None]] = set()
            try:
                for k, batch in enumerate(batches):
                    before = await self._version() if cfg.lockstep else None
                    for epoch, row in batch:
                        await group_slots.acquire()
                        task = asyncio.create_task(self._group(http, client, member_slots, epoch, row))
                        task.add_done_callback(lambda _t: group_slots.release())
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    if cfg.lockstep and k < len(batches) - 1:
                        if tasks:
                            await asyncio.gather(*tasks)
                        await self._wait_update(before, k)
                if tasks:
                    await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
        return self.episodes

    async def _version(self) -> int | None:
        return await asyncio.to_thread(policy_version, self.cfg.proxy_url, self.cfg.control_token)

    async def _wait_update(self, before: int | None, batch: int) -> None:
        """Lockstep: after a batch, wait until the policy version passes ``before`` (the learner trained on
        the batch and the new weights serve), so the next batch is sampled by them and the learner trains
        with the machine to itself; past ``update_timeout_s``, or with no version to compare, go on."""
        t0 = time.monotonic()
        while before is not None and time.monotonic() - t0 < self.cfg.update_timeout_s:
            now = await self._version()
            if now is not None and now > before:
                self.tally.waited(time.monotonic() - t0, timed_out=False)
                print(f"steptap env run: lockstep batch {batch}: version {now} after "
                      f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
                return
            await asyncio.sleep(LOCKSTEP_POLL_S)
        self.tally.waited(time.monotonic() - t0, timed_out=before is not None)
        print(f"steptap env run: lockstep batch {batch}: no new policy version after "
              f"{time.monotonic() - t0:.0f} s; going on", file=sys.stderr, flush=True)

    async def _group(
        self, http: aiohttp.ClientSession, client: Any, slots: asyncio.Semaphore, epoch: int, row: Row
    ) -> None:
        group_id = f"{self.cfg.name}-e{epoch}-r{row.index}-{uuid.uuid4().hex[:6]}"

        async def member(i: int) -> Episode:
            async with slots:
                return await self._episode(http, client, epoch, row, i, group_id)

        members = list(await asyncio.gather(*(member(i) for i in range(self.cfg.n))))
        if all(m.status for m in members):
            self._record(epoch, row.index, members)

    async def _resolve_model(self, session: Any) -> str:
        async with self._model_lock:
            if self._model is None:
                self._model = await asyncio.to_thread(served_model, session.base_url, session.api_key)
        return self._model

    def _factory(self, row: Row) -> Any:
        if callable(self.cfg.env):
            return self.cfg.env
        name = self.cfg.env or row.agent_name
        if not name:
            raise ValueError(f"row {row.index} has no agent_name and no --env was given")
        if name not in self._factories:  # --env is the user's own; a row's name is the dataset's
            allow_code = bool(self.cfg.env) or self.cfg.trust_dataset_code
            try:
                self._factories[name] = resolve_env(name, allow_code=allow_code)
            except ValueError as exc:
                raise ValueError(f"row {row.index}: {exc}") from None
        return self._factories[name]

    async def _episode(
        self, http: aiohttp.ClientSession, client: Any, epoch: int, row: Row, index: int, group_id: str
    ) -> Episode:
        cfg = self.cfg
        ep = Episode(epoch=epoch, row=row.index, member=index, group_id=group_id)
        try:
            flow = as_flow(self._factory(row)())
            async with async_session(
                cfg.proxy_url,
                cfg.control_token,
                client=client,
                group_id=group_id,
                group_size=cfg.n,
                mode=cfg.mode,
                metadata=self._metadata(epoch, row, index),
                idle_timeout_s=cfg.idle_timeout_s,
            ) as s:
                ep.session_id = s.id
                ctx = FlowContext(
                    http,
                    s,
                    await self._resolve_model(s),
                    {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature},
                )
                if cfg.max_steps is not None and isinstance(flow, AgentEnvLoop):
                    flow.max_steps = cfg.max_steps
                try:
                    reward, info = await flow.run(
                        ctx, prompt=row.prompt, reward_model=row.reward_model, **row.env_kwargs
                    )
                finally:
                    ep.steps, ep.step_rewards = ctx.calls, list(ctx.step_rewards)
                await self._rewarded(client, s, ep, reward, info)
            ep.status = s.status or ""
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad episode must not end the run; it is reported
            ep.error = f"{type(exc).__name__}: {exc}"
            if ep.session_id:
                ep.status = "aborted"
        self.tally.add(ep)
        if len(self.episodes) < self.cfg.keep_episodes:
            self.episodes.append(ep)
        if self.on_episode is not None:
            self.on_episode(ep)
        return ep

    def _metadata(self, epoch: int, row: Row, index: int) -> dict[str, Any]:
        """The session's metadata: the task, the dataset row and the episode's place in it."""
        cfg = self.cfg
        name = cfg.env if isinstance(cfg.env, str) else row.agent_name
        return {
            "task": name or getattr(cfg.env, "__name__", None),
            "dataset": cfg.name,
            "row": row.index,
            "epoch": epoch,
            "member": index,
            "reward_model": row.reward_model,
            "env_kwargs": row.env_kwargs,
            **{k: v for k, v in row.extra.items() if isinstance(v, (str, int, float, bool))},
        }

    async def _rewarded(self, client: Any, s: Any, ep: Episode, reward: Any, info: dict[str, Any]) -> None:
        """The flow's reward (a number or named parts) and the judge's onto the session; the episode's
        total, correctness and (eval) the version that sampled it."""
        cfg = self.cfg
        if isinstance(reward, dict):
            for part, value in reward.items():
                s.set_reward(float(value), name=str(part))
        elif reward is not None:
            s.set_reward(float(reward))
        if cfg.judge is not None:  # JudgeError: the session ends aborted with it (an infra failure)
            judged = (await cfg.judge.reward(client, s.id)).rewards
            if None in judged:  # counted in the episode's reward, as the proxy sums them
                reward = {**(reward if isinstance(reward, dict) else {} if reward is None
                             else {"reward": reward}), cfg.judge.cfg.name: judged[None]}
        ep.reward, ep.info = _total(reward), dict(info)
        correct = info.get("correct")
        ep.correct = (
            bool(correct)
            if isinstance(correct, bool)
            else (ep.reward is not None and ep.reward >= 1.0)
        )
        if cfg.mode == "eval":
            traj = await s.trajectory()
            ep.policy_version = traj.steps[-1].policy_version if traj.steps else None


__all__ = ["DatasetRunner", "Episode", "RunConfig", "Tally", "accuracy_by_version", "as_flow",
           "policy_version"]
