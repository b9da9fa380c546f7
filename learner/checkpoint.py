"""Checkpoints to any fsspec URL (a local path, file://, s3://, gs://, memory:// ...).

A checkpoint is one ``torch.save``d plain dict: the trainable weights, the optimizer state, the stream cursor
(everything up to it has been trained on or deliberately dropped), the policy version, the update count, the
config as a plain dict and the RNG state. ``latest`` (a small JSON file) names the newest complete one; it is
written after the checkpoint itself, so a crash mid-save leaves the previous checkpoint in charge.
"""

from __future__ import annotations

import io
import json
from typing import Any

import fsspec
import torch

LATEST = "latest.json"


def _join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights that training changes: all of them, or only the LoRA adapter's (peft)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if k in names}


def save(url: str, state: dict[str, Any], *, keep: int = 2) -> str:
    """Write ``state`` as ``ckpt-<updates>.pt`` under ``url`` and point ``latest`` at it; prune old ones."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    name = f"ckpt-{int(state['updates']):08d}.pt"
    buf = io.BytesIO()
    torch.save(state, buf)  # one sync point: the model and optimizer tensors are copied to bytes here
    with fs.open(_join(root, name), "wb") as fh:
        fh.write(buf.getvalue())
    with fs.open(_join(root, LATEST), "w") as fh:
        fh.write(json.dumps({"name": name, "updates": state["updates"], "version": state["version"],
                             "cursor": state["cursor"]}))
    old = sorted(p for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[-1].startswith("ckpt-"))
    for path in old[:-keep] if keep > 0 else []:
        fs.rm(path)
    return _join(url, name)


def load_latest(url: str) -> dict[str, Any] | None:
    """The newest complete checkpoint under ``url``, or None when there is none."""
    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(_join(root, LATEST)):
        return None
    with fs.open(_join(root, LATEST), "r") as fh:
        name = json.loads(fh.read())["name"]
    with fs.open(_join(root, name), "rb") as fh:
        data = fh.read()
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    missing = set(trainable_state(model)) - set(state["model"])
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} trainable tensors (e.g. {sorted(missing)[:3]}): "
                         "was it written with other LoRA settings?")
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    if "rng" in state:
        torch.set_rng_state(state["rng"])
