"""``steptap tasks run|check|list``: agents on task datasets in sandboxes (docs/tasks.md).

    steptap tasks list examples/tasks
    steptap tasks check examples/tasks                      # each solution passes, doing nothing fails
    steptap tasks run examples/tasks --agent pi -n 4        # each task a group of 4 episodes
    steptap tasks run data/tasks.jsonl -n 4 -- ./my_agent.sh '{instruction}'
    steptap tasks run data/tasks.jsonl --reward-judge rubric.md -- ./my_agent.sh   # a judge's reward too

The proxy URL and control token come from ``--proxy`` / ``--control-token`` or STEPTAP_URL /
STEPTAP_CONTROL_TOKEN (or the file STEPTAP_CONTROL_TOKEN_FILE names). A run keeps its state in ``--run-dir``:
the same command run again resumes it, running only the episodes without a verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from steptap.adapters import agents
from steptap.adapters.judge import add_judge_flags, judge_from_args
from steptap.adapters.progress import Progress
from steptap.adapters.run import RunError, preflight
from steptap.adapters.session import TOKEN_ENV, URL_ENV, served_model
from steptap.adapters.tasks import report
from steptap.adapters.tasks.check import check_all
from steptap.adapters.tasks.containers import HarborError, HarborSettings, harbor_python, install
from steptap.adapters.tasks.containers import preflight as preflight_harbor
from steptap.adapters.tasks.episode import Settings
from steptap.adapters.tasks.format import Dataset, TaskError, load
from steptap.adapters.tasks.runner import Plan, RunDirError, TaskRunner, new_run_id, open_run, unscored
from steptap.adapters.tasks.sandbox import LocalSandbox, Sandbox
from steptap.middleware.client import TOKEN_FILE_ENV, default_control_token, forget_control_token

PROG = "steptap tasks"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", help="a folder of Harbor task folders, one task folder, or a .jsonl or "
                   ".parquet file")
    p.add_argument("--task", action="append", default=None, metavar="NAME", help="only this task (repeated)")
    p.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    p.add_argument("--concurrency", type=int, default=None, help="episodes (or checks) at once")
    p.add_argument("--threshold", type=float, default=report.PASS_THRESHOLD,
                   help=f"the reward at or above which an episode passes (default {report.PASS_THRESHOLD})")
    p.add_argument("--expose", action="append", default=[], type=Path, metavar="PATH",
                   help="another host folder the sandbox shows read-only (a toolchain; repeated)")
    p.add_argument("--keep", action="store_true", help="keep each episode's working folder and home")
    g = p.add_argument_group("containers (Harbor's own environments, docs/tasks.md)")
    g.add_argument("--sandbox", choices=("local", "harbor"), default="local",
                   help="local: bubblewrap on this machine (default); harbor: each episode a Harbor trial in "
                        "a container built from the task's environment/ (steptap tasks install-harbor first)")
    g.add_argument("--harbor-env", default="docker", metavar="TYPE",
                   help="Harbor's environment type: docker (default), podman, modal, daytona, ...")
    g.add_argument("--harbor-env-import", default=None, metavar="MODULE:CLASS",
                   help="a Harbor environment by import path, instead of --harbor-env")
    g.add_argument("--harbor-env-kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="an argument of the environment (VALUE read as JSON when it is; repeated)")


def _parser_run() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROG} run", description="Run an agent on every task of a dataset, "
                                "each task a group of -n episodes in sandboxes, rewarded by its verifier.")
    _common(p)
    p.add_argument("--proxy", default=os.environ.get(URL_ENV), help=f"proxy URL (default ${URL_ENV})")
    p.add_argument("--control-token", default=None,
                   help=f"control token (default ${TOKEN_ENV}, else the file ${TOKEN_FILE_ENV} names)")
    p.add_argument("--agent", choices=agents.AGENTS, default=None,
                   help="an agent CLI, run in its one-shot form on each instruction (docs/agents.md)")
    p.add_argument("-n", type=int, default=4, help="episodes per task (one GRPO group)")
    p.add_argument("--rounds", type=int, default=1, help="groups per task (each a new group)")
    p.add_argument("--mode", choices=("train", "eval"), default="train",
                   help="eval: never trained on; the summary gives pass@1 and pass@k by policy version")
    p.add_argument("--pass-k", default=None, help="the k of pass@k in eval mode (default: 1 and -n)")
    p.add_argument("--model", default=None, help="the model name to ask for (default: the proxy's first)")
    p.add_argument("--train", choices=("main", "all"), default="main",
                   help="which calls train: the agent's main line, or its side calls too")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where the run's state and episodes go (default runs/tasks-DATASET-AGENT); the same "
                        "command with the same folder resumes")
    p.add_argument("--fresh", action="store_true", help="start the run folder's run over")
    p.add_argument("--agent-timeout", type=float, default=None, help="seconds, instead of each task's")
    p.add_argument("--verifier-timeout", type=float, default=None, help="seconds, instead of each task's")
    p.add_argument("--infra-retries", type=int, default=1,
                   help="times an episode that failed for an infrastructure reason runs again (default 1)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--harbor-agent-import", default=None, metavar="MODULE:CLASS",
                   help="with --sandbox harbor: a Harbor agent by import path, instead of --agent's")
    p.add_argument("--container-proxy", default=None, metavar="URL",
                   help="with --sandbox harbor: the proxy's URL as the containers reach it (default --proxy)")
    # a judge's reward beside the verifier's; a task with no verifier: the judge's alone (docs/judge.md)
    add_judge_flags(p.add_argument_group("a judge's reward (docs/judge.md)"))
    p.epilog = ("-- COMMAND...: run it on each instruction ({instruction} marks where; else it is the last "
                "argument); with --agent, the CLI's own arguments instead of its one-shot form")
    return p


def _parse_run(argv: list[str]) -> argparse.Namespace:
    p = _parser_run()
    # what follows -- is the command, whatever it holds (options of steptap's may come after the dataset)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.command = argv[cut + 1:]
    if not args.command and not args.agent and not args.harbor_agent_import:
        p.error("give --agent NAME or a command after --")
    if args.sandbox == "harbor" and args.command:
        p.error("with --sandbox harbor the agent is Harbor's: --agent NAME or --harbor-agent-import, "
                "no command")
    if args.n < 1 or args.rounds < 1 or args.infra_retries < 0:
        p.error("-n and --rounds must be at least 1, --infra-retries at least 0")
    if not args.proxy:
        p.error(f"no proxy URL: pass --proxy or set {URL_ENV}")
    try:
        args.control_token = args.control_token or default_control_token()
    except ValueError as exc:
        p.error(str(exc))
    if not args.control_token:
        p.error(f"no control token: pass --control-token or set {TOKEN_ENV} (or {TOKEN_FILE_ENV})")
    forget_control_token()  # read: nothing started from here inherits it
    try:
        args.ks = sorted({int(k) for k in args.pass_k.split(",")}) if args.pass_k else sorted({1, args.n})
    except ValueError:
        p.error("--pass-k is a comma-separated list of integers")
    args.concurrency = max(1, args.concurrency or min(args.n, 4))
    args.judge = judge_from_args(args, p.error)
    return args


def _dataset(args: argparse.Namespace) -> tuple[Dataset, list[Any]]:
    dataset = load(args.dataset)
    tasks = dataset.select(args.task)
    return dataset, tasks[: args.limit] if args.limit else tasks


def _sandbox(args: argparse.Namespace) -> Sandbox:
    sb = LocalSandbox(expose=args.expose)
    problem = sb.problem() if args.sandbox == "local" else None
    if problem:
        raise RunError(problem)
    return sb


def _harbor(args: argparse.Namespace) -> HarborSettings | None:
    """What Harbor is handed with --sandbox harbor (its Python found now: a missing one is one line)."""
    if args.sandbox != "harbor":
        return None
    kwargs: dict[str, Any] = {}
    for item in args.harbor_env_kwarg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RunError(f"--harbor-env-kwarg {item!r}: KEY=VALUE")
        try:
            kwargs[key] = json.loads(value)
        except ValueError:
            kwargs[key] = value
    try:
        python = harbor_python()
    except HarborError as exc:
        raise RunError(str(exc)) from None
    return HarborSettings(environment=args.harbor_env, environment_import=args.harbor_env_import,
                          environment_kwargs=kwargs, agent_import=getattr(args, "harbor_agent_import", None),
                          container_proxy=getattr(args, "container_proxy", None), python=python)


async def _run(args: argparse.Namespace, dataset: Dataset, tasks: list[Any],
               sb: Sandbox) -> tuple[TaskRunner, bool]:
    """The run, to its end or an interrupt (Ctrl-C, SIGTERM: the episodes in flight are killed and recorded as
    interrupted, to run again when the run resumes); the runner and whether it was interrupted."""
    from steptap.middleware.client import SteptapClient

    run_dir = (args.run_dir or Path("runs") / f"tasks-{dataset.name}-{args.agent or 'command'}").resolve()
    judge = args.judge.rubric_sha256 if args.judge is not None else None
    plan = open_run(run_dir, Plan(new_run_id(), dataset.name, args.n, args.rounds, args.mode, args.agent,
                                  time.time(), judge), args.fresh)
    async with SteptapClient(args.proxy, args.control_token) as client:
        await preflight(client, args.proxy)
        model = args.model
        harbor = _harbor(args)
        try:
            if args.agent and harbor is None:
                cli = agents.find_cli(args.agent)
            if args.agent or harbor is not None:
                model = model or await asyncio.to_thread(served_model, args.proxy, args.control_token)
            if harbor is not None:  # Harbor's agent takes the session URL, or one line before any trial
                await preflight_harbor(args.agent, harbor, args.proxy, model or "", run_dir / "preflight.log")
        except (agents.AgentError, RuntimeError, HarborError) as exc:
            raise RunError(str(exc)) from None
        settings = Settings(proxy_url=args.proxy, sandbox=sb, run_dir=run_dir, n=args.n, agent=args.agent,
                            command=list(args.command), cli=cli if args.agent and harbor is None else None,
                            model=model, harbor=harbor,
                            mode=args.mode, train=args.train, agent_timeout_s=args.agent_timeout,
                            verifier_timeout_s=args.verifier_timeout, keep=args.keep, run_id=plan.run_id,
                            judge=args.judge)
        runner = TaskRunner(tasks, settings, client, rounds=args.rounds, concurrency=args.concurrency,
                            infra_retries=args.infra_retries)
        progress = Progress(len(runner.todo()), "episodes")
        runner.on_result = lambda line: progress.update(line["reward"], infra=str(runner.infra_errors))
        main = asyncio.ensure_future(runner.run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, main.cancel)
        interrupted = False
        try:
            await main
        except asyncio.CancelledError:
            interrupted = True
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            progress.close()
    return runner, interrupted


def _print_summary(runner: TaskRunner, args: argparse.Namespace, interrupted: bool) -> None:
    lines = runner.state
    rows = report.per_task(lines, args.threshold)
    out: dict[str, Any] = {"run_dir": str(runner.s.run_dir), "interrupted": interrupted,
                           "not_started": runner.not_started, **report.summary(lines, args.threshold),
                           "tasks": rows}
    if args.mode == "eval":
        out["by_version"] = report.by_version(lines, args.threshold, args.ks)
    if args.json:
        print(json.dumps(out))
        return
    print(report.table(rows, [("task", "task"), ("episodes", "episodes"), ("passed", "passed"),
                              ("pass_rate", "pass rate"), ("reward_mean", "mean reward"),
                              ("infra_errors", "infra errors")]), flush=True)
    if args.mode == "eval":
        versions = [{"version": v, **row} for v, row in out["by_version"].items()]
        cols = [("version", "policy version"), ("tasks", "tasks"), ("episodes", "episodes")]
        print(report.table(versions, cols + [(f"pass@{k}", f"pass@{k}") for k in args.ks]), flush=True)
    causes = ", ".join(f"{k} {v}" for k, v in out["infra_errors"].items()) or "none"
    print(f"{out['episodes']} episodes, {out['passed']} passed; infrastructure errors: {causes} "
          f"({out['infra_retried']} retried, {out['short_groups']} groups short); state in {out['run_dir']}",
          file=sys.stderr)


def main_run(argv: list[str]) -> int:
    args = _parse_run(argv)
    try:
        dataset, tasks = _dataset(args)
        problem = unscored(tasks, args.judge)
        if problem:
            raise RunError(problem)
        sb = _sandbox(args)
        runner, interrupted = asyncio.run(_run(args, dataset, tasks, sb))
    except (TaskError, RunError, RunDirError) as exc:
        print(f"{PROG} run: {exc}", file=sys.stderr)
        return 2
    _print_summary(runner, args, interrupted)
    if interrupted:
        return 130
    return 0 if runner.not_started == 0 else 1


def main_check(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} check", description="Check each task: its reference solution "
                                "passes its verifier, and doing nothing fails it (no proxy needed).")
    _common(p)
    args = p.parse_args(argv)
    try:
        dataset, tasks = _dataset(args)
        sb, harbor = _sandbox(args), _harbor(args)
    except (TaskError, RunError) as exc:
        print(f"{PROG} check: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="steptap-check-"))
    try:
        results = asyncio.run(check_all(sb, tasks, work, args.threshold, max(1, args.concurrency or 2),
                                        harbor=harbor))
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    rows = [{"task": c.task, "solution": c.solution, "noop": c.noop, "ok": "ok" if c.ok else "FAIL",
             "why": c.problem or ""} for c in results]
    print(report.table(rows, [("task", "task"), ("solution", "solution"), ("noop", "no-op"), ("ok", "check"),
                              ("why", "")]), flush=True)
    failed = sum(not c.ok for c in results)
    print(f"{len(results) - failed}/{len(results)} tasks of {dataset.name} pass the check"
          + (f"; kept in {work}" if args.keep else ""), file=sys.stderr)
    return 1 if failed else 0


def main_list(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} list", description="List a dataset's tasks and their identity.")
    p.add_argument("dataset")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        dataset = load(args.dataset)
    except TaskError as exc:
        print(f"{PROG} list: {exc}", file=sys.stderr)
        return 2
    rows = [{"task": t.name, "hash": t.id.hash, "agent_timeout_s": t.agent_timeout_s,
             "verifier_timeout_s": t.verifier_timeout_s, "solution": "yes" if t.solution else "no"}
            for t in dataset.tasks]
    if args.json:
        print(json.dumps({"dataset": dataset.name, "tasks": rows}))
    else:
        print(report.table(rows, [("task", "task"), ("hash", "hash"), ("agent_timeout_s", "agent s"),
                                  ("verifier_timeout_s", "verifier s"), ("solution", "solution")]))
    return 0


def main_install_harbor(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} install-harbor", description="Build Harbor's own virtualenv "
                                "(it needs Python >= 3.12), once per machine, for --sandbox harbor.")
    p.add_argument("--python", default=None, help="the Python >= 3.12 to build it from (default: one found)")
    args = p.parse_args(argv)
    try:
        python = install(args.python)
    except (HarborError, OSError, subprocess.CalledProcessError, RuntimeError) as exc:
        print(f"{PROG} install-harbor: {exc}", file=sys.stderr)
        return 2
    print(f"Harbor is installed: {python}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"run": main_run, "check": main_check, "list": main_list,
                "install-harbor": main_install_harbor}
    if not argv or argv[0] not in commands:
        print(f"usage: {PROG} {{run,check,list,install-harbor}} ...\n\n{(__doc__ or '').strip()}",
              file=sys.stderr if argv else sys.stdout)
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) and not argv[1:] else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
