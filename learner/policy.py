"""The model the learner trains, built from its config: ``cfg.model_dir``'s weights (a vision-language model
dir as ``AutoModelForImageTextToText``), inside a peft LoRA adapter when ``lora_rank`` > 0 (on a
vision-language model, the language model's layers only). The torch engine trains it; ``steptap
trained-model`` builds the same one to load a checkpoint into."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from steptap.learner.config import LearnerConfig
from steptap.learner.vision import lora_targets, vision_config


def model_class(model_dir: str | Path) -> Any:
    """transformers' auto class for ``model_dir``: image-text-to-text for a vision-language model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision_config(model_dir) is not None else AutoModelForCausalLM


def policy_model(cfg: LearnerConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """``cfg.model_dir``'s weights on ``device``, LoRA-wrapped when ``cfg.lora_rank`` > 0."""
    model = model_class(cfg.model_dir).from_pretrained(cfg.model_dir, dtype=dtype).to(device)
    if cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                                 lora_dropout=cfg.lora_dropout,
                                                 target_modules=lora_targets(cfg.lora_targets, cfg.model_dir),
                                                 task_type="CAUSAL_LM"))
    return model
