"""Episodes in containers, through Harbor's own environments (docker, podman, the hosted ones, or one named by
import path) rather than a second copy of them (docs/tasks.md, "Containers").

Harbor needs Python >= 3.12, so it lives in a virtualenv of its own (as vLLM does), built once per machine by
``steptap tasks install-harbor`` (``venvs.build_once``) from a Python 3.12+ it finds (``--python`` to name
one). Each episode runs ``harbor_driver.py`` there: one Harbor trial of the task (its environment built from
``environment/``, its agent, its verifier, which uploads the tests only after the agent phase), the agent's
model endpoint being the episode's session URL as the containers reach the proxy (``--container-proxy``). Its
result is mapped here: the verifier's rewards, or an infrastructure error by the exception Harbor recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steptap.adapters.agent_settings import KEY_ENV
from steptap.middleware.client import TOKEN_ENV, TOKEN_FILE_ENV
from steptap.middleware.files import cache_root
from steptap.middleware.launch.venvs import build_once
from steptap.middleware.records import ProcessEnd

if TYPE_CHECKING:
    from steptap.adapters.tasks.episode import Episode
    from steptap.adapters.tasks.format import Task

HARBOR = "harbor==0.25.0"
HARBOR_CONSTRAINTS = Path(__file__).with_name("harbor-constraints.txt")  # what Harbor pulls in, pinned
PYTHON_ENV = "STEPTAP_HARBOR_PYTHON"  # the Python of a Harbor install of your own
PATH_ENV = "STEPTAP_HARBOR_PYTHONPATH"  # where Harbor finds environments and agents named by import path
# Harbor's exceptions that are the infrastructure's, by cause; anything else that ends a trial without a
# reward is "sandbox" before the agent ran and "other" after. The agent's own (a timeout, a non-zero exit) are
# judged.
CAUSES = {"EnvironmentStartTimeoutError": "sandbox", "AgentSetupTimeoutError": "sandbox",
          "VerifierTimeoutError": "verifier_timeout", "RewardFileNotFoundError": "verifier_crash",
          "RewardFileEmptyError": "verifier_crash", "VerifierOutputParseError": "verifier_crash",
          "AddTestsDirError": "verifier_crash", "DownloadVerifierDirError": "verifier_crash"}
AGENT_FAILURES = ("AgentTimeoutError", "NonZeroAgentExitCodeError")
# How each of Harbor's installed agents takes the session URL (harbor 0.25's agent configs, checked by
# tests/integration/test_tasks_containers.py): its model name, whether Harbor parses a provider out of it, the
# API it speaks, and whether its base URL ends in /v1 (Claude Code's SDK adds /v1 itself)
HARBOR_AGENTS: dict[str, tuple[str, bool, str | None, bool]] = {
    "claude-code": ("{model}", True, "anthropic_messages", False),
    "codex": ("{model}", True, "openai_responses", True),
    "openclaw": ("openai/{model}", False, None, True),
    "pi": ("{model}", True, "openai_chat_completions", True),
}


class HarborError(Exception):
    """Harbor's virtualenv is missing or cannot be built: one line for the user."""


@dataclass
class HarborSettings:
    """What ``steptap tasks run --sandbox harbor`` hands Harbor."""

    environment: str | None = "docker"  # Harbor's environment type, or
    environment_import: str | None = None  # one by import path (module:Class)
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    agent_import: str | None = None  # an agent by import path instead of --agent's name
    container_proxy: str | None = None  # the proxy's URL as seen from the containers (default: --proxy)
    python: Path | None = None


def venv_dir() -> Path:
    return cache_root() / HARBOR.replace("==", "-")


def find_python() -> str | None:
    """A Python >= 3.12 that runs: on PATH (pyenv's shims need a version set: tried, not trusted), then in
    pyenv's versions, newest first."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    versions = sorted(glob.glob(str(root / "versions" / "3.1[2-9]*" / "bin" / "python3")), reverse=True)
    for candidate in [shutil.which("python3.13"), shutil.which("python3.12"), *versions]:
        if candidate and subprocess.run([candidate, "-c", "import sys; assert sys.version_info >= (3, 12)"],
                                        capture_output=True).returncode == 0:
            return candidate
    return None


def install(python: str | None = None) -> Path:
    """Harbor's virtualenv, built if needed (once per machine); its Python."""
    base = python or find_python()
    if base is None:
        raise HarborError("Harbor needs Python >= 3.12 and none was found (python3.12 or python3.13 on PATH, "
                          "or pyenv's): pass --python PATH")
    return build_once(venv_dir(), python=base, installs=[[HARBOR]], removals=[], imports="harbor",
                      label="Harbor", constraints=HARBOR_CONSTRAINTS) / "bin" / "python"


def harbor_python() -> Path:
    """The Python Harbor runs in: $STEPTAP_HARBOR_PYTHON, else the one ``install`` built."""
    given = os.environ.get(PYTHON_ENV)
    python = Path(given) if given else venv_dir() / "bin" / "python"
    if not os.access(python, os.X_OK) or (not given and not (venv_dir() / ".steptap-venv-complete").exists()):
        raise HarborError(f"Harbor is not installed at {python}: run `steptap tasks install-harbor` (or set "
                          f"{PYTHON_ENV} to a Python with harbor installed)")
    return python


def agent_request(agent: str | None, h: HarborSettings, proxy: str, session_id: str, api_key: str,
                  model: str) -> dict[str, Any]:
    """The agent part of a driver request: Harbor's installed agent ``agent`` (or ``h.agent_import``) with its
    model endpoint at the session URL as the containers reach the proxy."""
    v1 = f"{(h.container_proxy or proxy).rstrip('/')}/s/{session_id}/v1"
    env = {"OPENAI_BASE_URL": v1, "OPENAI_API_KEY": api_key, KEY_ENV: api_key, "OPENAI_MODEL": model}
    if h.agent_import is not None or agent is None:
        return {"import_path": h.agent_import, "env": env}
    if agent not in HARBOR_AGENTS:
        raise HarborError(f"Harbor's agent for {agent} is not set up to take a session URL here: name one "
                          "with --harbor-agent-import")
    name_form, skip, api_format, with_v1 = HARBOR_AGENTS[agent]
    return {"name": agent, "model": name_form.format(model=model), "skip_model_parsing": skip,
            "api_format": api_format, "base_url": v1 if with_v1 else v1.removesuffix("/v1"),
            "api_key_env": KEY_ENV, "env": env}


def _request(ep: Episode, info: Any, h: HarborSettings) -> dict[str, Any]:
    agent = agent_request(ep.s.agent, h, ep.s.proxy_url, info.id, info.api_key, ep.s.model or "")
    agent["env"]["STEPTAP_EPISODE"] = str(ep.r.index)
    return {
        "task_dir": str(ep.task.root), "trials_dir": str(ep.dir / "harbor"),
        "trial_name": f"{ep.task.name}-r{ep.r.round}-e{ep.r.index}-a{ep.r.attempt}",
        "environment": _environment(h), "agent": agent,
        "agent_timeout_s": ep.s.agent_timeout_s, "verifier_timeout_s": ep.s.verifier_timeout_s,
    }


async def preflight(agent: str | None, h: HarborSettings, proxy: str, model: str, log: Path) -> str:
    """Harbor's agent built from the request an episode would send (no container): the base URL it resolved,
    or ``HarborError`` saying why it takes no session URL."""
    request = {"resolve_only": True, "task_dir": "", "trials_dir": "", "environment": {},
               "agent": agent_request(agent, h, proxy, "preflight", "preflight-key", model)}
    out = await _drive(h.python or harbor_python(), request, log)
    if out.get("exception"):
        exc = out["exception"]
        why = f"{exc.get('type')}: {exc.get('message')}"
        raise HarborError(f"Harbor's {agent or h.agent_import} agent takes no session URL: {why}")
    return str(out.get("base_url"))


async def _drive(python: Path, request: dict[str, Any], log: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    env.pop("PYTHONPATH", None)  # steptap's own path is not Harbor's
    env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # Harbor imports litellm: no fetch at each start
    if os.environ.get(PATH_ENV):
        env["PYTHONPATH"] = os.environ[PATH_ENV]
    driver = Path(__file__).with_name("harbor_driver.py")
    with open(log, "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            str(python), "-P", str(driver), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=err, env=env, start_new_session=True)
        try:
            out, _ = await proc.communicate(json.dumps(request).encode())
        except BaseException:
            _kill(proc)
            raise
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        return dict(json.loads(lines[-1]))
    except (IndexError, ValueError):
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"rewards": None, "setup_failed": True,
                "exception": {"type": "DriverError", "message": f"Harbor's driver exited {proc.returncode}: "
                              f"{tail[0][:500]}"}}


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _environment(h: HarborSettings) -> dict[str, Any]:
    return {"type": None if h.environment_import else h.environment, "import_path": h.environment_import,
            "kwargs": h.environment_kwargs}


def verdict(result: dict[str, Any]) -> dict[str | None, float]:
    """A trial's rewards (None's key the plain one), or ``Infra`` by the exception Harbor recorded: an
    agent's own failure (a timeout, a non-zero exit) is judged by the verifier as any other attempt."""
    from steptap.adapters.tasks.episode import Infra

    exc = result.get("exception") or {}
    kind, message = exc.get("type", ""), str(exc.get("message", ""))[:1000]
    rewards = result.get("rewards")
    if rewards and kind not in CAUSES:
        return {None if k == "reward" else str(k): float(v) for k, v in rewards.items()}
    cause = CAUSES.get(kind) or ("sandbox" if not result.get("agent_started") else "other")
    raise Infra(cause, f"Harbor: {kind}: {message}" if kind else "Harbor's trial gave no reward")


async def episode(ep: Episode, info: Any, h: HarborSettings) -> dict[str | None, float]:
    """One episode as a Harbor trial; its rewards, or ``Infra`` for a failure that is not the agent's."""
    from steptap.adapters.tasks.episode import Infra

    if ep.task.root is None:
        raise Infra("other", "a task row has no environment/ to build: containers run Harbor task folders")
    ep.dir.mkdir(parents=True, exist_ok=True)
    result = await _drive(h.python or harbor_python(), _request(ep, info, h), ep.dir / "harbor.log")
    exc = result.get("exception") or {}
    kind, message = exc.get("type", ""), str(exc.get("message", ""))[:1000]
    ep.r.agent = ProcessEnd(timed_out=kind == "AgentTimeoutError", seconds=result.get("agent_seconds", 0.0),
                            output=message if kind in AGENT_FAILURES else "")
    if result.get("verifier_ran"):
        ep.r.verifier = ProcessEnd(seconds=result.get("verifier_seconds", 0.0),
                                   output=result.get("verifier_output", ""))
    if kind == "NonZeroAgentExitCodeError" and not (await ep.client.get_session(info.id)).steps:
        raise Infra("agent_start", f"the agent exited before its first model call: {message[:300]}")
    return verdict(result)


async def reference(task: Task, h: HarborSettings, folder: Path, solve: bool) -> float:
    """``steptap tasks check`` in a container: Harbor's oracle agent (the task's solution) or its no-op."""
    from steptap.adapters.tasks.episode import Infra

    if task.root is None:
        raise Infra("other", "a task row has no environment/ to build: containers run Harbor task folders")
    folder.mkdir(parents=True, exist_ok=True)
    request = {"task_dir": str(task.root), "trials_dir": str(folder / "harbor"),
               "trial_name": f"{task.name}-{'oracle' if solve else 'nop'}", "environment": _environment(h),
               "agent": {"name": "oracle" if solve else "nop"}}
    result = await _drive(h.python or harbor_python(), request, folder / "harbor.log")
    return float(sum(verdict(result).values()))
