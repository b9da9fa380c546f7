"""Checkpoints to any fsspec URL (a local path, file://, s3://, gs://, memory:// ...): safetensors + JSON.

A checkpoint is a plain nested dict (the engine's weights and optimizer state, with algorithm gae its value
head and the head's optimizer, the stream cursor, the policy version, the update count, the config, the RNG
state). It is stored as a directory ``ckpt-<updates>/``:

- ``tensors.safetensors``: every tensor of the dict, under its path (``engine/optimizer/state/3/exp_avg``);
- ``state.json``: everything else, with ``{"__tensor__": path}`` where a tensor was (and
  ``{"__items__": [[key, value], ...]}`` for dicts whose keys are not strings, such as torch optimizer state).

Neither format can run code when read: nothing here calls ``torch.load``/pickle, so a checkpoint fetched from
a URL anyone can write is data, never a program. An old pickle checkpoint (``ckpt-N.pt``) is refused.

Durability. Locally the directory is written under a temporary name, every file and the directory are
fsync'd, it is renamed into place and the parent fsync'd; then ``latest.json`` (which names the newest
complete checkpoint) is replaced the same way. On object stores (no rename) the files are written in place and
``latest.json``, written last, is the commit point. Either way ``save`` returns only once the checkpoint is
durable, and a crash mid-save leaves the previous checkpoint in charge. The daemon acknowledges the stream
only after ``save`` returned.

(The atomic-write helpers live here until the middleware grows a shared one.)
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any

import fsspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from steptap.middleware import files

LATEST = "latest.json"
TENSORS = "tensors.safetensors"
STATE = "state.json"
FORMAT = "steptap-checkpoint/2"


class CheckpointError(ValueError):
    """A checkpoint that is not in this format, or damaged: refused with the reason."""


def _join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights that training changes: all of them, or only the LoRA adapter's (peft)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if k in names}


# -- nested dict <-> (JSON skeleton, flat tensors) ---------------------------------------------------------


def split_tensors(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """A JSON-able copy of ``obj`` with its tensors moved into ``tensors`` (keyed by their path)."""
    if isinstance(obj, torch.Tensor):
        key = path or "_"
        # Safetensors refuses shared or strided storage
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: split_tensors(v, tensors, f"{path}/{k}" if path else k) for k, v in obj.items()}
        return {"__items__": [[k, split_tensors(v, tensors, f"{path}/{k}" if path else str(k))]
                              for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [split_tensors(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"cannot checkpoint {type(obj).__name__} at {path!r}: only tensors and JSON values")


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            try:
                return tensors[obj["__tensor__"]]
            except KeyError:
                raise CheckpointError(f"state.json names a tensor {obj['__tensor__']!r} the file "
                                      "lacks") from None
        if set(obj) == {"__items__"}:
            return {k: join_tensors(v, tensors) for k, v in obj["__items__"]}
        return {k: join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_tensors(v, tensors) for v in obj]
    return obj


# -- atomic local writes ------------------------------------------------------------------------------------


def _write_local_dir(root: str, name: str, payload: dict[str, bytes]) -> None:
    """``root/name/`` holding ``payload``, all-or-nothing: temp dir, files synced, rename, directories
    synced."""
    files.makedirs(root)
    tmp = os.path.join(root, f".tmp-{name}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp, mode=0o700)
    try:
        for fname, data in payload.items():
            files.atomic_write(os.path.join(tmp, fname), data, durable=False)
        files.sync_tree(tmp)
        final = os.path.join(root, name)
        if os.path.exists(final):  # a re-save of the same update count (a resumed run): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        files.fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- save / load --------------------------------------------------------------------------------------------


def save(url: str, state: dict[str, Any], *, keep: int = 2) -> str:
    """Write ``state`` as ``ckpt-<updates>/`` under ``url``, durably, point ``latest`` at it, prune old
    ones."""
    fs, root = fsspec.core.url_to_fs(url)
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    name = f"ckpt-{int(state['updates']):08d}"
    tensors: dict[str, torch.Tensor] = {}
    skeleton = split_tensors(state, tensors)  # one sync point: every tensor is copied to CPU here
    payload = {TENSORS: st_save(tensors, metadata={"format": FORMAT}),
               STATE: json.dumps({"format": FORMAT, "state": skeleton}).encode()}
    pointer = json.dumps({"name": name, "updates": state["updates"], "version": state.get("version"),
                          "cursor": state.get("cursor")}).encode()
    if local:
        _write_local_dir(root, name, payload)
        files.atomic_write(os.path.join(root, LATEST), pointer)
    else:
        fs.makedirs(root, exist_ok=True)
        for fname, data in payload.items():
            with fs.open(_join(root, f"{name}/{fname}"), "wb") as fh:
                fh.write(data)
        with fs.open(_join(root, LATEST), "wb") as fh:  # the commit point: written after the checkpoint
            fh.write(pointer)
    _prune(fs, root, keep, protect=name)
    return _join(url, name)


def _prune(fs: Any, root: str, keep: int, protect: str) -> None:
    if keep <= 0:
        return
    ours = sorted(p for p in fs.ls(root, detail=False) if p.rstrip("/").rsplit("/",
                                                                               1)[-1].startswith("ckpt-"))
    for path in ours[:-keep]:
        if not path.rstrip("/").endswith(protect):
            fs.rm(path, recursive=True)


def load_latest(url: str) -> dict[str, Any] | None:
    """The newest complete checkpoint under ``url``, or None when there is none. Raises ``CheckpointError``
    for one that is not safetensors + JSON (an old pickle checkpoint included: it is never unpickled)."""
    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(_join(root, LATEST)):
        return None
    with fs.open(_join(root, LATEST), "rb") as fh:
        try:
            name = str(json.loads(fh.read())["name"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{url}/{LATEST} is not a checkpoint pointer ({exc})") from None
    if "/" in name or name.startswith("."):
        raise CheckpointError(f"{url}/{LATEST} names {name!r}, not a checkpoint directory under it")
    return load(_join(url, name))


def load(url: str) -> dict[str, Any]:
    """One checkpoint directory (``.../ckpt-N``) back as the nested dict ``save`` was given."""
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.isdir(path):
        raise CheckpointError(f"{url} is not a steptap checkpoint directory (safetensors + JSON); a pickle "
                              "checkpoint (.pt) from an older steptap is refused: it could run code when "
                              "loaded")
    try:
        with fs.open(_join(path, STATE), "rb") as fh:
            doc = json.loads(fh.read())
        with fs.open(_join(path, TENSORS), "rb") as fh:
            raw = fh.read()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{url} is incomplete: {exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{url}/{STATE} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{url}/{STATE}: format "
                              f"{doc.get('format') if isinstance(doc, dict) else None!r}, "
                              f"expected {FORMAT!r}")
    try:
        tensors = st_load(raw)  # parses a JSON header and raw buffers; a pickle here is just a bad header
    except Exception as exc:  # safetensors raises its own SafetensorError for any malformed file
        raise CheckpointError(f"{url}/{TENSORS} is not a safetensors file ({exc})") from None
    return join_tensors(doc["state"], tensors)


def restore_model(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """The trained weights of an engine's checkpoint state into ``model`` (built as the learner built it)."""
    missing = set(trainable_state(model)) - set(state["model"])
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} trainable tensors (e.g. {sorted(missing)[:3]}): "
                         "was it written with other LoRA settings?")
    try:
        model.load_state_dict(state["model"], strict=False)
    except RuntimeError as exc:  # torch's size mismatches: the same names, other shapes
        first = str(exc).split("\n\t", 2)[1] if "\n\t" in str(exc) else str(exc)
        raise ValueError(f"checkpoint's tensors do not fit this model ({first.strip()}): was it written with "
                         "other LoRA settings or for another model?") from None


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    restore_model(model, state)
    optimizer.load_state_dict(state["optimizer"])
    if "rng" in state:
        torch.set_rng_state(state["rng"])


def restore_value_head(head: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       state: dict[str, Any]) -> bool:
    """The step-level value head (algorithm gae) and its optimizer from ``state``; False, with both left as
    they are, when the checkpoint has none (written before heads were saved, or by a run without gae)."""
    if "value_head" not in state:
        return False
    saved = state["value_head"]
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    if set(saved) != set(shapes) or any(tuple(saved[k].shape) != shapes[k] for k in shapes):
        raise ValueError(f"checkpoint's value head {({k: tuple(v.shape) for k, v in saved.items()})} does "
                         "not fit "
                         f"this model's {shapes}: was it written for another model?")
    head.load_state_dict(saved)
    if "value_optimizer" in state:
        optimizer.load_state_dict(state["value_optimizer"])
    return True

