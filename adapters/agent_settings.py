"""Each agent CLI's provider settings for one session: what ``agents.prepare`` writes (``WRITERS``, one writer
per CLI), in a private directory of the CLI's own, the session's key only in the environment or a 0600 file.
``docs/agents.md`` has the settings per CLI and why."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from steptap.middleware.files import atomic_write, secret_dir

KEY_ENV = "STEPTAP_API_KEY"  # the session key, for CLIs whose config names an environment variable
PROVIDER = "steptap"  # a custom provider id: OpenClaw routes the id `openai` through Codex's runtime
CONTEXT_WINDOW, MAX_TOKENS = 65536, 4096  # what OpenClaw and pi are told the served model takes
# Claude Code's small-fast model (its title calls): a name of its own, a side alias of the session (the proxy
# serves it by the backend's model), so those calls are side calls whatever order they arrive in.
SMALL_FAST = "steptap-small-fast"


@dataclass
class AgentLaunch:
    """What ``steptap run`` starts: the command and the environment added to its own (minus the token)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)  # the settings written, for the user and the tests


def _write(path: Path, text: str, files: list[Path]) -> None:
    atomic_write(path, text, mode=0o600, durable=False)  # a scratch config: no crash durability needed
    files.append(path)


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
        CLAUDE_CONFIG_DIR=str(secret_dir(home / "claude")),
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
    codex_home = secret_dir(home / "codex")
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
    root = secret_dir(home / "openclaw")
    config = root / "openclaw.json"
    _write(config, json.dumps(openclaw_config(base, model), indent=2) + "\n", launch.files)
    launch.env.update(
        OPENCLAW_STATE_DIR=str(secret_dir(root / "state")),
        OPENCLAW_CONFIG_PATH=str(config),
        **{KEY_ENV: api_key},
    )


def _pi(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    agent_dir = secret_dir(home / "pi")
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
    root = secret_dir(home / "opencode")
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
        **{f"XDG_{d.upper()}_HOME": str(secret_dir(root / d))
           for d in ("config", "data", "state", "cache")},
        **{KEY_ENV: api_key},
    )


def _qwen_code(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    # Qwen Code reads ~/.qwen (no variable moves it): HOME is a private dir holding .qwen/settings.json; the
    # OpenAI provider from its own variables
    root = secret_dir(home / "qwen")
    # tools.shell.enableInteractiveShell: its shell tool on a PTY, as in its interactive mode. Headless (-p)
    # it runs commands as plain child processes and takes the result on the child's `exit` event, before
    # the pipe is drained: a fast command's output came back `Output: (empty)` (measured, 0.24.4)
    settings = {"security": {"auth": {"selectedType": "openai"}}, "model": {"name": model},
                "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
                "general": {"disableAutoUpdate": True}, "tools": {"shell": {"enableInteractiveShell": True}}}
    qwen_dir = secret_dir(root / ".qwen")
    _write(qwen_dir / "settings.json", json.dumps(settings, indent=2) + "\n", launch.files)
    # QWEN_CODE_API_TIMEOUT_MS: an hour, not its default (its ~37k-token first prompt took a CPU backend under
    # load past it: measured, the call was cut and sent again)
    launch.env.update(HOME=str(root), OPENAI_BASE_URL=base, OPENAI_API_KEY=api_key, OPENAI_MODEL=model,
                      QWEN_CODE_API_TIMEOUT_MS=str(3600 * 1000))


def _vibe(launch: AgentLaunch, base: str, api_key: str, model: str, home: Path) -> None:
    # Mistral Vibe's home (VIBE_HOME, instead of ~/.vibe): a generic (OpenAI chat) provider and the model
    root = secret_dir(home / "vibe")
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
    root = secret_dir(home / "gemini")
    settings = json.dumps(gemini_settings(model), indent=2) + "\n"
    _write(secret_dir(root / ".gemini") / "settings.json", settings, launch.files)
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
    root = secret_dir(home / "continue")
    _write(root / "config.yaml", continue_config(base, model), launch.files)
    launch.env.update(CONTINUE_GLOBAL_DIR=str(root), CONTINUE_CLI_ENABLE_TELEMETRY="0", **{KEY_ENV: api_key})


# One writer per agent CLI: (launch, session base URL, key, model, home) -> settings written, launch.env set
WRITERS: dict[str, Callable[[AgentLaunch, str, str, str, Path], None]] = {
    "claude-code": _claude_code,
    "codex": _codex,
    "openclaw": _openclaw,
    "pi": _pi,
    "opencode": _opencode,
    "qwen-code": _qwen_code,
    "vibe": _vibe,
    "gemini": _gemini,
    "continue": _continue,
}
