"""Checks of a weights directory before a swap pauses anything: path validation, tied embeddings, and the
served model's tensor names and shapes read from the safetensors headers (no torch). Stateless: the swapper
(``weights/swapper.py``) calls them."""

from __future__ import annotations

import json
from pathlib import Path

from steptap.middleware.exceptions import SwapRefused
from steptap.middleware.model_files import tensor_shapes, ties_embeddings


def check_weights_dir(path: str, *, cpu_backend: bool, reference: str | None = None) -> None:
    """Refuse a directory vLLM cannot reload correctly, before anything is paused.

    With ``reference`` (the weights being served), the tensors' names and shapes must match it: vllm 0.32
    reads a reload after setting its parameters aside, so a mismatch found there leaves it unusable."""
    d = Path(path)
    if not d.is_dir():
        raise SwapRefused(f"weights directory not found: {path}", "weights_not_found")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise SwapRefused(f"{path} has no config.json (expected a Hugging Face model directory)",
                        "invalid_weights")
    if not any(d.glob("*.safetensors")):
        raise SwapRefused(f"{path} has no *.safetensors files", "invalid_weights")
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError) as exc:
        raise SwapRefused(f"cannot read {cfg}: {exc}", "invalid_weights") from exc
    if cpu_backend and ties_embeddings(d, config):
        raise SwapRefused(
            "refusing disk reload: this model ties its input and output embeddings (tie_word_embeddings), "
            "and vLLM on CPU keeps the old output layer after a reload, so its logits would be wrong. Swap a "
            'LoRA adapter instead ({"lora_path": ...}), or use a model with tie_word_embeddings=false.',
            "tied_embeddings",
        )
    if reference is None or not Path(reference).is_dir() or Path(reference).resolve() == d.resolve():
        return
    try:
        new, ref = tensor_shapes(d), tensor_shapes(reference)
    except (OSError, ValueError) as exc:
        raise SwapRefused(f"cannot read the safetensors headers in {path}: {exc}",
                        "invalid_weights") from exc
    if not ref:
        return
    missing = sorted(ref.keys() - new.keys())
    extra = sorted(new.keys() - ref.keys())
    wrong = sorted(k for k in ref.keys() & new.keys() if list(ref[k]) != list(new[k]))
    if missing or extra or wrong:
        parts = []
        if wrong:
            shown = ", ".join(f"{k} {new[k]} (served: {ref[k]})" for k in wrong[:3])
            parts.append("shape differs for " + shown)
        if missing:
            parts.append("missing " + ", ".join(missing[:3]))
        if extra:
            parts.append("unknown " + ", ".join(extra[:3]))
        raise SwapRefused(f"{path} does not fit the served model ({reference}): " + "; ".join(parts),
                        "weights_mismatch")


def check_adapter_dir(path: str) -> None:
    d = Path(path)
    if not (d / "adapter_config.json").is_file():
        raise SwapRefused(f"{path} is not a peft adapter directory (no adapter_config.json)",
                        "invalid_adapter")
