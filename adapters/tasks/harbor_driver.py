"""Run inside Harbor's own virtualenv (Python >= 3.12, ``harbor`` installed; ``harbor.py`` builds it): one
Harbor trial of one task, the agent's model endpoint being the episode's session URL.

Reads a JSON request on stdin, runs ``harbor.trial.trial.Trial`` (Harbor's environment: docker, podman, a
hosted one, or one named by import path; Harbor's agent by name or import path; Harbor's verifier, which
uploads the tests only after the agent phase), and prints one JSON line: the rewards Harbor's verifier read,
the exception the trial recorded (its type name and message), the phases' seconds and the tail of the
verifier's output. It imports no steptap module: only Harbor and the standard library.

    request = {"task_dir", "trials_dir", "environment": {"type" | "import_path", "kwargs"},
               "agent": {"name" | "import_path", "model", "base_url", "kwargs", "env"},
               "agent_timeout_s", "verifier_timeout_s"}
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

TAIL = 8192


def _seconds(timing: Any) -> float:
    if timing is None or timing.started_at is None or timing.finished_at is None:
        return 0.0
    return round((timing.finished_at - timing.started_at).total_seconds(), 3)


def _tail(path: Path) -> str:
    try:
        return path.read_bytes()[-TAIL * 4:].decode("utf-8", "replace")[-TAIL:]
    except OSError:
        return ""


def _config(req: dict[str, Any]) -> Any:
    from harbor.models.trial.config import (
        AgentConfig,
        EnvironmentConfig,
        TaskConfig,
        TrialConfig,
        VerifierConfig,
    )

    env, agent = req["environment"], req["agent"]
    task_dir = Path(req["task_dir"])
    return TrialConfig(
        task=TaskConfig(path=task_dir),
        trial_name=req.get("trial_name") or f"{task_dir.name}-steptap",
        trials_dir=Path(req["trials_dir"]),
        agent=AgentConfig(name=agent.get("name"), import_path=agent.get("import_path"),
                          model_name=agent.get("model"), base_url=agent.get("base_url"),
                          model_api_key_name=agent.get("api_key_env"),
                          model_api_format=agent.get("api_format"),
                          skip_model_parsing=bool(agent.get("skip_model_parsing")),
                          override_timeout_sec=req.get("agent_timeout_s"), kwargs=agent.get("kwargs") or {},
                          env=agent.get("env") or {}),
        environment=EnvironmentConfig(type=env.get("type"), import_path=env.get("import_path"),
                                      kwargs=env.get("kwargs") or {}),
        verifier=VerifierConfig(override_timeout_sec=req.get("verifier_timeout_s")),
    )


def resolve(req: dict[str, Any]) -> dict[str, Any]:
    """The agent's model connection as Harbor resolves it from the request, without a trial (a preflight:
    an agent that does not take the session URL says so before any container starts)."""
    import tempfile

    from harbor.agents.factory import AgentFactory

    config = _config(req)
    with tempfile.TemporaryDirectory(prefix="steptap-harbor-") as logs:  # a preflight runs no agent
        agent = AgentFactory.create_agent_from_config(config.agent, logs_dir=Path(logs))
        connection = agent.model_connection
    api_format = connection.model_api_format
    return {"base_url": connection.resolved_base_url,
            "api_format": getattr(api_format, "value", api_format)}


async def run(req: dict[str, Any]) -> dict[str, Any]:
    from harbor.trial.trial import Trial

    config = _config(req)
    trial = await Trial.create(config)
    result = await trial.run()
    exc = result.exception_info
    rewards = result.verifier_result.rewards if result.verifier_result is not None else None
    verifier_dir = Path(result.trial_uri.removeprefix("file://")) / "verifier"
    return {
        "rewards": rewards,
        "exception": None if exc is None else {"type": exc.exception_type, "message": exc.exception_message},
        "agent_started": result.agent_execution is not None,
        "agent_seconds": _seconds(result.agent_execution),
        "verifier_ran": result.verifier is not None,
        "verifier_seconds": _seconds(result.verifier),
        "verifier_output": _tail(verifier_dir / "test-stdout.txt"),
    }


def main() -> int:
    req = json.loads(sys.stdin.read())
    try:
        out = resolve(req) if req.get("resolve_only") else asyncio.run(run(req))
    except Exception as exc:  # noqa: BLE001 - any failure to even run the trial is reported, not raised
        out = {"rewards": None, "exception": {"type": type(exc).__name__, "message": str(exc)[:2000]},
               "agent_started": False, "setup_failed": True}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
