"""``steptap run -- COMMAND...``: any program (a CLI agent in any language) as an agent of a fresh session.

The program gets ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` for its session (plus ``STEPTAP_SESSION_ID``,
``STEPTAP_REWARD_FILE``, ``STEPTAP_MEMBER_INDEX``, ``STEPTAP_GROUP_ID``), never the control token: the agent
is untrusted. When it exits, the session is finished with a reward from

- ``--reward-cmd CMD``: a shell command that gets the trajectory as JSON on stdin and sees
  ``STEPTAP_TRAJECTORY_ID``, ``STEPTAP_EXIT_CODE`` (never the control token: a grader that runs the agent's
  code must not be able to post rewards) and prints a number (or a JSON object of named components) as its
  last line of output; or
- the reward file: whatever the agent wrote to ``$STEPTAP_REWARD_FILE`` (``--reward-file PATH`` names it;
  ``{index}`` and ``{session}`` in PATH are filled in, and with ``-n`` > 1 a PATH without them gets
  ``.<index>`` appended).

No reward and a non-zero exit: the session is ``aborted``. No reward and exit 0: ``finished`` without reward.
``-n K`` runs K members of one group (``group_size=K``), at most ``--concurrency`` at once, their output lines
prefixed with ``[i]``. Ctrl-C (or SIGTERM) kills the children's process groups and aborts their sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import stat
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO

import msgspec

from steptap.adapters.session import TOKEN_ENV, URL_ENV
from steptap.middleware.client import TOKEN_FILE_ENV, SteptapError, default_control_token, forget_control_token

KILL_GRACE_S = 3.0


class RunError(Exception):
    """A problem to report in one line (exit code 2): unreachable proxy, refused token, bad arguments."""


@dataclass
class Member:
    index: int
    session_id: str = ""
    exit_code: int | None = None
    reward: dict[str | None, float] | None = None
    status: str = ""
    steps: int | None = None
    error: str | None = None


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="steptap run",
        description="Run any program as an agent in a fresh steptap session "
        "(OPENAI_BASE_URL and OPENAI_API_KEY set).",
        epilog="Example: steptap run -n 4 --reward-cmd 'python grade.py' -- ./agent.sh 'task text'",
    )
    p.add_argument("--proxy", default=os.environ.get(URL_ENV), help=f"proxy URL (default ${URL_ENV})")
    p.add_argument(
        "--control-token", default=default_control_token(),
        help=f"control token (default ${TOKEN_ENV}, else the file ${TOKEN_FILE_ENV} names)"
    )
    p.add_argument("--group", default=None, help="group id (default: a fresh one when -n > 1)")
    p.add_argument("--metadata", default=None, help="JSON object stored on each trajectory")
    p.add_argument("--mode", choices=("train", "eval"), default="train")
    p.add_argument("--model", default=None, help="exported to the program as OPENAI_MODEL and STEPTAP_MODEL")
    p.add_argument("--idle-timeout", type=float, default=None, help="session idle timeout in seconds")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--reward-cmd", default=None, help="shell command printing the reward (sees STEPTAP_* env)"
    )
    src.add_argument("--reward-file", default=None, help="file the agent writes its reward to")
    p.add_argument("--reward-timeout", type=float, default=300.0, help="seconds the reward command may take")
    p.add_argument("-n", type=int, default=1, help="members of one group (group_size=N)")
    p.add_argument(
        "--concurrency", type=int, default=None, help="members running at once (default min(N, 8))"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no command given (steptap run [OPTIONS] -- COMMAND...)")
    if args.n < 1:
        p.error("-n must be at least 1")
    if not args.proxy:
        p.error(f"no proxy URL: pass --proxy or set {URL_ENV}")
    if not args.control_token:
        p.error(f"no control token: pass --control-token or set {TOKEN_ENV}")
    if args.metadata is not None:
        try:
            args.metadata = json.loads(args.metadata)
        except ValueError as exc:
            p.error(f"--metadata is not JSON: {exc}")
        if not isinstance(args.metadata, dict):
            p.error("--metadata must be a JSON object")
    args.concurrency = max(1, args.concurrency or min(args.n, 8))
    forget_control_token()  # read: nothing started from here inherits it
    return args


MAX_REWARD_FILE = 64 * 1024  # a reward is a line; more is an agent filling the disk or the memory


def read_reward_file(path: str) -> dict[str | None, float] | None:
    """The reward an agent wrote to ``path``: None when there is no file; ``RuntimeError`` for a file that is
    not a regular one (a FIFO would block, ``/dev/zero`` never ends), one over ``MAX_REWARD_FILE`` or a bad
    reward. Opened without following a symlink and without blocking."""
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
    try:
        return parse_reward(data.decode("utf-8", "replace"))
    except ValueError as exc:
        raise RuntimeError(f"reward file {path}: {exc}") from None


def parse_reward(text: str) -> dict[str | None, float] | None:
    """A reward as printed or written: its last non-empty line, a finite number or a JSON object of named
    finite numbers (``nan`` or ``inf`` would poison every advantage of its group)."""
    out = _parse_reward(text)
    if out is not None and not all(math.isfinite(v) for v in out.values()):
        raise ValueError(f"a reward must be a finite number: {text.strip()[-200:]!r}")
    return out


def _parse_reward(text: str) -> dict[str | None, float] | None:
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
                )
            except Exception as exc:  # noqa: BLE001 - e.g. the proxy went away mid-run
                m.status = "not started"
                m.error = _explain(exc, self.args.proxy)
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
            except Exception as exc:  # noqa: BLE001 - a failing grader aborts its member, not the run
                m.error = str(exc)
                await self._finish(m, None, "aborted")
                return m
            if m.reward is None and m.exit_code != 0:
                m.error = f"agent exited {m.exit_code} with no reward"
                await self._finish(m, None, "aborted")
            else:
                await self._finish(m, m.reward, "finished")
            return m

    def _reward_file(self, m: Member) -> str:
        path = self.args.reward_file
        if path is None:
            return os.path.join(self.tmpdir, f"reward.{m.index}")
        if "{index}" in path or "{session}" in path:
            return path.format(index=m.index, session=m.session_id)
        return f"{path}.{m.index}" if self.args.n > 1 else path

    def _agent_env(self, m: Member, info: Any, reward_file: str) -> dict[str, str]:
        # the agent never holds the control token
        env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
        env.update(
            OPENAI_BASE_URL=info.base_url,
            OPENAI_API_BASE=info.base_url,  # older clients read this name
            OPENAI_API_KEY=info.api_key,
            STEPTAP_SESSION_ID=info.id,
            STEPTAP_REWARD_FILE=reward_file,
            STEPTAP_MEMBER_INDEX=str(m.index),
        )
        if self.group_id:
            env["STEPTAP_GROUP_ID"] = self.group_id
        if self.args.model:
            env["OPENAI_MODEL"] = env["STEPTAP_MODEL"] = self.args.model
        return env

    async def _run_agent(self, m: Member, info: Any, reward_file: str) -> int:
        env = self._agent_env(m, info, reward_file)
        pipe = asyncio.subprocess.PIPE if self.prefixed else None
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.args.command,
                env=env,
                stdout=pipe,
                stderr=pipe,
                stdin=asyncio.subprocess.DEVNULL if self.prefixed else None,
                start_new_session=True,  # its own process group: Ctrl-C here kills the whole tree
            )
        except OSError as exc:
            m.exit_code = 127  # what a shell reports for a command it cannot run
            raise RuntimeError(f"cannot start {self.args.command[0]!r}: {exc}") from exc
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
                trajectory = msgspec.json.encode(await self.client.get_session(m.session_id))
            except (SteptapError, OSError, asyncio.TimeoutError) as exc:
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
                out, _ = await asyncio.wait_for(proc.communicate(trajectory), self.args.reward_timeout)
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
            await self.client.finish(m.session_id, reward=(reward or {}).get(None), status=status)
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


def _describe(m: Member) -> str:
    reward = ""
    if m.reward:
        reward = " reward " + ", ".join(f"{k}={v:g}" if k else f"{v:g}" for k, v in m.reward.items())
    steps = f" {m.steps} steps" if m.steps is not None else ""
    why = f" ({m.error})" if m.error else ""
    code = "-" if m.exit_code is None else m.exit_code
    return f"session {m.session_id or '-'} exit {code}{reward} -> {m.status}{steps}{why}"


async def _preflight(client: Any, proxy: str) -> None:
    """Fail fast, in one clear line, on an unreachable proxy or a refused token: a control call on a session
    that cannot exist answers 404 only when the proxy is there and accepts the token."""
    try:
        await client.get_session("steptap-run-preflight")
    except Exception as exc:  # noqa: BLE001
        if getattr(exc, "status", None) == 404:
            return
        raise RunError(_explain(exc, proxy)) from None
    raise RunError(f"{proxy} does not look like a steptap proxy (a probe session exists)")


def _explain(exc: BaseException, proxy: str) -> str:
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


async def _main(args: argparse.Namespace) -> int:
    from steptap.middleware.client import SteptapClient

    async with SteptapClient(args.proxy, args.control_token) as client:
        await _preflight(client, args.proxy)
        runner = Runner(args, client)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, runner.interrupt)
        try:
            members = await runner.run()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            shutil.rmtree(runner.tmpdir, ignore_errors=True)
    for m in members:
        tag = f"[{m.index}] " if args.n > 1 else ""
        print(f"steptap run: {tag}{_describe(m)}", file=sys.stderr)
    if args.n > 1 and runner.group_id:
        done = sum(m.status in ("finished", "aborted") for m in members)
        print(f"steptap run: group {runner.group_id}: {done}/{args.n} members closed", file=sys.stderr)
    if runner.interrupted:
        return 130
    if args.n == 1:
        m = members[0]
        return m.exit_code if m.exit_code else (0 if m.status == "finished" else 1)
    return 0 if all(m.exit_code == 0 and m.status == "finished" for m in members) else 1


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return asyncio.run(_main(args))
    except RunError as exc:
        print(f"steptap run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before any session was opened
        return 130


if __name__ == "__main__":
    sys.exit(main())
