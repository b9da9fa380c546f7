"""The recipe's agent driver: pi on the training tasks as GRPO groups, the held-out tasks every few versions.

    steptap up ... --agents "python examples/pi_learns/loop.py data/pi --workdir runs/pi --eval-every 3"

Run as `steptap up`'s ``--agents`` command (it gets STEPTAP_URL and STEPTAP_CONTROL_TOKEN_FILE), it starts
``steptap tasks run DATA/train --agent pi -n N`` (each training task a group of N pi episodes in local
sandboxes; the learner trains complete groups as they come) and, at policy version 0 and every
``--eval-every`` versions after, ``steptap tasks run DATA/test --mode eval --agent pi -n 1 --limit L``: eval
sessions, never trained on. Each evaluation appends one row per policy version that answered to the metrics
file (``eval_version``, ``eval_accuracy`` = pass@1, ``eval_tool_call_rate``: episodes whose pi made at least
one tool call, ``eval_turns_mean``: model calls per episode, ``eval_accuracy_by_kind``: the pass rate of each
kind of task, by its name's first word), which ``steptap plot`` draws. Both runs keep
their state under ``--workdir``: the same command resumes them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from itertools import zip_longest
from pathlib import Path
from typing import Any

from steptap.adapters.tasks import report
from steptap.middleware.client import SteptapError, SyncSteptapClient, default_control_token

TASKS = [sys.executable, "-m", "steptap.middleware.cli", "tasks", "run"]
SKIP_SETTLE_S = 30.0  # no update and no new skipped group for this long: the learner waits for more groups


def in_turn(names: Iterable[str], first: str | None = None) -> list[str]:
    """Training tasks with their kinds in turn (``product-…``, ``count-…``, ``offbyone-…``), each kind in name
    order: sorted names would run every task of one kind before the next kind's first. ``first``: that kind's
    tasks all come before the others' (a curriculum)."""
    kinds: dict[str, list[str]] = {}
    for name in sorted(names):
        kinds.setdefault(name.split("-", 1)[0], []).append(name)
    if first is not None and first not in kinds:
        raise ValueError(f"no training task of the kind {first!r} (kinds: {', '.join(kinds)})")
    head = kinds.pop(first, []) if first is not None else []
    return head + [name for row in zip_longest(*kinds.values()) for name in row if name is not None]


def train_names(data: Path) -> list[str]:
    """The training tasks' names (make_tasks.py's ``--out``: ``train/<task>/``)."""
    return [d.name for d in (data / "train").iterdir() if d.is_dir()]


def _version(client: SyncSteptapClient) -> int:
    try:
        return int(client.health().get("policy_version", 0))
    except (OSError, ValueError, SteptapError):  # the proxy restarting: ask again at the next poll
        return -1


def eval_rows(summary: dict[str, Any], client: SyncSteptapClient, run_dir: Path) -> list[dict[str, Any]]:
    """One metrics row per policy version that answered: pass@1, the tool-call rate and turns per episode."""
    per: dict[int, dict[str, list[float]]] = {}
    kinds: dict[int, dict[str, list[bool]]] = {}
    lines = (run_dir / "state.jsonl").read_text().splitlines()
    for rec in report.latest([json.loads(line) for line in lines]):  # an episode retried: its last attempt
        if rec.get("status") != "finished" or rec.get("policy_version") is None:
            continue
        steps = client.get_session(rec["session_id"]).steps
        called = any((s.response or {}).get("tool_calls") for s in steps)
        version = int(rec["policy_version"])
        row = per.setdefault(version, {"calls": [], "turns": []})
        row["calls"].append(1.0 if called else 0.0)
        row["turns"].append(float(len(steps)))
        kinds.setdefault(version, {}).setdefault(rec["task"].split("-", 1)[0], []).append(
            report.passed(rec, report.PASS_THRESHOLD))  # the runner's default: the exact outcome
    out = []
    for version, figures in sorted(summary.get("by_version", {}).items(), key=lambda kv: int(kv[0])):
        got = per.get(int(version), {"calls": [], "turns": []})
        n = len(got["turns"])
        out.append({"time": time.time(), "eval_version": int(version), "eval_accuracy": figures["pass@1"],
                    "eval_episodes": figures["episodes"],
                    "eval_tool_call_rate": sum(got["calls"]) / n if n else None,
                    "eval_turns_mean": sum(got["turns"]) / n if n else None,
                    "eval_accuracy_by_kind": {k: sum(v) / len(v)
                                              for k, v in sorted(kinds.get(int(version), {}).items())}})
    return out


def evaluate(args: argparse.Namespace, client: SyncSteptapClient, version: int) -> None:
    run_dir = args.workdir / f"eval-v{version}"
    cmd = [*TASKS, str(args.data / "test"), "--agent", "pi", "--mode", "eval", "-n", "1", "--limit",
           str(args.eval_limit), "--concurrency", str(args.concurrency), "--run-dir", str(run_dir), "--json",
           "--agent-timeout", str(args.agent_timeout)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = out.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        print(f"loop: the evaluation at version {version} printed no summary (exit {out.returncode})",
              file=sys.stderr, flush=True)
        return
    rows = eval_rows(json.loads(lines[-1]), client, run_dir)
    with args.metrics_file.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for r in rows:
        print(f"loop: held-out at version {r['eval_version']}: pass@1 {r['eval_accuracy']:.3f} over "
              f"{r['eval_episodes']} episodes, tool calls {r['eval_tool_call_rate']}, turns "
              f"{r['eval_turns_mean']}", flush=True)


def _train_cmd(args: argparse.Namespace, run_dir: Path, rounds: int, tasks: list[str]) -> list[str]:
    picked = [a for name in tasks for a in ("--task", name)]
    return [*TASKS, str(args.data / "train"), "--agent", "pi", "-n", str(args.n), "--rounds", str(rounds),
            "--concurrency", str(args.concurrency), "--run-dir", str(run_dir),
            "--agent-timeout", str(args.agent_timeout), *picked]


class Driver:
    """The training runs and the evaluations due, one child process at a time (SIGTERM stops the current)."""

    def __init__(self, args: argparse.Namespace, client: SyncSteptapClient) -> None:
        self.args, self.client = args, client
        self.child: subprocess.Popen[bytes] | None = None
        self.next_eval: int | None = None if args.no_eval else 0
        self.evaluated = -1  # the last version evaluated

    def stop(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.terminate()
            self.child.wait()

    def eval_if_due(self, version: int, last: bool = False) -> None:
        """At version 0, every ``--eval-every`` versions after, and (``last``) the run's last version."""
        due = version >= self.next_eval if self.next_eval is not None else False
        if due or (last and self.next_eval is not None and version not in (self.evaluated, -1)):
            evaluate(self.args, self.client, version)
            self.evaluated, self.next_eval = version, version + self.args.eval_every

    def trained_enough(self) -> bool:
        """``--updates N``: version N is served, so training stops (and ``main`` evaluates it)."""
        return bool(self.args.updates) and _version(self.client) >= self.args.updates

    def free_running(self) -> int:
        """Every training task at once; the learner trains beside the agents as groups complete."""
        cmd = _train_cmd(self.args, self.args.workdir / "train", self.args.rounds, [])
        self.child = subprocess.Popen(cmd)
        while self.child.poll() is None:
            if self.trained_enough():
                self.stop()
                return 0
            self.eval_if_due(_version(self.client))
            time.sleep(5)
        return int(self.child.returncode or 0)

    def lockstep(self, groups: int) -> int:
        """``groups`` training tasks (one update's batch), then wait for the update they feed: the learner
        trains with the machine to itself, and every group is sampled by the latest version. With the
        learner's ``skip_uniform_groups``, a task whose group it skipped (all one reward) runs again, up to
        ``--resample`` times, before the wait goes on. Each batch appends its budget to the metrics file
        (``lockstep_*``: the episodes' wall time with their verifiers, then the wait for the new version: the
        update, writing the adapter and the swap; the tasks resampled)."""
        names = in_turn(train_names(self.args.data), self.args.first)
        chunks = [names[i:i + groups] for i in range(0, len(names), groups)]
        done = self._batches_done()
        for r in range(self.args.rounds):
            for k, chunk in enumerate(chunks):
                if (r, k) in done:  # a resumed run: its update came (a run dir alone says less)
                    continue
                if self.trained_enough():
                    return 0
                rc = self._batch(r, k, chunk)
                if rc:
                    return rc
        return 0

    def _batch(self, r: int, k: int, chunk: list[str]) -> int:
        version = _version(self.client)
        self.eval_if_due(version)
        t0, episodes_s, todo, resampled = time.monotonic(), 0.0, chunk, []
        for attempt in range(self.args.resample + 1):
            since = self._metrics_size()
            run_dir = self.args.workdir / "train" / (f"r{r}-b{k}" + (f"-a{attempt}" if attempt else ""))
            t1 = time.monotonic()
            self.child = subprocess.Popen(_train_cmd(self.args, run_dir, 1, todo))
            if self.child.wait() != 0:
                return self.child.returncode
            episodes_s += time.monotonic() - t1
            outcome = self._wait_update(version, todo, since)
            if not isinstance(outcome, list):
                break
            todo = outcome
            resampled += todo if attempt < self.args.resample else []
        if outcome is False:
            print(f"loop: no update within {self.args.update_timeout:.0f} s of batch {k} of round {r}"
                  f" (version {version}); going on", file=sys.stderr, flush=True)
        elif outcome is not True:
            print(f"loop: the learner skipped {', '.join(outcome)} (one reward for the group) after "
                  f"{self.args.resample} resample(s); going on", file=sys.stderr, flush=True)
        row = {"time": time.time(), "lockstep_round": r, "lockstep_batch": k, "lockstep_tasks": chunk,
               "lockstep_version": version, "lockstep_episodes_s": round(episodes_s, 1),
               "lockstep_update_s": round(time.monotonic() - t0 - episodes_s, 1),
               "lockstep_resampled": resampled, "lockstep_updated": outcome is True}
        with self.args.metrics_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        return 0

    def _rows(self, since: int = 0) -> list[dict[str, Any]]:
        if not self.args.metrics_file.exists():
            return []
        with self.args.metrics_file.open("rb") as f:
            f.seek(since)
            lines = f.read().decode("utf-8", "replace").splitlines()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:  # a row the learner is writing now
                continue
        return out

    def _metrics_size(self) -> int:
        return self.args.metrics_file.stat().st_size if self.args.metrics_file.exists() else 0

    def _batches_done(self) -> set[tuple[int, int]]:
        return {(r["lockstep_round"], r["lockstep_batch"]) for r in self._rows() if "lockstep_batch" in r}

    def _wait_update(self, version: int, tasks: list[str], since: int) -> bool | list[str]:
        """True when a new version came; the tasks whose groups the learner skipped (``skipped_group`` rows
        since ``since``), once all are, or once no row has come for ``SKIP_SETTLE_S`` after one did (the
        learner waits for more groups); False at the timeout."""
        deadline = time.monotonic() + self.args.update_timeout
        skipped: list[str] = []
        settled_at = 0.0
        while time.monotonic() < deadline:
            if _version(self.client) > version:
                return True
            now = [t for t in tasks if any(f"-{t}-" in str(row.get("skipped_group", ""))
                                           for row in self._rows(since))]
            if now != skipped:
                skipped, settled_at = now, time.monotonic() + SKIP_SETTLE_S
            if skipped and (len(skipped) == len(tasks) or time.monotonic() >= settled_at):
                return skipped
            time.sleep(2)
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("data", type=Path, help="make_tasks.py's --out: train/ and test/")
    p.add_argument("--workdir", type=Path, default=Path("runs/pi"), help="steptap up's --workdir")
    p.add_argument("--metrics-file", type=Path, default=None, help="default: WORKDIR/metrics.jsonl")
    p.add_argument("-n", type=int, default=8, help="episodes per training task (the learner's group_size)")
    p.add_argument("--rounds", type=int, default=1, help="times through the training split")
    p.add_argument("--concurrency", type=int, default=4, help="pi episodes at once, per run")
    p.add_argument("--eval-every", type=int, default=3, help="policy versions between evaluations")
    p.add_argument("--eval-limit", type=int, default=50, help="held-out tasks per evaluation")
    p.add_argument("--agent-timeout", type=float, default=900.0,
                   help="seconds a pi episode may run (the tasks say 180: on a loaded 2-core CPU most pi "
                        "episodes ran past that mid-call, and a cut call trains nothing)")
    p.add_argument("--lockstep", type=int, default=0, metavar="G",
                   help="run G training tasks (the learner's batch_groups), then wait for the update they "
                        "feed before the next G, evaluating between: on a small CPU the learner then trains "
                        "alone instead of beside vLLM (0: every task at once, training beside the agents)")
    p.add_argument("--resample", type=int, default=0, metavar="K",
                   help="with --lockstep and the learner's skip_uniform_groups: run a task whose group was "
                        "skipped (every episode one reward) again, up to K times (dynamic sampling)")
    p.add_argument("--first", metavar="KIND", default=None,
                   help="with --lockstep: every training task of KIND (product, count, offbyone) before the "
                        "other kinds' in each round, a curriculum (default: the kinds in turn)")
    p.add_argument("--update-timeout", type=float, default=3600.0,
                   help="with --lockstep: seconds to wait for an update before going on")
    p.add_argument("--updates", type=int, default=0, metavar="N",
                   help="stop training once version N is served, evaluate it, and exit (steptap up then "
                        "stops: 'the agents finished'); steptap up's own --max-updates stops the whole stack "
                        "at once, before an evaluation of that last version (0: the rounds decide)")
    p.add_argument("--no-eval", action="store_true", help="training only")
    args = p.parse_args(argv)
    if args.lockstep < 0 or args.resample < 0 or args.updates < 0:
        p.error("--lockstep, --resample and --updates: a number, 0 for none")
    if args.first is not None and not args.lockstep:
        p.error("--first orders the lockstep batches: it needs --lockstep")
    if args.first is not None:
        try:
            in_turn(train_names(args.data), args.first)
        except (ValueError, OSError) as e:
            p.error(f"--first: {e}")
    args.metrics_file = args.metrics_file or args.workdir / "metrics.jsonl"
    url = os.environ.get("STEPTAP_URL")
    if not url:
        p.error("no STEPTAP_URL: run this as `steptap up --agents`, or export the proxy's URL and token")
    driver = Driver(args, SyncSteptapClient(url, default_control_token()))

    def _terminated(*_: object) -> None:
        driver.stop()
        sys.exit(143)

    signal.signal(signal.SIGTERM, _terminated)
    try:
        rc = driver.lockstep(args.lockstep) if args.lockstep else driver.free_running()
        driver.eval_if_due(_version(driver.client), last=True)
        return rc
    finally:
        driver.stop()


if __name__ == "__main__":
    sys.exit(main())
