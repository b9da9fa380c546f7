"""The managed vLLM on a unix socket, end to end, with a model the tiny-model builder makes as a user's Llama
model would be (no ``<|python_tag|>`` in its tokenizer, so `llama3_json` would stop vLLM from starting): vLLM
starts with the parser the template asks for (hermes) and serves only on a socket in a 0700 directory; the
proxy reaches it as ``--backend unix:PATH`` with the backend key on every call; a tool call comes back parsed;
a LoRA swap through the proxy (``/v1/load_lora_adapter`` needs vLLM's key) serves the new version.

Its own server (about a minute on 2 cores): the weights change, so never the shared one."""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import Proxy, missing

from steptap.middleware.client import SyncSteptapClient
from steptap.middleware.launch.procs import process_group_alive
from steptap.middleware.launch.vllm_server import VLLMServer, VLLMStartError
from steptap.middleware.launch.vllm_venv import default_venv

pytestmark = pytest.mark.vllm

KEY = "backend-key-for-test"
SERVED = "tiny-llama"
TOOL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    if not (default_venv(gpu=False) / "bin" / "python").exists():
        missing("no vLLM virtualenv (bash scripts/setup.sh builds it)")
    from steptap.learner.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama")
    sock = tmp_path_factory.mktemp("run") / "private" / "vllm.sock"
    server = VLLMServer(model, uds=sock, served_model_name=SERVED, threads=1, max_model_len=512,
                        log_path=tmp_path_factory.mktemp("log") / "vllm.log", extra_args=["--api-key", KEY])
    try:
        server.start()
        server.wait_healthy(timeout=600)
    except VLLMStartError as exc:
        server.stop()
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()
        assert not process_group_alive(server.pid) and not sock.exists()


def _lora_adapter(model_dir: Path, out: Path) -> Path:
    """A peft adapter with non-zero B matrices for the Llama tiny model (what the learner publishes)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir)),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                      lora_dropout=0.0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(str(out))
    return out


async def test_vllm_on_a_unix_socket_behind_the_proxy(
    llama_server: VLLMServer, make_proxy: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = llama_server
    assert server.url == f"unix:{server.uds}" and server.tool_parser == "hermes"
    assert (
        "--port" not in server.command(Path("python"))
        and stat.S_IMODE(server.uds.parent.stat().st_mode) == 0o700
    )
    assert SyncSteptapClient(server.url, KEY).models() == [SERVED]

    proxy: Proxy = await make_proxy(server.url, backend_api_key=KEY, model_dir=str(server.model_dir))
    body = {"model": SERVED, "messages": [{"role": "user", "content": "What is 2 + 3?"}], "tools": TOOLS,
            "tool_choice": "auto", "max_tokens": 60, "structured_outputs": {"regex": re.escape(TOOL_TEXT)}}
    async with http.post(f"{proxy.url}/s/uds/v1/chat/completions", json=body) as r:
        reply = await r.json()
        assert r.status == 200, reply
    (call,) = reply["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}

    # The swapper goes through the socket too, with the key (vLLM guards /v1/load_lora_adapter with it).
    adapter = _lora_adapter(server.model_dir, tmp_path / "adapter")
    async with http.post(f"{proxy.url}/admin/weights", json={"lora_path": str(adapter)},
                         headers=proxy.control) as r:
        swapped = await r.json()
        assert r.status == 200, swapped
    plain = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http.post(f"{proxy.url}/s/uds/v1/chat/completions", json=plain) as r:
        assert r.status == 200, await r.text()
    async with http.get(f"{proxy.url}/sessions/uds", headers=proxy.control) as r:
        steps = (await r.json())["steps"]
    assert [s["policy_version"] for s in steps] == [0, swapped["version"]] and swapped["version"] >= 1

    # Without the key the backend refuses the model call: the proxy answers with an error, not a 200.
    keyless: Proxy = await make_proxy(server.url, log_dir=tmp_path / "keyless")
    async with http.post(f"{keyless.url}/s/nokey/v1/chat/completions", json=plain) as r:
        assert r.status >= 400
