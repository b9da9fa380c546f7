"""What a model directory says about itself, read without torch: tensor names and shapes from the safetensors
headers, whether the output layer ties the input embeddings, its chat template, and the hashes a dataset
names it by (``provenance``), the image processor a vision model is loaded with. Kernel: the weight swap's
checks, ``steptap vllm``/``up``, ``steptap export`` and the learner ask the same questions and must get the
same answers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# The files a tokenizer is made of (transformers' names); the chat template is hashed on its own
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")

# The image processor vLLM (through launch/vision.py's --mm-processor-kwargs) and the learner both load: the
# slow PIL one, the only one the learner's venv (no torchvision) has; the fast torchvision one resizes
# differently (docs/platform.md). transformers' ``backend="pil"`` would also reach vLLM's video processor,
# which has no PIL backend; ``use_fast`` reaches only the image processor.
IMAGE_PROCESSOR: dict[str, object] = {"use_fast": False}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())  # config.json, tokenizer_config.json: objects
        return data
    except (OSError, ValueError):
        return {}


def chat_template(model_dir: Path) -> str:
    """The model's chat template text, wherever transformers keeps it (empty when none)."""
    parts = []
    if (model_dir / "chat_template.jinja").is_file():
        parts.append((model_dir / "chat_template.jinja").read_text(errors="replace"))
    for name in ("tokenizer_config.json", "chat_template.json"):
        template = read_json(model_dir / name).get("chat_template")
        if isinstance(template, str):
            parts.append(template)
        elif isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            parts += [t.get("template", "") for t in template if isinstance(t, dict)]
    return "\n".join(parts)


def _hash_files(paths: list[Path]) -> str | None:
    """sha256 over each file's name and bytes, in name order (streamed: weights may be large)."""
    if not paths:
        return None
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: p.name):
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def provenance(model_dir: str | Path) -> dict[str, str | None]:
    """What names the model a dataset was sampled from: the weights (``*.safetensors`` and ``config.json``),
    the tokenizer files, and the chat template text, each as ``sha256:HEX`` (None: the directory has none)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"no model directory at {d}")
    template = chat_template(d)
    weights = [*d.glob("*.safetensors"), *(p for p in [d / "config.json"] if p.is_file())]
    return {
        "model_dir": str(d.resolve()),
        "model_hash": _hash_files(weights),
        "tokenizer_hash": _hash_files([d / n for n in TOKENIZER_FILES if (d / n).is_file()]),
        "chat_template_hash": "sha256:" + hashlib.sha256(template.encode()).hexdigest() if template else None,
    }


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
