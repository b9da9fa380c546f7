"""One episode's life: a session, a fresh copy of the task's folder, the agent in its sandbox on its own
session URL, then (only once the agent is gone) the verifier with the task's tests, and its reward finishing
the session, or an infrastructure error with its reason (docs/tasks.md). With a judge (``Settings.judge``,
docs/judge.md) the judge then scores the session too: its reward is a named one beside the verifier's (a task
with no verifier is scored by the judge alone), and a judge that fails is an infrastructure error
(``reward_unavailable``), never a 0.

An episode's folders live under the run directory (``episodes/<task>/r<round>-e<index>-a<attempt>/``): ``app``
(the working folder, mounted where the task expects it, /app by default), ``home`` (the agent's HOME, at
/home/agent inside, never under /tmp: Codex refuses a CODEX_HOME there), then ``tests`` and ``verifier``
(/tests and /logs/verifier, made only after the agent exited, so nothing it wrote can be read as a reward),
and the logs of both processes. ``app`` and ``home`` are removed after the verifier unless the run keeps
them. The socket the bridge serves is in a private folder of its own under the temporary folder (a socket's
path is short).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from steptap.adapters import agents
from steptap.adapters.judge import Judge, JudgeError
from steptap.adapters.run_reward import parse_reward, read_small_file
from steptap.adapters.runner import explain, session_env
from steptap.adapters.tasks import containers
from steptap.adapters.tasks.bridge import Bridge
from steptap.adapters.tasks.containers import HarborSettings
from steptap.adapters.tasks.format import TESTS_DIR, VERIFIER_DIR, Task
from steptap.adapters.tasks.sandbox import PORT, Ended, Job, Mount, Sandbox, copy_tree, search_path
from steptap.middleware.records import ProcessEnd, TaskRun

INSIDE_HOME = "/home/agent"
MAX_REASON = 1500  # characters of an infrastructure error's reason


@dataclass
class Settings:
    """What every episode of a run shares."""

    proxy_url: str
    sandbox: Sandbox
    run_dir: Path
    n: int = 1  # episodes per group
    agent: str | None = None  # an agent CLI by name, or
    command: list[str] = field(default_factory=list)  # a command taking the instruction
    cli: Path | None = None
    model: str | None = None
    mode: Literal["train", "eval"] = "train"
    train: Literal["main", "all"] = "main"
    idle_timeout_s: float | None = None
    agent_timeout_s: float | None = None  # overrides each task's
    verifier_timeout_s: float | None = None
    keep: bool = False  # keep each episode's app and home folders
    run_id: str = ""
    harbor: HarborSettings | None = None  # episodes as Harbor trials in containers (containers.py)
    judge: Judge | None = None  # scores each session after its verifier (adapters/judge.py)


@dataclass
class Result:
    task: str
    hash: str
    round: int
    index: int
    attempt: int
    group_id: str
    session_id: str = ""
    status: str = ""  # finished | aborted | infra_error | "" (no session opened)
    rewards: dict[str, float] = field(default_factory=dict)
    infra_cause: str | None = None
    error: str | None = None
    steps: int | None = None
    calls: int = 0  # model calls the bridge passed on
    agent: ProcessEnd | None = None
    verifier: ProcessEnd | None = None
    policy_version: int | None = None  # its last step's (eval runs)
    verified: float | None = None  # the verifier's reward (the sum of its named ones); None: no verifier ran
    judged: dict[str, float] | None = None  # the judge's scores: "trajectory", or a step's index, -> score

    @property
    def reward(self) -> float | None:
        """The episode's verdict (pass rate, mean reward): the verifier's reward when it ran, else the judge's
        (per step: the mean of its steps'), else the session's rewards' sum."""
        if self.status != "finished":
            return None
        if self.verified is not None:
            return self.verified
        if self.judged:
            return float(sum(self.judged.values()) / len(self.judged))
        return float(sum(self.rewards.values())) if self.rewards else None


class Infra(Exception):
    """An infrastructure failure: the episode is recorded as ``infra_error`` with this cause."""

    def __init__(self, cause: str, reason: str) -> None:
        super().__init__(reason)
        self.cause = cause


def _end(e: Ended) -> ProcessEnd:
    return ProcessEnd(exit_code=e.exit_code, timed_out=e.timed_out, seconds=e.seconds, output=e.output)


def _relocate(env: dict[str, str], host: Path, inside: str) -> dict[str, str]:
    """The agent's settings name its home as written on the host; inside, that folder is ``inside``."""
    return {k: inside + v[len(str(host)):] if v.startswith(str(host)) else v for k, v in env.items()}


class Episode:
    def __init__(self, settings: Settings, client: Any, task: Task, group_id: str, round_: int, index: int,
                 attempt: int) -> None:
        self.s, self.client, self.task = settings, client, task
        self.r = Result(task.name, task.id.hash, round_, index, attempt, group_id)
        self.dir = settings.run_dir / "episodes" / task.name / f"r{round_}-e{index}-a{attempt}"

    async def run(self) -> Result:
        r = self.r
        meta = {"task": self.task.id.metadata(), "episode": r.index, "round": r.round, "attempt": r.attempt,
                "run": self.s.run_id}
        try:
            info = await self.client.open_session(
                group_id=r.group_id, group_size=self.s.n, mode=self.s.mode, metadata=meta,
                idle_timeout_s=self.s.idle_timeout_s or self._idle_timeout(), train=self.s.train,
                side_models=agents.side_models(self.s.agent) or None)
        except Exception as exc:  # noqa: BLE001 - the proxy went away: this episode is not started
            r.error = explain(exc, self.s.proxy_url)
            return r
        r.session_id = info.id
        try:
            await self._phases(info)
        except asyncio.CancelledError:
            # not the agent's failure: never trained, and run again when the run resumes. The finish is seen
            # through even if the runner cancels again meanwhile, so the runner can record it
            finish = asyncio.ensure_future(self._finish("infra_error", error="the run was interrupted",
                                                        cause="interrupted"))
            while not finish.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(finish)
            raise
        except Infra as exc:
            await self._finish("infra_error", error=str(exc)[:MAX_REASON], cause=exc.cause)
        except Exception as exc:  # noqa: BLE001 - a host-side failure (disk full, ...) is not the agent's
            why = f"{type(exc).__name__}: {exc}"[:MAX_REASON]
            await self._finish("infra_error", error=why, cause="other")
        finally:
            if not self.s.keep:
                for name in ("app", "home"):
                    shutil.rmtree(self.dir / name, ignore_errors=True)
        return r

    def _idle_timeout(self) -> float:
        """Long enough for the agent and the verifier (the runner finishes the session itself); a session a
        crashed runner left open is closed by the proxy once it passed."""
        agent = self.s.agent_timeout_s or self.task.agent_timeout_s
        return agent + (self.s.verifier_timeout_s or self.task.verifier_timeout_s) + 600.0

    async def _phases(self, info: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        if self.s.harbor is not None:
            rewards = await containers.episode(self, info, self.s.harbor)
        else:
            await self._agent(info)
            rewards = await self._verify() if self.task.verifier else {}
        if rewards:
            self.r.verified = float(sum(rewards.values()))
        if self.s.judge is not None:  # after the verifier (its failure spares the judge's calls)
            await self._judge(self.s.judge)
        named = {k: v for k, v in rewards.items() if k is not None}
        for name, value in named.items():
            await self.client.add_reward(self.r.session_id, value, name=name)
        await self._finish("finished", reward=rewards.get(None))

    async def _judge(self, judge: Judge) -> None:
        """The judge scores the session and posts its rewards (a named reward, with its provenance); its calls
        are a judge session of their own. No score is an infrastructure error, never a 0."""
        try:
            verdict = await judge.reward(self.client, self.r.session_id)
        except JudgeError as exc:
            raise Infra("reward_unavailable", f"judge: {exc}") from None
        self.r.judged = {"trajectory" if k is None else str(k): v for k, v in verdict.rewards.items()}

    # -- the agent -------------------------------------------------------------------------------------
    def _command(self, info: Any, home: Path) -> tuple[list[str], dict[str, str]]:
        inside_url = f"http://127.0.0.1:{PORT}/s/{info.id}/v1"
        env = {"PATH": search_path(), "HOME": INSIDE_HOME, "LANG": "C.UTF-8",
               "TMPDIR": "/tmp", "TERM": "dumb", "STEPTAP_EPISODE": str(self.r.index)}
        env.update(session_env(inside_url, info.api_key, info.id, group_id=self.r.group_id,
                               model=self.s.model))
        instruction = self.task.instruction
        if self.s.agent is None:
            marked = [a.replace("{instruction}", instruction) for a in self.s.command]
            argv = marked if marked != self.s.command else [*self.s.command, instruction]
            return argv, env
        launch = agents.prepare(self.s.agent, base_url=inside_url, api_key=info.api_key,
                                model=self.s.model or "", home=home, cli=self.s.cli,
                                args=self.s.command or agents.task_args(self.s.agent, instruction))
        env.update(_relocate({k: v for k, v in launch.env.items() if k != "PATH"}, home, INSIDE_HOME))
        if "PATH" in launch.env:  # a CLI from the install cache runs on the cache's Node
            env["PATH"] = f"{agents.node_bin_dir()}:{env['PATH']}"
        return launch.argv, env

    async def _agent(self, info: Any) -> None:
        task, sb = self.task, self.s.sandbox
        app, home = self.dir / "app", self.dir / "home"
        copy_tree(task.app, app, task.app_exclude)
        home.mkdir(mode=0o700)
        argv, env = self._command(info, home)
        # the socket's folder: a private one with a short path (a unix socket's path is at most 107 bytes)
        net = Path(tempfile.mkdtemp(prefix="steptap-net-"))
        for d in (app, home, net):
            sb.own(d)
        bridge = Bridge(net / "proxy.sock", self.s.proxy_url, info.id, sb.owner())
        try:
            await bridge.start()
            ended = await sb.run(Job(
                argv=argv, cwd=task.workdir, env=env, hostname=f"episode-{self.r.index}",
                timeout_s=self.s.agent_timeout_s or task.agent_timeout_s, socket=bridge.socket,
                mounts=[Mount(app, task.workdir, True), Mount(home, INSIDE_HOME, True)],
                log=self.dir / "agent.log"))
        finally:
            await bridge.close()
            shutil.rmtree(net, ignore_errors=True)
        self.r.calls, self.r.agent = bridge.calls, _end(ended)
        if not ended.started:
            raise Infra("sandbox", f"the agent's sandbox did not start: {ended.error}")
        if bridge.calls == 0 and not ended.timed_out and ended.exit_code != 0:
            last = (ended.output.strip().splitlines() or [""])[-1]
            raise Infra("agent_start", f"the agent exited {ended.exit_code} before its first model call: "
                        f"{last[:300]}")

    # -- the verifier ----------------------------------------------------------------------------------
    async def _verify(self) -> dict[str | None, float]:
        timeout = self.s.verifier_timeout_s or self.task.verifier_timeout_s
        ended = await run_verifier(self.s.sandbox, self.task, self.dir, timeout)
        self.r.verifier = _end(ended)
        return read_verdict(self.dir / "verifier", ended, timeout)

    # -- the end ---------------------------------------------------------------------------------------
    async def _finish(self, status: str, *, reward: float | None = None, error: str | None = None,
                      cause: str | None = None) -> None:
        r = self.r
        run = TaskRun(agent=r.agent, verifier=r.verifier)
        try:
            reply = await self.client.finish(r.session_id, reward=reward, status=status, error=error,
                                             infra_cause=cause, task_run=run)
        except Exception as exc:  # noqa: BLE001 - reported; the proxy's idle timeout closes it otherwise
            r.status, r.error = "", f"finish failed: {explain(exc, self.s.proxy_url)}"
            return
        r.status, r.error, r.infra_cause = status, error, cause
        r.rewards, r.steps = dict(reply.get("rewards") or {}), reply.get("steps")
        if self.s.mode == "eval" and status == "finished":
            with contextlib.suppress(Exception):
                steps = (await self.client.get_session(r.session_id)).steps
                r.policy_version = steps[-1].policy_version if steps else None


async def run_verifier(sb: Sandbox, task: Task, folder: Path, timeout: float) -> Ended:
    """The task's verifier in its own sandbox over ``folder``/app (the agent is gone), with fresh copies of
    its tests at /tests and an empty /logs/verifier (``folder``/verifier, where its reward is read)."""
    tests, logs, home = folder / "tests", folder / "verifier", folder / "verifier-home"
    for d in (tests, logs, home):
        shutil.rmtree(d, ignore_errors=True)  # a retry's: never a reward left from before
    copy_tree(task.tests, tests)
    logs.mkdir()
    home.mkdir(mode=0o700)
    for d in (tests, logs, home, folder / "app"):
        sb.own(d)
    env = {"PATH": search_path(), "HOME": "/home/verifier", "LANG": "C.UTF-8",
           "TMPDIR": "/tmp", **task.verifier_env}
    try:
        return await sb.run(Job(
            argv=["sh", "-c", task.verifier], cwd=task.workdir, env=env, timeout_s=timeout,
            hostname="verifier", log=folder / "verifier.log",
            mounts=[Mount(folder / "app", task.workdir, True), Mount(tests, TESTS_DIR, True),
                    Mount(logs, VERIFIER_DIR, True), Mount(home, "/home/verifier", True)]))
    finally:
        shutil.rmtree(home, ignore_errors=True)


def read_verdict(logs: Path, ended: Ended, timeout: float) -> dict[str | None, float]:
    """The verifier's reward: /logs/verifier/reward.json (named numbers, or one) before reward.txt (a
    number), as Harbor reads them; None's key is the plain reward. A verifier whose sandbox did not start,
    that ran past its timeout, or that left no reward (or one that is not a finite number) whatever its exit
    code: ``Infra``."""
    if not ended.started:
        raise Infra("sandbox", f"the verifier's sandbox did not start: {ended.error}")
    if ended.timed_out:
        raise Infra("verifier_timeout", f"the verifier ran past its timeout of {timeout:g} s")
    for name in ("reward.json", "reward.txt"):
        try:
            data = read_small_file(str(logs / name))
            if data is None:
                continue
            text = data.decode("utf-8", "replace")
            # reward.json is one JSON document (over several lines, as json.dump(indent=...) writes it)
            reward = parse_reward(" ".join(text.split()) if name.endswith(".json") else text)
        except (RuntimeError, ValueError) as exc:
            raise Infra("verifier_crash", f"{name}: {exc} (verifier exit {ended.exit_code})") from None
        if reward is not None:
            return {None if k in (None, "reward") else k: v for k, v in reward.items()}
    last = (ended.output.strip().splitlines() or ["no output"])[-1]
    raise Infra("verifier_crash", f"the verifier exited {ended.exit_code} without a reward in "
                f"{VERIFIER_DIR}: {last[:300]}")
