"""The members of one ``steptap run``: each opens a session, runs its program (or agent CLI) in its own
process group, collects its reward and finishes the session; at most ``--concurrency`` at once, Ctrl-C stops
them all. The command line around it is ``run.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import stat
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from steptap.adapters import agents
from steptap.adapters.judge import JudgeError
from steptap.adapters.session import TOKEN_ENV, URL_ENV
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

# A reward is a line; a bigger reward file is an agent filling the disk or the memory. Of a reward command's
# output only this tail is kept.
MAX_REWARD_FILE = 64 * 1024


def read_reward_file(path: str) -> dict[str | None, float] | None:
    """The reward an agent wrote to ``path``: None when there is no file; ``RuntimeError`` for a file that is
    not a regular one (a FIFO would block, ``/dev/zero`` never ends), one over ``MAX_REWARD_FILE`` or a bad
    reward. Opened without following a symlink and without blocking."""
    data = read_small_file(path)
    if data is None:
        return None
    try:
        return parse_reward(data.decode("utf-8", "replace"))
    except ValueError as exc:
        raise RuntimeError(f"reward file {path}: {exc}") from None


def read_small_file(path: str) -> bytes | None:
    """A file someone untrusted wrote (an agent, a verifier): None when there is none; ``RuntimeError`` for
    one that is not a regular file or is larger than ``MAX_REWARD_FILE``. Never follows a symlink, never
    blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RuntimeError(f"reward file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RuntimeError(f"reward file {path} is not a regular file")
        data = f.read(MAX_REWARD_FILE + 1)
    if len(data) > MAX_REWARD_FILE:
        raise RuntimeError(f"reward file {path} is larger than {MAX_REWARD_FILE} bytes")
    return data


async def _tail_of(proc: asyncio.subprocess.Process, data: bytes) -> bytes:
    """Feed ``data`` to the process's stdin and read its stdout to the end, keeping only the last
    ``MAX_REWARD_FILE`` bytes (the reward is its last line; a grader may print logs before it)."""

    async def feed() -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(data)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # a command that does not read the trajectory
        finally:
            proc.stdin.close()

    feeder = asyncio.ensure_future(feed())
    assert proc.stdout is not None
    tail = bytearray()
    try:
        while chunk := await proc.stdout.read(1 << 16):
            tail += chunk
            del tail[:-MAX_REWARD_FILE]
        await feeder
        await proc.wait()
    finally:
        feeder.cancel()
    return bytes(tail)


def parse_reward(text: str) -> dict[str | None, float] | None:
    """A reward as printed or written: its last non-empty line, a finite number or a JSON object of named
    finite numbers (``nan`` or ``inf`` would poison every advantage of its group)."""
    out = _parse_reward(text)
    if out is not None and not all(math.isfinite(v) for v in out.values()):
        raise ValueError(f"a reward must be a finite number: {text.strip()[-200:]!r}")
    return out


def _parse_reward(text: str) -> dict[str | None, float] | None:
    """A reward as printed or written: its last non-empty line, a number or a JSON object of named numbers."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    last = lines[-1]
    try:
        return {None: float(last)}
    except ValueError:
        pass
    try:
        value = json.loads(last)
    except ValueError as exc:
        raise ValueError(f"not a number or a JSON object: {last[:200]!r}") from exc
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {None: float(value)}
    if isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    raise ValueError(f"not a number or a JSON object of numbers: {last[:200]!r}")

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
            reward_file = self._reward_file(m)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(reward_file)  # a reward left by an earlier run is not this run's
                m.exit_code = await self._run_agent(m, info, reward_file)
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
        path = self.args.reward_file
        if path is None:
            return os.path.join(self.tmpdir, f"reward.{m.index}")
        if "{index}" in path or "{session}" in path:  # replaced, not formatted: other braces stay as they are
            return path.replace("{index}", str(m.index)).replace("{session}", m.session_id)
        return f"{path}.{m.index}" if self.args.n > 1 else path

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
        try:
            self.homes = self.homes or str(agents.new_agent_home())
            launch = agents.prepare(
                self.args.agent, base_url=info.base_url, api_key=info.api_key, model=self.args.model,
                home=Path(self.homes) / f"agent-{m.index}", args=list(self.args.command), cli=self.args.cli,
            )
        except (agents.AgentError, OSError) as exc:
            m.exit_code = 127
            raise RuntimeError(str(exc)) from exc
        env.update(launch.env)
        return launch.argv

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
            proc = await asyncio.create_subprocess_shell(
                self.args.reward_cmd,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            self.procs[-1 - m.index] = proc  # killed on Ctrl-C like the agents
            try:
                out = await asyncio.wait_for(_tail_of(proc, trajectory), self.args.reward_timeout)
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
    pending = b""
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if lines:
            out.write(b"".join(tag + ln + b"\n" for ln in lines))
            out.flush()
    if pending:
        out.write(tag + pending + b"\n")
        out.flush()

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
