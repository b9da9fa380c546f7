"""Run by the tests in Harbor's own virtualenv (Python >= 3.12, steptap tasks install-harbor;
tests/harbor_venv.py finds it): steptap's Harbor formats read by Harbor's own code.

    python harbor_check.py rollout FILE      # each line of a `steptap export --format rollout-detail`
    python harbor_check.py lint TASK_DIR...  # Harbor's linter on task directories

Prints one JSON summary line; exits 1 with the problems on stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Harbor's default rules plus root-agent, less shared-verifier: the built-in tasks run their verifier in the
# agent's environment after the agent has gone (the layout of steptap's local sandbox: /app as the agent left
# it, /tests put in only then); separate mode would hand the verifier a copy of /app somewhere else.
LINT_IGNORED = {"shared-verifier"}


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON (a NaN logprob equals itself)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def rollout(path: str) -> dict[str, Any]:
    """Each line's agent_result read as Harbor reads a trial's (``AgentContext`` from JSON), every
    RolloutDetail validated strictly, the verifier_result as a ``VerifierResult``; nothing may be dropped or
    coerced on the way (what Harbor holds, dumped back, is what the line holds)."""
    from harbor.models.agent.context import AgentContext
    from harbor.models.agent.rollout_detail import RolloutDetail
    from harbor.models.verifier.result import VerifierResult
    from pydantic import TypeAdapter

    detail = TypeAdapter(RolloutDetail)
    lines = turns = 0
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        record = json.loads(line)
        agent = AgentContext.model_validate_json(json.dumps(record["agent_result"]))
        held = agent.model_dump(mode="json")
        if not _same(held, record["agent_result"]):
            raise SystemExit(f"line {number}: AgentContext holds {held}, the line {record['agent_result']}")
        for d in record["agent_result"]["rollout_details"]:
            if set(d) - set(RolloutDetail.__annotations__):
                raise SystemExit(f"line {number}: keys RolloutDetail does not have: {sorted(d)}")
            if not _same(detail.validate_python(d, strict=True), d):
                raise SystemExit(f"line {number}: a RolloutDetail changed when validated")
            n = len(d["completion_token_ids"])
            if not all(len(d[k]) == n for k in ("prompt_token_ids", "logprobs")) or not all(
                    len(v) == n for v in d["extra"].values()):
                raise SystemExit(f"line {number}: per-turn lists of different lengths")
            turns += n
        verifier = VerifierResult.model_validate(record["verifier_result"])
        if not _same(verifier.model_dump(mode="json"), record["verifier_result"]):
            raise SystemExit(f"line {number}: VerifierResult holds {verifier}")
        lines += 1
    return {"lines": lines, "turns": turns}


def lint(task_dirs: list[str]) -> dict[str, Any]:
    from harbor.lint import lint_task
    from harbor.lint.models import DEFAULT_RULES, LintRule
    from harbor.models.task.task import Task

    rules = (set(DEFAULT_RULES) | {LintRule.ROOT_AGENT}) - {LintRule(r) for r in LINT_IGNORED}
    findings = [f for d in task_dirs for f in lint_task(Path(d).resolve(), selected_rules=rules)]
    if findings:
        raise SystemExit("\n".join(f"{f.path}:{f.line or ''} [{f.rule}] {f.message}" for f in findings))
    tasks = [Task(d) for d in task_dirs]  # Harbor loads each as it loads a task to run
    return {"tasks": len(tasks), "rules": sorted(str(r) for r in rules),
            "agent_timeouts": sorted({t.config.agent.timeout_sec for t in tasks})}


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    print(json.dumps(rollout(args[0]) if command == "rollout" else lint(args)))
