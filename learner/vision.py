"""Vision steps -> model inputs, checked against the prompt vLLM expanded; the learner-vs-vLLM logprob check.

A step that showed the model images (``Step.images``, schema 7) names them by content digest, in prompt order;
its ``prompt_token_ids`` are as vLLM expanded them: each image's ``<|image_pad|>`` token repeated once per
merged patch of that image's grid. The learner gets the bytes through ``resolve(sha256) -> bytes | None`` (the
stream client's or the offline log reader's) and runs them through the policy's own image processor
(``preprocessor_config.json`` of the model dir): ``pixel_values`` and ``image_grid_thw``. An image the
resolver cannot give (``dropped_image_unresolved``) or a grid that disagrees with the prompt's pad tokens
(grid_t * grid_h * grid_w / merge^2 per image, ``dropped_image_mismatch``: the processor is not the one vLLM
used) drops the step, counted; it is never trained as text.

The check: on the first batch holding vision steps, the learner's logprobs of the responses (its weights
before the update, temperature 1: vLLM records raw logprobs) against the recorded ones. A gap beyond
``vision_logprob_tol`` means the learner does not see what vLLM saw (a different processor, position ids,
image bytes): reported loudly (metric ``vision_logprob_gap`` + an error line), and fatal with
``vision_check = "stop"``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from steptap.learner.rows import Batch
from steptap.middleware.records import Step

Resolve = Callable[[str], "bytes | None"]  # an image's bytes by its sha256 (hex), None when unknown

UNRESOLVED = "dropped_image_unresolved"
MISMATCH = "dropped_image_mismatch"


class VisionMismatch(RuntimeError):
    """The vision check failed with ``vision_check = "stop"``."""


def vision_config(model_dir: str | Path) -> dict[str, Any] | None:
    """The model dir's ``config.json`` when it is a vision-language model (it has a ``vision_config``)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and "vision_config" in cfg else None


def pad_runs(prompt_ids: list[int], pad_id: int) -> list[int]:
    """The length of each run of ``pad_id`` in the prompt, in order: one run per image vLLM expanded."""
    runs: list[int] = []
    prev = None
    for t in prompt_ids:
        if t == pad_id:
            if prev == pad_id:
                runs[-1] += 1
            else:
                runs.append(1)
        prev = t
    return runs


def lora_targets(targets: tuple[str, ...] | list[str], model_dir: str | Path) -> list[str] | str:
    """peft's ``target_modules``: the names as given, or for a vision-language model a regex (peft matches it
    in full) keeping LoRA to the language model's layers: the vision tower stays as vLLM serves it."""
    if vision_config(model_dir) is None:
        return list(targets)
    return rf".*language_model\..*\.({'|'.join(targets)})"


class VisionInputs:
    """``step -> model inputs`` (``pixel_values``, ``image_grid_thw``) or the cause it is dropped for; one
    per learner, on the policy's model dir."""

    def __init__(self, model_dir: str | Path, resolve: Resolve | None) -> None:
        # transformers' top-level AutoImageProcessor is a torchvision placeholder when torchvision is not
        # installed; the module's own picks the backend IMAGE_PROCESSOR names (PIL), as vLLM is told to
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        from steptap.middleware.model_files import IMAGE_PROCESSOR

        cfg = vision_config(model_dir)
        if cfg is None:
            raise ValueError(f"{model_dir} is not a vision-language model (no vision_config)")
        self.image_token_id = int(cfg["image_token_id"])
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), **IMAGE_PROCESSOR)
        self.merge = int(getattr(self.processor, "merge_size", 0)
                         or cfg["vision_config"].get("spatial_merge_size", 2))
        self.resolve = resolve

    def __call__(self, step: Step) -> dict[str, Any] | str:
        from PIL import Image

        if self.resolve is None:
            return UNRESOLVED
        images = []
        for ref in step.images:
            data = self.resolve(ref.sha256)
            if data is None:
                return UNRESOLVED
            try:
                images.append(Image.open(io.BytesIO(data)).convert("RGB"))
            except (OSError, ValueError):  # bytes that are no image: the same as missing ones
                return UNRESOLVED
        out = self.processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        want = [int(g.prod()) // self.merge ** 2 for g in grid]
        if pad_runs(step.prompt_token_ids, self.image_token_id) != want:
            return MISMATCH
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}

    def token_types(self, ids: Any) -> Any:
        """``mm_token_type_ids`` (transformers' M-RoPE input): 1 at image tokens, 0 elsewhere."""
        return (ids == self.image_token_id).long()


def vision_gap(batch: Batch, seq_logprobs: Callable[[list[int]], list[list[float]]]) -> tuple[float, int]:
    """The check over ``batch``'s vision sequences: the largest gap between the policy's raw logprobs and the
    recorded ones, over the response tokens of the samples of the learner's version; (gap, tokens compared).
    ``seq_logprobs(qs)``: for each sequence index, the policy's logprob of each of its ids after the first
    (position t predicts id t + 1), the engine's own forward."""
    qs = [q for q, seq in enumerate(batch.sequences) if seq.vision is not None
          and any(batch.samples[i].policy_version == batch.version for i in seq.samples)]
    gap, n = 0.0, 0
    for q, lps in zip(qs, seq_logprobs(qs) if qs else [], strict=True):
        for i in batch.sequences[q].samples:
            s = batch.samples[i]
            if s.policy_version == batch.version:
                mine = lps[s.offset - 1 : s.offset - 1 + len(s.response_ids)]
                gap = max([gap, *(abs(a - b) for a, b in zip(mine, s.logprobs, strict=True))])
                n += len(mine)
    return gap, n


def check_message(gap: float, tol: float, tokens: int) -> str | None:
    """The error line when ``gap`` is beyond ``tol``, else None."""
    if gap <= tol:
        return None
    return (f"vision check failed: the learner's logprobs of {tokens} response tokens of vision "
            f"steps differ from vLLM's by up to {gap:.3g} (tolerance {tol:g}): the learner does not see the "
            "images as vLLM did (image processor, image bytes or position ids); training on them would use a "
            "wrong behaviour policy")
