"""`steptap run --agent NAME`: the settings written for each agent CLI (exact keys, private modes, the session
key never on the command line), and where the CLI is found."""

from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path

import pytest

from steptap.adapters import agent_settings, agents

BASE = "http://127.0.0.1:9999/s/sess-1/v1"
KEY = "sk-session-secret"
MODEL = "tiny-long"


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def _prepare(agent: str, tmp_path: Path) -> agents.AgentLaunch:
    cli = _exe(tmp_path / "bin" / agents.BINARIES[agent])
    return agents.prepare(agent, base_url=BASE, api_key=KEY, model=MODEL, home=tmp_path / "home",
                          args=["-p", "task"], cli=cli)


def _private(launch: agents.AgentLaunch, home: Path) -> None:
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    for f in launch.files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600 and home in f.parents
        assert stat.S_IMODE(f.parent.stat().st_mode) == 0o700
        assert KEY not in f.read_text()  # the key lives only in the environment
    assert not any(KEY in a for a in launch.argv)
    assert launch.argv[1:] == ["-p", "task"]


def test_claude_code_gets_the_session_root_and_key_in_its_environment(tmp_path: Path) -> None:
    launch = _prepare("claude-code", tmp_path)
    env = launch.env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9999/s/sess-1"  # the SDK adds /v1/messages
    assert env["ANTHROPIC_API_KEY"] == KEY
    for name in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                 "ANTHROPIC_DEFAULT_HAIKU_MODEL"):
        assert env[name] == MODEL, name
    # its small-fast calls (titles) name a side alias of the session, served by the session's model
    assert env["ANTHROPIC_SMALL_FAST_MODEL"] == agents.SMALL_FAST
    assert agents.side_models("claude-code") == [agents.SMALL_FAST]
    assert [agents.side_models(a) for a in ("codex", "openclaw", "pi", None)] == [[], [], [], []]
    for name in ("DISABLE_TELEMETRY", "DISABLE_ERROR_REPORTING", "DISABLE_AUTOUPDATER"):
        assert env[name] == "1", name
    # default features on: this variable also turns off Claude Code's title call (docs/agents.md)
    assert "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC" not in env
    config_dir = Path(env["CLAUDE_CONFIG_DIR"])
    assert config_dir.parent == tmp_path / "home" and stat.S_IMODE(config_dir.stat().st_mode) == 0o700
    _private(launch, tmp_path / "home")


def test_codex_gets_a_private_codex_home_with_a_responses_provider(tmp_path: Path) -> None:
    launch = _prepare("codex", tmp_path)
    home = Path(launch.env["CODEX_HOME"])
    config = tomllib.loads((home / "config.toml").read_text())
    assert config == {
        "model": MODEL, "model_provider": "steptap", "check_for_update_on_startup": False,
        "model_providers": {"steptap": {"name": "steptap", "base_url": BASE, "env_key": "STEPTAP_API_KEY",
                                        "wire_api": "responses",
                                        "stream_idle_timeout_ms": agent_settings.CODEX_STREAM_IDLE_MS}},
        "analytics": {"enabled": False},
    }
    assert launch.env["STEPTAP_API_KEY"] == KEY
    _private(launch, tmp_path / "home")


def test_openclaw_gets_a_custom_provider_and_private_state(tmp_path: Path) -> None:
    launch = _prepare("openclaw", tmp_path)
    config = json.loads(Path(launch.env["OPENCLAW_CONFIG_PATH"]).read_text())
    provider = config["models"]["providers"]["steptap"]  # not `openai`: OpenClaw routes that id through Codex
    assert config["models"]["mode"] == "merge"
    assert provider == {"baseUrl": BASE, "apiKey": "${STEPTAP_API_KEY}", "api": "openai-completions",
                        "timeoutSeconds": 1800,  # its 300 s default: agents.MODEL_REQUEST_TIMEOUT_S
                        "models": [{"id": MODEL, "name": MODEL, "contextWindow": 65536, "maxTokens": 4096}]}
    assert config["agents"]["defaults"]["model"]["primary"] == f"steptap/{MODEL}"
    state = Path(launch.env["OPENCLAW_STATE_DIR"])
    assert state.is_dir() and stat.S_IMODE(state.stat().st_mode) == 0o700
    assert launch.env["STEPTAP_API_KEY"] == KEY
    _private(launch, tmp_path / "home")


def test_pi_gets_models_and_settings_in_its_own_agent_dir(tmp_path: Path) -> None:
    launch = _prepare("pi", tmp_path)
    agent_dir = Path(launch.env["PI_CODING_AGENT_DIR"])
    models = json.loads((agent_dir / "models.json").read_text())
    assert models == {"providers": {"steptap": {
        "baseUrl": BASE, "api": "openai-completions", "apiKey": "STEPTAP_API_KEY",
        "models": [{"id": MODEL, "contextWindow": 65536, "maxTokens": 4096}]}}}
    settings = json.loads((agent_dir / "settings.json").read_text())
    assert settings == {"defaultProvider": "steptap", "defaultModel": MODEL}
    assert {k: launch.env[k] for k in ("PI_OFFLINE", "PI_SKIP_VERSION_CHECK", "PI_TELEMETRY")} == {
        "PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"}
    assert launch.env["STEPTAP_API_KEY"] == KEY
    _private(launch, tmp_path / "home")


def test_the_cli_comes_from_path_first_then_the_cache(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPTAP_AGENTS_DIR", str(tmp_path / "cache"))
    with pytest.raises(agents.AgentError, match="install_agents.sh"):
        agents.find_cli("pi", path=str(tmp_path / "empty"))
    cached = _exe(agents.cached_cli("pi"))
    assert agents.find_cli("pi", path=str(tmp_path / "empty")) == cached
    on_path = _exe(tmp_path / "mybin" / "pi")
    assert agents.find_cli("pi", path=str(on_path.parent)) == on_path
    with pytest.raises(agents.AgentError, match="unknown agent"):
        agents.find_cli("cursor")


def test_a_cached_cli_runs_on_the_caches_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPTAP_AGENTS_DIR", str(tmp_path / "cache"))
    agents.node_bin_dir().mkdir(parents=True)
    cached = _exe(agents.cached_cli("openclaw"))
    launch = agents.prepare("openclaw", base_url=BASE, api_key=KEY, model=MODEL, home=tmp_path / "h", args=[],
                            cli=cached)
    assert launch.env["PATH"].split(os.pathsep)[0] == str(agents.node_bin_dir())
    own = _exe(tmp_path / "mybin" / "openclaw")  # the user's own CLI keeps the user's PATH
    launch = agents.prepare("openclaw", base_url=BASE, api_key=KEY, model=MODEL, home=tmp_path / "h2",
                            args=[],
                            cli=own)
    assert "PATH" not in launch.env


def test_opencode_gets_its_own_config_file_and_private_xdg_dirs(tmp_path: Path) -> None:
    launch = _prepare("opencode", tmp_path)
    config = json.loads(Path(launch.env["OPENCODE_CONFIG"]).read_text())
    assert config["provider"] == {"steptap": {
        "npm": "@ai-sdk/openai-compatible", "name": "steptap",
        "options": {"baseURL": BASE, "apiKey": "{env:STEPTAP_API_KEY}", "timeout": False},
        "models": {MODEL: {"name": MODEL, "limit": {"context": 65536, "output": 4096}}}}}
    assert config["model"] == f"steptap/{MODEL}" and config["autoupdate"] is False
    for d in ("CONFIG", "DATA", "STATE", "CACHE"):  # its sessions and caches never reach the user's own
        path = Path(launch.env[f"XDG_{d}_HOME"])
        assert tmp_path / "home" in path.parents and stat.S_IMODE(path.stat().st_mode) == 0o700
    assert launch.env["STEPTAP_API_KEY"] == KEY
    _private(launch, tmp_path / "home")


def test_qwen_code_gets_a_private_home_and_the_openai_variables(tmp_path: Path) -> None:
    launch = _prepare("qwen-code", tmp_path)
    home = Path(launch.env["HOME"])
    assert tmp_path / "home" in home.parents
    settings = json.loads((home / ".qwen" / "settings.json").read_text())
    assert settings["security"] == {"auth": {"selectedType": "openai"}}
    assert settings["model"] == {"name": MODEL}
    assert settings["telemetry"] == {"enabled": False}
    assert settings["tools"] == {"shell": {"enableInteractiveShell": True}}  # a PTY: no output lost
    assert {k: launch.env[k] for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL")} == {
        "OPENAI_BASE_URL": BASE, "OPENAI_API_KEY": KEY, "OPENAI_MODEL": MODEL}
    assert launch.env["QWEN_CODE_API_TIMEOUT_MS"] == "3600000"
    _private(launch, tmp_path / "home")


def test_vibe_gets_a_generic_provider_in_its_own_home(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    launch = _prepare("vibe", tmp_path)
    config = tomllib.loads((Path(launch.env["VIBE_HOME"]) / "config.toml").read_text())
    assert config["providers"] == [{"name": "steptap", "api_base": BASE, "api_key_env_var": "STEPTAP_API_KEY",
                                    "backend": "generic"}]
    assert config["models"] == [{"name": MODEL, "provider": "steptap", "alias": "steptap", "temperature": 1.0,
                                 "max_context_length": 65536}]
    assert config["active_model"] == "steptap" and config["enable_telemetry"] is False
    assert launch.env["STEPTAP_API_KEY"] == KEY
    _private(launch, tmp_path / "home")
    # a PyPI CLI comes from its own venv in the cache
    monkeypatch.setenv("STEPTAP_AGENTS_DIR", str(tmp_path / "cache"))
    assert agents.cached_cli("vibe") == tmp_path / "cache" / "venvs" / "vibe" / "bin" / "vibe"


def test_continue_gets_one_openai_model_in_its_own_global_dir(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    launch = _prepare("continue", tmp_path)
    root = Path(launch.env["CONTINUE_GLOBAL_DIR"])
    assert tmp_path / "home" in root.parents
    # YAML, written as JSON (a YAML document too): its one model on the session, the key a secret of the
    # environment (cn resolves `${{ secrets.NAME }}` from its environment first)
    config = json.loads((root / "config.yaml").read_text())
    assert config == {"name": "steptap", "version": "1.0.0", "schema": "v1", "models": [{
        "name": "steptap", "provider": "openai", "model": MODEL, "apiBase": BASE,
        "apiKey": "${{ secrets.STEPTAP_API_KEY }}", "roles": ["chat", "edit", "apply", "summarize"],
        "defaultCompletionOptions": {"contextLength": 65536, "maxTokens": 4096}}]}
    assert launch.env["STEPTAP_API_KEY"] == KEY and launch.env["CONTINUE_CLI_ENABLE_TELEMETRY"] == "0"
    assert agents.side_models("continue") == []  # headless it sends no title or other side call
    _private(launch, tmp_path / "home")
    # a folder of its own in the cache, as Gemini CLI's
    monkeypatch.setenv("STEPTAP_AGENTS_DIR", str(tmp_path / "cache"))
    assert agents.cached_cli("continue") == tmp_path / "cache" / "continue" / "node_modules" / ".bin" / "cn"


def test_agent_homes_are_private_fresh_and_never_in_the_temp_dir(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Codex >= 0.169 refuses its sandbox helpers under the temp dir: every sandboxed command would fail
    monkeypatch.setenv(agents.HOMES_ENV, str(tmp_path / "homes"))
    with pytest.raises(agents.AgentError, match="temp directory"):
        agents.new_agent_home()
    with pytest.raises(agents.AgentError, match="temp directory"):
        agents.new_agent_home(Path("/tmp"))
    monkeypatch.delenv(agents.HOMES_ENV)
    if agents.under_temp(agents.cache_root()):  # XDG_CACHE_HOME in /tmp (a fresh-clone timing): refused too
        with pytest.raises(agents.AgentError, match="temp directory"):
            agents.new_agent_home()
        return
    one, two = agents.new_agent_home(), agents.new_agent_home()
    try:
        assert one != two and one.parent == two.parent
        assert not agents.under_temp(one) and one.parent == agents.cache_root() / "agent-homes"
        assert stat.S_IMODE(one.stat().st_mode) == 0o700 and stat.S_IMODE(one.parent.stat().st_mode) == 0o700
    finally:
        one.rmdir()
        two.rmdir()


def test_every_agent_has_a_one_shot_form_for_the_task_runner() -> None:
    """`steptap tasks run --agent NAME`: each CLI's own unattended one-shot form, the instruction whole."""
    prompt = "Fix calc.py so --check passes;  then say \"done\"\nand stop"
    forms = {a: agents.task_args(a, prompt) for a in agents.AGENTS}
    assert forms["opencode"][:5] == ["run", "--format", "json", "--auto", "--"]
    # opencode joins its words with spaces (quoting one that holds a space): none holds one, so its message
    # is the prompt as it is; after `--` a word like `--check` is not read as an option
    assert " ".join(forms["opencode"][5:]) == prompt and not any(" " in w for w in forms["opencode"][5:])
    assert forms["qwen-code"] == ["-p", prompt, "--approval-mode", "yolo", "--output-format", "json"]
    assert forms["vibe"] == ["-p", prompt, "--auto-approve"]
    assert forms["continue"] == ["-p", "--auto", prompt]
    assert forms["pi"] == ["--no-session", "-p", prompt]
    assert "--dangerously-skip-permissions" in forms["claude-code"]
    assert forms["gemini"][:3] == ["--skip-trust", "--approval-mode", "yolo"]
    for agent, form in forms.items():
        assert prompt in form or agent == "opencode", agent
    with pytest.raises(agents.AgentError, match="unknown agent"):
        agents.task_args("cursor", prompt)
