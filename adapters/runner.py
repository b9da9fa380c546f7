"""The members of one ``steptap run``: each opens a session, runs its program (or agent CLI) in its own
process group, collects its reward and finishes the session; at most ``--concurrency`` at once, Ctrl-C stops
them all. The command line around it is ``run.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from steptap.adapters import agents
from steptap.adapters.judge import JudgeError
from steptap.adapters.run_reward import parse_reward, read_reward_file, tail_of
from steptap.adapters.run_sandbox import Place, Prefixed, RunSandbox, inside_url, write_back
from steptap.adapters.session import TOKEN_ENV, URL_ENV
from steptap.adapters.tasks.sandbox import Ended
from steptap.middleware.client import TOKEN_FILE_ENV, SteptapError
from steptap.middleware.records import INFRA_FAILURE, json_encoder

KILL_GRACE_S = 3.0


@dataclass
class Member:
    index: int
    session_id: str = ""
    exit_code: int | None = None
    reward: dict[str | None, float] | None = None
    status: str = ""
    pending: bool = False  # finished with its reward pending (--reward-pending)
    steps: int | None = None
    error: str | None = None
    judged: dict[int | None, float] | None = None  # the judge's rewards (--reward-judge), by step (None: all)

def session_env(base_url: str, api_key: str, session_id: str, *, group_id: str | None = None,
                model: str | None = None) -> dict[str, str]:
    """What a program learns of its session from its environment (``steptap run``, ``steptap tasks``): the
    OpenAI variables pointing at its session URL and key, its ids and the model to ask for; never a token."""
    env = {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_BASE": base_url,  # older clients read this name
        "OPENAI_API_KEY": api_key,
        "STEPTAP_SESSION_ID": session_id,
    }
    if group_id:
        env["STEPTAP_GROUP_ID"] = group_id
    if model:
        env["OPENAI_MODEL"] = env["STEPTAP_MODEL"] = model
    return env


class Runner:
    def __init__(self, args: argparse.Namespace, client: Any) -> None:
        self.args = args
        self.client = client
        self.group_id = args.group or (f"grp-{uuid.uuid4().hex[:12]}" if args.n > 1 else None)
        self.prefixed = args.n > 1
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.interrupted = False
        self.sem = asyncio.Semaphore(args.concurrency)
        self.tmpdir = tempfile.mkdtemp(prefix="steptap-run-")
        self.homes: str | None = None  # the agents' private homes (agents.new_agent_home), made when needed
        self.sandbox: RunSandbox | None = None  # set by run.py unless --no-sandbox (run_sandbox.py)
        self.places: dict[int, Place] = {}  # a sandboxed member's folders
        self.running: dict[int, asyncio.Future[Ended]] = {}  # sandboxed members: cancelled on Ctrl-C

    # -- one member ------------------------------------------------------------------------------------------
    async def member(self, m: Member) -> Member:
        async with self.sem:
            if self.interrupted:
                m.status = "not started"
                return m
            try:
                info = await self.client.open_session(
                    group_id=self.group_id,
                    group_size=self.args.n if self.args.n > 1 else None,
                    mode=self.args.mode,
                    metadata=self.args.metadata or {},
                    idle_timeout_s=self.args.idle_timeout,
                    train=self.args.train,
                    side_models=[*(self.args.side_models or ()), *agents.side_models(self.args.agent)]
                    or None,
                )
            except Exception as exc:  # noqa: BLE001 - e.g. the proxy went away mid-run
                m.status = "not started"
                m.error = explain(exc, self.args.proxy)
                return m
            m.session_id = info.id
            try:
                return await self._member(m, info)
            finally:
                if m.index in self.places:  # its copy of the working directory, its home, its reward
                    shutil.rmtree(self.places.pop(m.index).folder, ignore_errors=True)

    async def _member(self, m: Member, info: Any) -> Member:
        try:
            if self.sandbox is not None:
                self.places[m.index] = self.sandbox.place(m.index)
            reward_file = self._host_path(m, self._reward_file(m))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(reward_file)  # a reward left by an earlier run is not this run's
            m.exit_code = await (self._run_sandboxed(m, info) if self.sandbox is not None
                                 else self._run_agent(m, info, reward_file))
            if self.interrupted:
                raise asyncio.CancelledError
            m.reward = await self._reward(m, reward_file)
        except asyncio.CancelledError:
            m.status = "aborted"
            m.error = "interrupted"
            await self._finish(m, None, "aborted")
            return m
        except JudgeError as exc:  # no reward could be made: an infrastructure failure, never a 0
            m.error = f"judge: {exc}"
            await self._finish(m, None, INFRA_FAILURE)
            return m
        except Exception as exc:  # noqa: BLE001 - a failing grader aborts its member, not the run
            m.error = str(exc)
            await self._finish(m, None, "aborted")
            return m
        if m.reward is None and m.judged is None and m.exit_code != 0:
            m.error = f"agent exited {m.exit_code} with no reward"
            await self._finish(m, None, "aborted")
        else:
            await self._finish(m, m.reward, "finished")
        return m

    def _reward_file(self, m: Member) -> str:
        """The reward file's name as the member is given it (sandboxed: a path in its view)."""
        path = self.args.reward_file
        if path is None:
            place = self.places.get(m.index)
            return os.path.join(place.folder / "out" if place else self.tmpdir, f"reward.{m.index}")
        if self.sandbox is not None:  # in the working directory (run.py checked), which the member sees
            path = os.path.join(self.sandbox.cwd, path)
        if "{index}" in path or "{session}" in path:  # replaced, not formatted: other braces stay as they are
            return path.replace("{index}", str(m.index)).replace("{session}", m.session_id)
        return f"{path}.{m.index}" if self.args.n > 1 else path

    def _host_path(self, m: Member, path: str) -> str:
        """Where a file the member names in its working directory is on the host (in its copy, -n > 1)."""
        place = self.places.get(m.index)
        if place is None or self.sandbox is None or not Path(path).is_relative_to(self.sandbox.cwd):
            return path
        return str(place.work / Path(path).relative_to(self.sandbox.cwd))

    def _agent_env(self, m: Member, info: Any, reward_file: str) -> dict[str, str]:
        # the agent never holds the control token
        env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
        env.update(session_env(info.base_url, info.api_key, info.id, group_id=self.group_id,
                               model=self.args.model),
                   STEPTAP_REWARD_FILE=reward_file,
                   # where it runs: opencode works in $PWD, which a launcher may have left stale
                   PWD=os.getcwd(), STEPTAP_MEMBER_INDEX=str(m.index))
        return env

    def _command(self, m: Member, info: Any, env: dict[str, str]) -> list[str]:
        """The program to run: the command as given, or the agent CLI with its settings written (into env)."""
        if not self.args.agent:
            return list(self.args.command)
        launch = self._launch(m, info, info.base_url)
        env.update(launch.env)
        return launch.argv

    def _launch(self, m: Member, info: Any, base_url: str) -> agents.AgentLaunch:
        """The agent CLI with its settings written for the session at ``base_url``, in the member's home."""
        try:
            self.homes = self.homes or str(agents.new_agent_home())
            return agents.prepare(
                self.args.agent, base_url=base_url, api_key=info.api_key, model=self.args.model,
                home=Path(self.homes) / f"agent-{m.index}", args=list(self.args.command), cli=self.args.cli,
            )
        except (agents.AgentError, OSError) as exc:
            m.exit_code = 127
            raise RuntimeError(str(exc)) from exc

    async def _run_sandboxed(self, m: Member, info: Any) -> int:
        """The member in its sandbox (run_sandbox.py): its calls reach its own session URL only."""
        assert self.sandbox is not None
        place, url = self.places[m.index], inside_url(info.id)
        if self.args.agent:
            launch = self._launch(m, info, url)
            home, argv, cli_env = Path(self.homes or "") / f"agent-{m.index}", launch.argv, launch.env
        else:
            home, argv, cli_env = place.home, list(self.args.command), {}
        env = self.sandbox.environment(home, cli_env)
        env.update(session_env(url, info.api_key, info.id, group_id=self.group_id, model=self.args.model),
                   STEPTAP_REWARD_FILE=self._reward_file(m), STEPTAP_MEMBER_INDEX=str(m.index))
        out = sys.stdout.buffer if self.prefixed else None  # else it has the terminal
        task = self.running[m.index] = asyncio.ensure_future(
            self.sandbox.run(m.index, place, argv, env, info.id, home, out))
        try:
            ended = await task
        finally:
            self.running.pop(m.index, None)
        if not ended.started:
            m.exit_code = 127
            raise RuntimeError(f"the sandbox did not start: {ended.error}")
        if self.sandbox.write_back:
            await asyncio.to_thread(write_back, place.work, self.sandbox.cwd)
        return int(ended.exit_code or 0)

    async def _run_agent(self, m: Member, info: Any, reward_file: str) -> int:
        env = self._agent_env(m, info, reward_file)
        command = self._command(m, info, env)
        pipe = asyncio.subprocess.PIPE if self.prefixed else None
        try:
            proc = await asyncio.create_subprocess_exec(
                *command,
                env=env,
                stdout=pipe,
                stderr=pipe,
                stdin=asyncio.subprocess.DEVNULL if self.prefixed else None,
                start_new_session=True,  # its own process group: Ctrl-C here kills the whole tree
            )
        except OSError as exc:
            m.exit_code = 127  # what a shell reports for a command it cannot run
            raise RuntimeError(f"cannot start {command[0]!r}: {exc}") from exc
        self.procs[m.index] = proc
        try:
            pumps = []
            if self.prefixed:
                tag = f"[{m.index}] ".encode()
                pumps = [
                    _pump(proc.stdout, sys.stdout.buffer, tag),
                    _pump(proc.stderr, sys.stderr.buffer, tag),
                ]
            await asyncio.gather(*pumps, proc.wait())
            code = int(proc.returncode or 0)
            return 128 - code if code < 0 else code  # killed by signal N: 128+N, as shells report it
        finally:
            self.procs.pop(m.index, None)

    async def _reward(self, m: Member, reward_file: str) -> dict[str | None, float] | None:
        judge = getattr(self.args, "judge", None)
        if judge is not None:  # the judge posts its rewards (and their provenance) itself
            m.judged = (await judge.reward(self.client, m.session_id)).rewards
            return None
        if self.args.reward_cmd:
            env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
            env.update(
                STEPTAP_TRAJECTORY_ID=m.session_id,
                STEPTAP_SESSION_ID=m.session_id,
                STEPTAP_EXIT_CODE=str(m.exit_code),
                STEPTAP_MEMBER_INDEX=str(m.index),
                STEPTAP_REWARD_FILE=reward_file,
                STEPTAP_URL=self.args.proxy,
            )
            try:
                trajectory = json_encoder.encode(await self.client.get_session(m.session_id))
            except (TimeoutError, SteptapError, OSError) as exc:
                raise RuntimeError(f"cannot read the trajectory for the reward command: {exc}") from None
            if self.group_id:
                env["STEPTAP_GROUP_ID"] = self.group_id
            place = self.places.get(m.index)
            proc = await asyncio.create_subprocess_shell(
                self.args.reward_cmd,
                env=env,
                cwd=place.work if place is not None else None,  # a member's copy is what it made (-n > 1)
                stdout=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            self.procs[-1 - m.index] = proc  # killed on Ctrl-C like the agents
            try:
                out = await asyncio.wait_for(tail_of(proc, trajectory), self.args.reward_timeout)
            except TimeoutError:
                _kill_group(proc, signal.SIGKILL)
                await proc.wait()
                raise RuntimeError(f"reward command timed out after {self.args.reward_timeout:g}s") from None
            finally:
                self.procs.pop(-1 - m.index, None)
            if proc.returncode != 0:
                raise RuntimeError(f"reward command exited {proc.returncode}")
            try:
                reward = parse_reward(out.decode(errors="replace"))
            except ValueError as exc:
                raise RuntimeError(f"reward command printed no reward: {exc}") from None
            if reward is None:
                raise RuntimeError("reward command printed nothing")
            return reward
        return read_reward_file(reward_file)

    async def _finish(self, m: Member, reward: dict[str | None, float] | None, status: str) -> None:
        try:
            for name, value in (reward or {}).items():
                if name is not None:
                    await self.client.add_reward(m.session_id, value, name=name)
            pending = getattr(self.args, "reward_pending", None)
            if status == "finished" and pending is not None and (reward or {}).get(None) is None \
                    and m.judged is None:
                # the verdict comes later (a person, a test run): held off the stream until it does
                await self.client.finish(m.session_id, reward="pending", deadline_s=pending,
                                         on_deadline=self.args.on_deadline)
                m.pending = True
            else:
                cause = "reward_unavailable" if status == INFRA_FAILURE else None
                await self.client.finish(m.session_id, reward=(reward or {}).get(None), status=status,
                                         error=m.error if status != "finished" else None, infra_cause=cause)
            m.status = status
        except Exception as exc:  # noqa: BLE001 - report it; the proxy's idle timeout closes it otherwise
            m.status = "unfinished"
            m.error = f"{m.error + '; ' if m.error else ''}finish failed: {exc}"
            return
        try:
            m.steps = len((await self.client.get_session(m.session_id)).steps)
        except Exception:  # noqa: BLE001 - only for the summary line
            m.steps = None

    # -- the whole run ---------------------------------------------------------------------------------------
    def interrupt(self) -> None:
        if self.interrupted:  # a second Ctrl-C: no more grace
            for proc in list(self.procs.values()):
                _kill_group(proc, signal.SIGKILL)
            return
        self.interrupted = True
        print("\nsteptap run: interrupted; stopping the agents and aborting their sessions", file=sys.stderr)
        for task in list(self.running.values()):
            task.cancel()  # the sandbox is killed, every process in it (tasks/sandbox.py)
        for proc in list(self.procs.values()):
            _kill_group(proc, signal.SIGTERM)
        asyncio.get_running_loop().call_later(KILL_GRACE_S, self._kill_rest)

    def _kill_rest(self) -> None:
        for proc in list(self.procs.values()):
            _kill_group(proc, signal.SIGKILL)

    async def run(self) -> list[Member]:
        members = [Member(i) for i in range(self.args.n)]
        return list(await asyncio.gather(*(self.member(m) for m in members)))

def _kill_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # pid == pgid: started with start_new_session
    except (ProcessLookupError, PermissionError):
        pass


async def _pump(stream: asyncio.StreamReader | None, out: BinaryIO, tag: bytes) -> None:
    """Copy a child's output line by line, each prefixed (lines of any length; a partial last line too)."""
    if stream is None:
        return
    lines = Prefixed(tag, out)
    while chunk := await stream.read(65536):
        lines.write(chunk)
    lines.close()


def describe(m: Member) -> str:
    reward = ""
    if m.reward:
        reward = " reward " + ", ".join(f"{k}={v:g}" if k else f"{v:g}" for k, v in m.reward.items())
    if m.judged:
        reward = " judged " + ", ".join(f"step {k}={v:g}" if k is not None else f"{v:g}"
                                        for k, v in m.judged.items())
    steps = f" {m.steps} steps" if m.steps is not None else ""
    why = f" ({m.error})" if m.error else ""
    code = "-" if m.exit_code is None else m.exit_code
    pending = " (reward pending)" if m.pending else ""
    return f"session {m.session_id or '-'} exit {code}{reward} -> {m.status}{pending}{steps}{why}"


def explain(exc: BaseException, proxy: str) -> str:
    status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
    if status in (401, 403):
        return (
            f"the proxy at {proxy} refused the control token ({status}): pass the token `steptap serve` "
            f"printed with --control-token or ${TOKEN_ENV}"
        )
    if isinstance(exc, (OSError, asyncio.TimeoutError)) or "connect" in type(exc).__name__.lower():
        exc = (
            getattr(exc, "os_error", None) or exc
        )  # aiohttp's wrapper: say "connection refused", not its repr
        return (
            f"cannot reach the steptap proxy at {proxy} ({exc}): is `steptap serve` running? "
            f"(--proxy / ${URL_ENV})"
        )
    return f"the proxy at {proxy} failed: {exc}"
