"""The offline tiny model: deterministic, untied, and with a Qwen2.5-style (hermes) tool template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steptap.learner.tiny_model import build_tiny_model
from steptap.middleware.launch.vllm_server import ties_embeddings

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=0)
    c = build_tiny_model(tmp_path / "c", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    # One vocab for all seeds
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_untied_qwen2_of_about_five_million_parameters(tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is False
    assert config["hidden_size"] == 256 and config["num_hidden_layers"] == 5
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    assert all(t.dtype.is_floating_point and t.element_size() == 4 for t in weights.values())  # float32
    emb, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    assert emb.shape == head.shape == (config["vocab_size"], 256)
    assert not emb.equal(head)
    assert 4_000_000 < sum(t.numel() for t in weights.values()) < 7_000_000
    assert not ties_embeddings(tiny_model_dir)


def test_vocab_special_tokens_and_eos(tiny_model_dir: Path, tokenizer) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert 4000 <= len(tokenizer) == config["vocab_size"] <= 4200
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert gen["eos_token_id"] == config["eos_token_id"] == tokenizer.eos_token_id == im_end
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer.encode(special, add_special_tokens=False)) == 1


def test_tool_call_tags_are_single_non_special_tokens(tokenizer) -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert ids[0] == start and ids[-1] == end
    # Not special: they survive skip_special_tokens, so vLLM's hermes parser sees them in the text.
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert "<tool_call>" not in tokenizer.all_special_tokens


def test_template_renders_tools_calls_and_results_hermes_style(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "What is 2+3 and 4+5?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
            # OpenAI's string
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 4, "b": 5}'}},
        ]},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "9"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>" in text
    assert "within <tool_call></tool_call> XML tags" in text
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n<tool_call>\n'
        '{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call><|im_end|>\n'
    ) in text
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n9\n</tool_response><|im_end|>\n"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_template_without_tools_is_plain_chatml(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n")
    default = tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert default.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_tokenizer_json_alone_agrees_with_transformers(tiny_model_dir: Path, tokenizer) -> None:
    """transformers loads it as Qwen2Tokenizer (its own pre-tokenizer); the file must match it exactly."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = 'Hello   world!! 12345 don\'t <tool_call>\n{"a": 1}</tool_call> e\u0301te\u0301 日本\r\n<|im_end|>'
    assert raw.encode(text).ids == tokenizer.encode(text, add_special_tokens=False)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"


def test_cli_builds_the_model(tmp_path: Path) -> None:
    from steptap.middleware.cli.main import main

    assert main(["tiny-model", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["tie_word_embeddings"] is False


def test_long_context_model_serves_131072_positions_and_ends_turns_early(tmp_path: Path,
                                                                         tiny_model_dir: Path) -> None:
    """--long-context: the positions agent CLIs need, and a steady pull towards <|im_end|> (replies of ~25
    tokens at temperature 1, not max_tokens), one layer; the default model's tokenizer and shapes."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from steptap.learner.tiny_model import EOT_DIM, LONG_CONTEXT, LONG_LAYERS

    out = build_tiny_model(tmp_path / "long", seed=0, long_context=True)
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == LONG_CONTEXT == 131072
    assert config["rope_parameters"]["rope_theta"] == 1_000_000.0
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    long, short = (
        load_file(str(out / "model.safetensors")),
        load_file(str(tiny_model_dir / "model.safetensors")),
    )
    # one layer: the prefill of an agent CLI's prompt is all attention
    assert config["num_hidden_layers"] == LONG_LAYERS == 1
    assert long.keys() == {k for k in short
                           if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    assert not long["lm_head.weight"].equal(short["lm_head.weight"])

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for text in ("hi", "Read the file and count the words in it, then write a list. " * 40):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_dict=True, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out_ = model(ids, output_hidden_states=True)
        held = out_.hidden_states[-1][0, :, EOT_DIM]
        assert held.min() > 8.0 and held.max() < 10.0  # near-constant after the final norm, everywhere
        probs = out_.logits[0, -1].softmax(-1)
        assert int(probs.argmax()) == im_end
        assert 0.02 < float(probs[im_end]) < 0.08, float(probs[im_end])  # mean reply ~1/p tokens


def test_cli_builds_the_long_context_model(tmp_path: Path) -> None:
    from steptap.middleware.cli.main import main

    assert main(["tiny-model", str(tmp_path / "m"), "--long-context"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["max_position_embeddings"] == 131072
