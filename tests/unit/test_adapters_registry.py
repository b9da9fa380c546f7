"""The adapter registry (entry-point discovery, `steptap adapters`) and adapter binding, without a server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from steptap.adapters import registry
from steptap.adapters.registry import Adapter

OURS = {"openai", "langchain", "openai_agents", "smolagents", "litellm"}
SESSION = SimpleNamespace(base_url="http://127.0.0.1:9/s/abc/v1", api_key="stk-test", model="tiny")


def _adapters_cli(env_extra: dict[str, str] | None = None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "steptap.middleware.cli", "adapters", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_our_adapters_are_registered_and_available() -> None:
    found = {e.name: e for e in registry.entries()}
    assert OURS <= set(found)
    for name in OURS:
        entry = found[name]
        assert entry.error is None, entry.error
        assert entry.adapter.name == name
        assert entry.available, f"{name}: {entry.adapter.framework} is not importable in this venv"
        assert entry.adapter.version()


def test_loading_the_registry_imports_no_framework() -> None:
    code = (
        "import sys, json; from steptap.adapters import registry; registry.entries();"
        "print(json.dumps(sorted(m for m in ('openai', 'langchain_openai', 'agents', 'smolagents', 'litellm',"
        " 'torch') if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_cli_lists_installed_adapters_with_availability() -> None:
    out = _adapters_cli()
    assert out.returncode == 0, out.stderr
    lines = {ln.split()[0]: ln for ln in out.stdout.splitlines() if ln.strip()}
    assert OURS <= set(lines)
    assert "available" in lines["langchain"] and "langchain-openai" in lines["langchain"]
    rows = json.loads(_adapters_cli(None, "--json").stdout)
    assert {r["name"] for r in rows} >= OURS
    assert all(r["available"] for r in rows if r["name"] in OURS)


def test_a_third_party_adapter_is_discovered_through_the_entry_point_group(tmp_path: Path) -> None:
    # A minimal installed distribution: a .dist-info with entry_points.txt, and its module, on PYTHONPATH.
    (tmp_path / "toy_steptap.py").write_text(
        textwrap.dedent("""
        from steptap.adapters.registry import Adapter
        ADAPTER = Adapter(name="toy", framework="toyframework-not-installed",
                          binder=lambda s, **kw: s.base_url,
                          modules=("toyframework_not_installed",), description="a third-party adapter")
    """)
    )
    (tmp_path / "broken_steptap.py").write_text("raise RuntimeError('adapter module is broken')\n")
    dist = tmp_path / "toy_steptap-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-steptap\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[steptap.adapters]\ntoy = toy_steptap:ADAPTER\nbroken = broken_steptap:ADAPTER\n"
    )
    env = {"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows = {r["name"]: r for r in json.loads(_adapters_cli(env, "--json").stdout)}
    assert rows["toy"]["distribution"] == "toy-steptap"
    assert rows["toy"]["available"] is False  # its framework is not installed
    assert rows["broken"]["error"] and "adapter module is broken" in rows["broken"]["error"]
    assert OURS <= set(rows)
    text = _adapters_cli(env).stdout
    assert "missing: pip install toyframework-not-installed" in text
    assert "broken: RuntimeError" in text


def test_bind_without_the_framework_says_what_to_install() -> None:
    ad = Adapter(
        name="x", framework="not-a-real-framework", binder=lambda s, **kw: None, modules=("nope_xyz",)
    )
    assert not ad.available()
    with pytest.raises(ImportError, match="pip install not-a-real-framework"):
        ad.bind(SESSION)
    with pytest.raises(KeyError, match="no steptap adapter named 'nope'"):
        registry.get("nope")


def test_each_adapter_binds_its_framework_object_to_the_session() -> None:
    import openai

    client = registry.bind("openai", SESSION)
    assert isinstance(client, openai.OpenAI)
    assert str(client.base_url).rstrip("/") == SESSION.base_url and client.api_key == "stk-test"
    assert isinstance(registry.bind("openai", SESSION, async_=True), openai.AsyncOpenAI)

    llm = registry.bind("langchain", SESSION, temperature=0.5)
    assert llm.openai_api_base == SESSION.base_url and llm.model_name == "tiny"
    assert llm.openai_api_key.get_secret_value() == "stk-test"

    model = registry.bind("smolagents", SESSION, model="other")
    assert model.model_id == "other" and model.client_kwargs["base_url"] == SESSION.base_url

    lite = registry.bind("litellm", SESSION)
    assert lite.params == {"model": "openai/tiny", "api_base": SESSION.base_url, "api_key": "stk-test"}

    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel

    agent_model = registry.bind("openai_agents", SESSION)  # the SDK's default: the Responses API
    assert isinstance(agent_model, OpenAIResponsesModel) and agent_model.model == "tiny"
    assert str(agent_model._client.base_url).rstrip("/") == SESSION.base_url
    chat_model = registry.bind("openai_agents", SESSION, api="chat")
    assert isinstance(chat_model, OpenAIChatCompletionsModel) and chat_model.model == "tiny"


def test_adapters_use_the_client_only_never_the_proxy_server() -> None:
    code = (
        "import sys, json, importlib\n"
        "for m in ('session', 'run', 'registry', 'frameworks.openai_client', 'frameworks.langchain',"
        " 'frameworks.openai_agents', 'frameworks.smolagents', 'frameworks.litellm'):"
        " importlib.import_module('steptap.adapters.' + m)\n"
        "import steptap.middleware.client\n"
        "server = ('app', 'server', 'proxy', 'sessions', 'log', 'weights', 'launch')\n"
        "print(json.dumps(sorted(m for m in server if 'steptap.middleware.' + m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
