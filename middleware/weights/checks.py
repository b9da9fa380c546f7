"""Checks of a weights directory before a swap pauses anything: path validation, tied embeddings, and the
served model's tensor names and shapes read from the safetensors headers (no torch). Stateless: the swapper
(``weights/swapper.py``) and ``launch/vllm_server.py`` call them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class SwapError(Exception):
    """A refused or failed swap; ``status`` and ``code`` make the OpenAI error body of ``/admin/weights``."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def tensor_shapes(path: str | Path) -> dict[str, list[int]]:
    """Every tensor's name and shape in a directory's ``*.safetensors`` files, from the headers alone (an
    8-byte little-endian length, then JSON): no torch, no reading of the tensors themselves."""
    shapes: dict[str, list[int]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if size <= 0 or size > 100 << 20:
                raise ValueError(f"{f.name}: not a safetensors file (header length {size})")
            header = json.loads(fh.read(size))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def _read_config(model_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def ties_embeddings(model_dir: str | Path, config: dict[str, Any] | None = None) -> bool:
    """Whether a model's output layer shares its input embeddings: the one answer for the weight swap and for
    ``steptap vllm``/``up``.

    An explicit ``tie_word_embeddings`` (top level, or in ``text_config`` for multimodal configs) decides.
    Without one, the architecture's own default applies, which differs by model class (Llama and Qwen2 untie,
    the base class ties) and cannot be read without transformers; the weights tell instead: a tied model is
    saved without an ``lm_head.weight`` tensor, an untied one with it. With no readable weights either: tied
    (transformers' base default, and the safe answer, since a tied model must not get a full-weight reload)."""
    d = Path(model_dir)
    config = _read_config(d) if config is None else config
    flags = [config.get("tie_word_embeddings")]
    text = config.get("text_config")
    if isinstance(text, dict):
        flags.append(text.get("tie_word_embeddings"))
    given = [bool(f) for f in flags if f is not None]
    if given:
        return any(given)
    try:
        names = tensor_shapes(d)
    except (OSError, ValueError):
        names = {}
    if not names:
        return True
    return not any(k.endswith("lm_head.weight") for k in names)


def check_weights_dir(path: str, *, cpu_backend: bool, reference: str | None = None) -> None:
    """Refuse a directory vLLM cannot reload correctly, before anything is paused.

    With ``reference`` (the weights being served), the tensors' names and shapes must match it: vllm 0.32
    reads a reload after setting its parameters aside, so a mismatch found there leaves it unusable."""
    d = Path(path)
    if not d.is_dir():
        raise SwapError(400, f"weights directory not found: {path}", "weights_not_found")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise SwapError(400, f"{path} has no config.json (expected a Hugging Face model directory)",
                        "invalid_weights")
    if not any(d.glob("*.safetensors")):
        raise SwapError(400, f"{path} has no *.safetensors files", "invalid_weights")
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError) as exc:
        raise SwapError(400, f"cannot read {cfg}: {exc}", "invalid_weights") from exc
    if cpu_backend and ties_embeddings(d, config):
        raise SwapError(
            400,
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
        raise SwapError(400, f"cannot read the safetensors headers in {path}: {exc}",
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
        raise SwapError(400, f"{path} does not fit the served model ({reference}): " + "; ".join(parts),
                        "weights_mismatch")


def check_adapter_dir(path: str) -> None:
    d = Path(path)
    if not (d / "adapter_config.json").is_file():
        raise SwapError(400, f"{path} is not a peft adapter directory (no adapter_config.json)",
                        "invalid_adapter")
