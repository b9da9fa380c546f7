"""`steptap tiny-model --vision`: a deterministic tiny Qwen2-VL, Qwen2-VL's vision tokens and content
rendering on the text model's template, an image processor that keeps images to a few tokens, and how steptap
starts vLLM for it (no vLLM needed here; tests/integration/test_vision_model.py serves it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vision import pixels, png

from steptap.learner.tiny_model import build_tiny_model
from steptap.learner.tiny_vision import MAX_PIXELS, MIN_PIXELS, VISION_TOKENS
from steptap.middleware.launch.vision import (
    MARKER,
    MM_LIMITS,
    ensure_torchvision,
    is_vision_model,
    overlay_dir,
)
from steptap.middleware.launch.vllm_server import VLLMServer
from steptap.middleware.model_files import IMAGE_PROCESSOR


@pytest.fixture(scope="module")
def tokenizer(vision_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vision_model_dir))


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, vision_model_dir: Path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=0, vision=True)
    c = build_tiny_model(tmp_path / "c", seed=1, vision=True)
    for f in ("model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json",
              "chat_template.jinja"):
        assert (a / f).read_bytes() == (vision_model_dir / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_a_small_untied_qwen2_vl_whose_token_ids_are_the_tokenizers(vision_model_dir: Path,
                                                                      tokenizer: Any) -> None:
    config = json.loads((vision_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert config["tie_word_embeddings"] is False and is_vision_model(vision_model_dir)
    vision = config["vision_config"]
    assert vision["patch_size"] == 14 and vision["depth"] <= 2
    assert vision["hidden_size"] == config["text_config"]["hidden_size"]  # the merger feeds the text model
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    assert [config["vision_start_token_id"], config["vision_end_token_id"], config["image_token_id"],
            config["video_token_id"]] == [ids[0], ids[1], ids[3], ids[4]]
    assert config["text_config"]["vocab_size"] == len(tokenizer)
    for token in VISION_TOKENS:  # single special tokens, gone from decoded text
        (one,) = tokenizer.encode(token)
        assert tokenizer.decode([one], skip_special_tokens=True) == ""


def test_template_renders_image_parts_in_place_and_keeps_tools(tokenizer) -> None:
    parts = [{"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "B"},
             {"type": "image_url", "image_url": {"url": "data:"}}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    assert f"<|im_start|>user\nA{image}B{image}<|im_end|>\n<|im_start|>assistant\n" in text
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in plain
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with_tools = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tools=tools,
                                               tokenize=False)
    assert "<tools>" in with_tools and f"A{image}B{image}" in with_tools


@pytest.mark.parametrize(("size", "tokens"),
                         [((56, 56), 4), ((112, 84), 12), ((28, 28), 4), ((256, 256), 64)])
def test_images_cost_a_few_tokens(vision_model_dir: Path, size: tuple[int, int], tokens: int) -> None:
    got = pixels(vision_model_dir, [png(0, size)])
    (t, h, w), = got["image_grid_thw"].tolist()
    assert t == 1 and h * w // 4 == tokens
    assert MIN_PIXELS <= h * w * 14 * 14 <= MAX_PIXELS


def test_distinct_deterministic_pngs() -> None:
    assert png(1) == png(1) and png(1) != png(2)
    assert png(1, (112, 84))[:8] == b"\x89PNG\r\n\x1a\n"


def test_vllm_is_started_with_the_multimodal_limits_only_for_a_vision_model(vision_model_dir: Path,
                                                                           tiny_model_dir: Path) -> None:
    python = Path("python")
    cmd = VLLMServer(vision_model_dir, gpu=False).command(python)
    i = cmd.index("--limit-mm-per-prompt")
    assert json.loads(cmd[i + 1]) == MM_LIMITS
    i = cmd.index("--mm-processor-kwargs")  # the image processor the learner loads too
    assert json.loads(cmd[i + 1]) == IMAGE_PROCESSOR == {"use_fast": False}
    given = VLLMServer(vision_model_dir, gpu=False, extra_args=["--limit-mm-per-prompt={\"image\": 1}"])
    assert given.command(python).count("--limit-mm-per-prompt") == 0
    assert given.command(python).count("--mm-processor-kwargs") == 1
    text = VLLMServer(tiny_model_dir, gpu=False)
    assert "--limit-mm-per-prompt" not in text.command(python) and not text.vision
    assert "--mm-processor-kwargs" not in text.command(python)
    server = VLLMServer(vision_model_dir, gpu=False, env={"PYTHONPATH": "/x"})
    assert server.environment()["PYTHONPATH"] == "/x"
    server.torchvision = Path("/tv")  # what start() sets from launch/vision.py's ensure_torchvision
    assert server.environment()["PYTHONPATH"] == "/tv:/x"


def test_a_cpu_server_without_binding_runs_its_worker_in_the_engine_process(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The uni executor on CPU with nobind (one process and one vLLM import fewer); a bound server keeps its
    worker process (vLLM binds OpenMP threads there), and a value in the environment is the user's."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert VLLMServer(tiny_model_dir, gpu=False).environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in VLLMServer(tiny_model_dir, gpu=False,
                                                               cpu_bind="0-1").environment()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in VLLMServer(tiny_model_dir, gpu=True).environment()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert VLLMServer(tiny_model_dir, gpu=False).environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_torchvision_for_vllm_is_built_once_and_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    venv = tmp_path / "vllm-cpu"  # no python in it: the install cannot run
    with pytest.raises(RuntimeError, match="cannot run"):
        ensure_torchvision(venv)
    assert not overlay_dir(venv).exists() and not list(tmp_path.glob(".*build*"))
    overlay_dir(venv).mkdir()
    (overlay_dir(venv) / MARKER).write_text("torchvision==0.28.0\n")  # complete: used as it is
    assert ensure_torchvision(venv) == overlay_dir(venv)
