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
  ``.<index>`` appended); or
- ``--reward-judge RUBRIC``: a judge model scores the session by the rubric (adapters/judge.py; its calls in a
  judge session of their own); a judge that fails ends the session as an infrastructure failure.

No reward and a non-zero exit: the session is ``aborted``. No reward and exit 0: ``finished`` without reward.
``--agent NAME`` (``agents.AGENTS``: claude-code, codex, openclaw, pi, gemini, opencode, qwen-code, vibe,
continue) runs that CLI (from PATH or the cache scripts/install_agents.sh fills) with its provider settings
written for the session into a private directory (adapters/agents.py); the arguments after ``--`` go to the
CLI. ``-n K`` runs K members of one group (``group_size=K``), at most ``--concurrency`` at once, their output
lines prefixed with ``[i]``. ``--agent`` runs in the local task sandbox by default (``run_sandbox.py``: the
working directory, a home and the session URL only; ``--no-sandbox`` opts out with a warning); a plain command
only with ``--sandbox``. Ctrl-C (or SIGTERM) kills the children's process groups and aborts their sessions.
The members themselves are ``runner.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from steptap.adapters import agents
from steptap.adapters.judge import add_judge_flags, judge_from_args
from steptap.adapters.run_sandbox import RunSandbox
from steptap.adapters.runner import Runner, describe, explain
from steptap.adapters.session import TOKEN_ENV, URL_ENV, served_model
from steptap.middleware.client import TOKEN_FILE_ENV, default_control_token, forget_control_token, proxy_url


class RunError(Exception):
    """A problem to report in one line (exit code 2): unreachable proxy, refused token, bad arguments."""



def _on_deadline(text: str) -> str | float:
    if text == "drop":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'"drop" or a number, not {text!r}') from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError("a finite number")
    return value

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
    p.add_argument("--train", choices=("main", "all"), default="main",
                   help="which calls train: the agent's main line (and its branches), or side calls too")
    p.add_argument("--side-model", dest="side_models", action="append", default=None, metavar="NAME",
                   help="a model name whose calls are side calls in the session (repeated)")
    p.add_argument("--model", default=None, help="exported to the program as OPENAI_MODEL and STEPTAP_MODEL "
                   "(with --agent, default: the first model the proxy serves)")
    p.add_argument("--agent", choices=agents.AGENTS, default=None,
                   help="run this agent CLI with its provider settings written for the session "
                        "(docs/agents.md); the arguments after -- go to it")
    p.add_argument("--sandbox", action=argparse.BooleanOptionalAction, default=None,
                   help="run each member in a local bubblewrap sandbox: its working directory, its home and "
                        "its session URL only (default: with --agent; docs/agents.md, \"steptap run's "
                        "sandbox\")")
    p.add_argument("--expose", action="append", default=[], type=Path, metavar="PATH",
                   help="another host folder the sandbox shows read-only (a toolchain; repeated)")
    p.add_argument("--idle-timeout", type=float, default=None, help="session idle timeout in seconds")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--reward-cmd", default=None, help="shell command printing the reward (sees STEPTAP_* env)"
    )
    src.add_argument("--reward-file", default=None, help="file the agent writes its reward to")
    add_judge_flags(p, src)
    p.add_argument("--reward-timeout", type=float, default=300.0, help="seconds the reward command may take")
    p.add_argument("--reward-pending", type=float, default=None, metavar="DEADLINE_S",
                   help="a member that exits without a reward finishes with its reward pending: held off the "
                   "stream until POST /sessions/<id>/rewards gives it, at most DEADLINE_S seconds "
                   "(docs/sessions.md)")
    p.add_argument("--on-deadline", default="drop", type=_on_deadline,
                   help='with --reward-pending: "drop" (default) or the reward a member gets at the deadline')
    p.add_argument("-n", type=int, default=1, help="members of one group (group_size=N)")
    p.add_argument(
        "--concurrency", type=int, default=None, help="members running at once (default min(N, 8))"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command and not args.agent:
        p.error("no command given (steptap run [OPTIONS] -- COMMAND...)")
    if args.n < 1:
        p.error("-n must be at least 1")
    if not args.proxy:
        p.error(f"no proxy URL: pass --proxy or set {URL_ENV}")
    try:
        proxy_url(args.proxy)  # as both clients take it: http(s)://host:port or unix:PATH, /v1 or not
    except ValueError as exc:
        p.error(f"--proxy: {exc}")
    if not args.control_token:
        p.error(f"no control token: pass --control-token or set {TOKEN_ENV}")
    if args.metadata is not None:
        try:
            args.metadata = json.loads(args.metadata)
        except ValueError as exc:
            p.error(f"--metadata is not JSON: {exc}")
        if not isinstance(args.metadata, dict):
            p.error("--metadata must be a JSON object")
    if args.reward_pending is not None and not args.reward_pending > 0:
        p.error("--reward-pending must be positive")
    args.concurrency = max(1, args.concurrency or min(args.n, 8))
    args.judge = judge_from_args(args, p.error)
    args.sandbox = bool(args.agent) if args.sandbox is None else args.sandbox
    if args.sandbox and args.reward_file is not None:
        named = Path(os.path.abspath(args.reward_file.replace("{index}", "0").replace("{session}", "s")))
        if not named.is_relative_to(Path.cwd().resolve()):
            p.error("in the sandbox a member sees only its working directory: --reward-file must name a file "
                    "in it (or leave it out: a private one is made), or pass --no-sandbox")
    args.token_file = os.environ.get(TOKEN_FILE_ENV)  # kept out of the sandbox's view (run_sandbox.py)
    forget_control_token()  # read: nothing started from here inherits it
    return args

async def preflight(client: Any, proxy: str) -> None:
    """Fail fast, in one clear line, on an unreachable proxy or a refused token: a control call on a session
    that cannot exist answers 404 only when the proxy is there and accepts the token."""
    try:
        await client.get_session("steptap-run-preflight")
    except Exception as exc:  # noqa: BLE001
        if getattr(exc, "status", None) == 404:
            return
        raise RunError(explain(exc, proxy)) from None
    raise RunError(f"{proxy} does not look like a steptap proxy (a probe session exists)")

def _sandbox(args: argparse.Namespace, runner: Runner) -> RunSandbox:
    """The run's sandbox, checked: a CLI outside its view is shown read-only (its folder)."""
    expose = list(args.expose)
    sandbox = RunSandbox(Path.cwd(), args.n, Path(runner.tmpdir), expose, args.proxy)
    if args.agent and not sandbox.visible(args.cli):
        args.cli = Path(args.cli).resolve()
        sandbox = RunSandbox(Path.cwd(), args.n, Path(runner.tmpdir), [*expose, args.cli.parent], args.proxy)
    why = sandbox.problem(args.token_file, agents.homes_root() if args.agent else None)
    if why:
        raise RunError(f"cannot sandbox the members: {why} (or --no-sandbox, docs/SECURITY.md)")
    return sandbox


async def _main(args: argparse.Namespace) -> int:
    from steptap.middleware.client import SteptapClient

    async with SteptapClient(args.proxy, args.control_token) as client:
        await preflight(client, args.proxy)
        if args.agent:  # before any session opens: a missing CLI or model is one line, not N aborted sessions
            try:
                args.cli = agents.find_cli(args.agent)
                args.model = args.model or await asyncio.to_thread(served_model, args.proxy,
                                                                   args.control_token)
            except (agents.AgentError, RuntimeError) as exc:
                raise RunError(str(exc)) from None
        runner = Runner(args, client)
        if args.sandbox:
            runner.sandbox = _sandbox(args, runner)
        elif args.agent:
            print(f"steptap run: warning: --no-sandbox: {args.agent} runs as you, with your files and your "
                  "network: its tool calls can read the control-token file and post their own rewards "
                  "(docs/SECURITY.md)", file=sys.stderr)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, runner.interrupt)
        try:
            members = await runner.run()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            shutil.rmtree(runner.tmpdir, ignore_errors=True)
            if runner.homes:
                shutil.rmtree(runner.homes, ignore_errors=True)
    for m in members:
        tag = f"[{m.index}] " if args.n > 1 else ""
        print(f"steptap run: {tag}{describe(m)}", file=sys.stderr)
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
