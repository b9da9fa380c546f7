"""``steptap env run DATA.parquet`` (GRPO groups from a dataset), ``steptap env list``, and ``steptap eval``.

    steptap env run data/train.parquet --n 8 --concurrency 16 --epochs 2
    steptap env run data/train.parquet --n 8 --lockstep 4   # 4 groups, then wait for their update
    steptap eval data/test.parquet                       # accuracy by policy version, as eval sessions
    steptap eval data/test.parquet --every 5 --metrics-file runs/x/metrics.jsonl   # beside a learner

The proxy URL and control token come from ``--proxy``/``--control-token`` or STEPTAP_URL /
STEPTAP_CONTROL_TOKEN.
``env run`` keeps a state file (default ``DATA.parquet.state.jsonl``) so that a restarted run skips the groups
already finished; ``--fresh`` starts over. ``eval --every K`` watches the proxy's policy version and evaluates
at the start and after every K new versions, appending one row per version to the metrics file
(``eval_accuracy``, ``eval_version``), which ``steptap plot`` draws beside the training reward; on SIGUSR1
(what ``steptap up`` sends when its run ends on its update count) it evaluates the version then serving,
unless it just did, and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from steptap.adapters.env.dataset import DatasetError, env_names, read_rows
from steptap.adapters.env.runner import DatasetRunner, RunConfig, Tally, policy_version
from steptap.adapters.judge import add_judge_flags, judge_from_args
from steptap.adapters.progress import Progress
from steptap.adapters.session import TOKEN_ENV, URL_ENV
from steptap.middleware.client import TOKEN_FILE_ENV, default_control_token, forget_control_token


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="parquet dataset (prompt, reward_model, agent_name, env_kwargs)")
    p.add_argument("--proxy", default=os.environ.get(URL_ENV), help=f"proxy URL (default ${URL_ENV})")
    p.add_argument("--control-token", help=f"default ${TOKEN_ENV}, else the file ${TOKEN_FILE_ENV} names "
                   "(what `steptap up` gives its --agents)")
    p.add_argument(
        "--env", help="environment for every row (a registered name or module:attr / file.py:attr)"
    )
    p.add_argument("--trust-dataset-code", action="store_true",
                   help="let rows' agent_name import module:attr or file.py:attr (default: registered names "
                        "only)")
    p.add_argument("--model", help="model name to request (default: the one the proxy serves)")
    p.add_argument("--concurrency", type=int, default=16, help="episodes at once")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, help="model calls per episode (default: the environment's)")
    p.add_argument("--limit", type=int, help="only the first N rows")


def _config(args: argparse.Namespace, mode: str, n: int, epochs: int, state: str | None) -> RunConfig:
    return RunConfig(
        proxy_url=args.proxy.rstrip("/"),
        control_token=args.control_token,
        n=n,
        concurrency=args.concurrency,
        epochs=epochs,
        mode=mode,
        env=args.env,
        trust_dataset_code=args.trust_dataset_code,
        model=args.model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        max_steps=args.max_steps,
        state_file=state,
        name=Path(args.data).stem,
    )


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.proxy:
        p.error(f"no proxy URL: pass --proxy or set {URL_ENV}")
    if not args.control_token:
        try:
            args.control_token = default_control_token()
        except ValueError as exc:
            p.error(str(exc))
    if not args.control_token:
        p.error(f"no control token: pass --control-token or set {TOKEN_ENV} (or {TOKEN_FILE_ENV})")
    if args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    forget_control_token()  # read: no environment, tool or grader started from here inherits it


def _load(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[Any]:
    try:
        rows = read_rows(args.data)
    except (DatasetError, ImportError) as exc:
        p.exit(2, f"{p.prog}: {exc}\n")
    return rows[: args.limit] if args.limit else rows


def _run(rows: list[Any], cfg: RunConfig, desc: str) -> Tally:
    runner = DatasetRunner(rows, cfg)
    progress = Progress(len(runner.todo()) * cfg.n, desc)
    runner.on_episode = lambda ep: progress.update(ep.reward)
    try:
        asyncio.run(runner.run())
    finally:
        progress.close()
    return runner.tally


def main_env(argv: list[str] | None = None) -> int:
    """``steptap env run|list``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["list"]:
        names = env_names()
        for name, target in sorted(names.items()):
            print(f"{name:<16} {target}")
        if not names:
            print("no environments registered (entry-point group 'steptap.envs')")
        return 0
    p = argparse.ArgumentParser(prog="steptap env run", description="Run a parquet dataset as GRPO groups.")
    _common(p)
    p.add_argument("--n", type=int, default=8, help="sessions per row (one GRPO group)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--state", help="state file of finished groups (default DATA.state.jsonl)")
    p.add_argument("--fresh", action="store_true", help="ignore (and replace) the state file: redo every row")
    p.add_argument("--lockstep", type=int, default=0, metavar="G",
                   help="run G groups (the learner's batch_groups), then wait for the update they feed "
                        "before the next G: each batch is sampled by the newest weights and, on a small CPU, "
                        "the learner trains with the machine to itself (default 0: every group at once)")
    p.add_argument("--update-timeout", type=float, default=3600.0, metavar="S",
                   help="with --lockstep: seconds a batch waits for its update before going on "
                        "(default 3600)")
    add_judge_flags(p)  # a judge's reward besides the environment's (docs/judge.md)
    if argv[:1] != ["run"]:
        p.print_usage(sys.stderr)
        print("steptap env: expected `run DATA.parquet [...]` or `list`", file=sys.stderr)
        return 2
    args = p.parse_args(argv[1:])
    _check(p, args)
    if args.n < 1 or args.epochs < 1:
        p.error("--n and --epochs must be at least 1")
    if args.lockstep < 0 or args.update_timeout <= 0:
        p.error("--lockstep must be 0 or more, --update-timeout above 0")
    state = args.state or f"{args.data}.state.jsonl"
    if args.fresh and Path(state).exists():
        Path(state).unlink()
    rows = _load(p, args)
    cfg = _config(args, "train", args.n, args.epochs, state)
    cfg.judge = judge_from_args(args, p.error)
    cfg.lockstep, cfg.update_timeout_s = args.lockstep, args.update_timeout
    report = {**_run(rows, cfg, "episodes").summary(), "state_file": state}
    print(json.dumps(report))
    return 0 if report["failed_to_start"] == 0 else 1


def evaluate(rows: list[Any], cfg: RunConfig, metrics_file: str | None = None) -> dict[str, Any]:
    """One evaluation pass; returns ``{"by_version": {...}, **summary}`` and appends to ``metrics_file``."""
    tally = _run(rows, cfg, "eval")
    by_version = tally.by_version()
    if metrics_file:
        Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
        with open(metrics_file, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(
                        {
                            "time": time.time(),
                            "eval_version": version,
                            "eval_accuracy": acc["accuracy"],
                            "eval_episodes": acc["episodes"],
                            "eval_reward_mean": acc["reward_mean"],
                            "eval_turns_mean": acc["turns_mean"],
                            "eval_tool_call_rate": acc["tool_call_rate"],
                            "eval_well_formed_rate": acc["well_formed_rate"],
                        }
                    )
                    + "\n" for version, acc in by_version.items())
    return {"by_version": by_version, **tally.summary()}


def main_eval(argv: list[str] | None = None) -> int:
    """``steptap eval DATA.parquet``: eval sessions; accuracy by policy version."""
    p = argparse.ArgumentParser(prog="steptap eval", description=(main_eval.__doc__ or "").partition(": ")[2])
    _common(p)
    p.add_argument("--n", type=int, default=1, help="sessions per row")
    p.add_argument("--metrics-file", help="append eval_accuracy rows here (the learner's metrics file)")
    p.add_argument(
        "--every", type=int, help="watch the proxy: evaluate again after every K new policy versions"
    )
    p.add_argument("--poll", type=float, default=5.0, help="seconds between version checks with --every")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    _check(p, args)
    rows = _load(p, args)
    cfg = _config(args, "eval", max(1, args.n), 1, None)
    if not args.every:
        report = evaluate(rows, cfg, args.metrics_file)
        _print_report(report, args.json)
        return 0 if report["failed_to_start"] == 0 else 1
    last: int | None = None
    final: list[int] = []  # SIGUSR1 (steptap up, its run over): evaluate the version now, then exit
    signal.signal(signal.SIGUSR1, lambda signum, _frame: final.append(signum))
    try:
        while True:  # ends with SIGTERM / Ctrl-C (steptap up stops it with the rest), or after SIGUSR1
            version = policy_version(cfg.proxy_url, cfg.control_token)
            if version is not None and (last is None or version >= last + args.every
                                        or (final and version != last)):
                last = version
                _print_report(evaluate(rows, cfg, args.metrics_file), args.json)
                continue  # asked again at once: a SIGUSR1 during the evaluation wants the version now
            if final:
                return 0
            time.sleep(args.poll)
    except KeyboardInterrupt:
        return 130


def _print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report), flush=True)
        return
    for version, acc in report["by_version"].items():
        tools = (
            f", tool calls {acc['tool_call_rate']:.2f}, well-formed {acc['well_formed_rate']:.2f}"
            if acc.get("tool_call_rate") is not None
            else ""
        )
        print(
            f"policy version {version}: accuracy {acc['accuracy']:.3f} ({acc['correct']}/{acc['episodes']})"
            f"{tools}, turns {acc['turns_mean']:.2f}",
            flush=True,
        )
    if not report["by_version"]:
        print(f"no episode finished ({report['errors'] or 'no rows'})", flush=True)


__all__ = ["evaluate", "main_env", "main_eval"]
