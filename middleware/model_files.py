"""What a model directory says about itself, read without torch: tensor names and shapes from the safetensors
headers, and whether the output layer ties the input embeddings. Kernel: the weight swap's checks and
``steptap vllm``/``up`` ask the same questions and must get the same answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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


def read_config(model_dir: Path) -> dict[str, Any]:
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
    (transformers' base default, and the safe answer, since a tied model must not get a full-weight
    reload)."""
    d = Path(model_dir)
    config = read_config(d) if config is None else config
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
