"""Learner checkpoints: safetensors + JSON, atomic, never unpickled.

A torch optimizer's state (int keys, tensors, tuples) and the daemon's bookkeeping round-trip exactly; a save
that fails half-way leaves the previous checkpoint in charge and no debris; a checkpoint carrying a pickle
payload (an old ``.pt`` one, or a pickle where the safetensors file should be) is refused and never runs.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from steptap.learner import checkpoint
from steptap.learner.checkpoint import CheckpointError


def _state(updates: int, cursor: str) -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"engine": {"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "rng": torch.get_rng_state()},
            "cursor": cursor, "consumed_after_cursor": ["t9"], "version": 7, "updates": updates,
            "config": {"lr": 1e-2, "betas": [0.9, 0.95], "lora_targets": ["q_proj"]}}


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert list(a) == list(b) if not any(isinstance(x, (torch.Tensor, dict)) for x in a) else True
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("where", ["local", "memory"])
def test_round_trip_latest_and_prune(tmp_path: Path, where: str) -> None:
    url = str(tmp_path / "ckpt") if where == "local" else f"memory://steptap-ckpt-{os.getpid()}"
    first, second = _state(2, "0:100"), _state(4, "0:200")
    checkpoint.save(url, first, keep=1)
    checkpoint.save(url, second, keep=1)
    loaded = checkpoint.load_latest(url)
    assert loaded is not None
    _assert_same(second, loaded)  # int keys of the optimizer state, tuples (as lists), tensors bit for bit
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(loaded["engine"]["optimizer"])  # torch accepts what came back
    assert opt.param_groups[0]["lr"] == 1e-2
    if where == "local":
        names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
        assert names == ["ckpt-00000004", "latest.json"]  # pruned to keep=1, no temporary debris
        files = sorted(p.name for p in (tmp_path / "ckpt" / "ckpt-00000004").iterdir())
        assert files == ["state.json", "tensors.safetensors"]
    assert checkpoint.load_latest(f"memory://steptap-none-{os.getpid()}") is None


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    url = str(tmp_path / "ckpt")
    checkpoint.save(url, _state(2, "0:100"))

    def failing_rename(src: str, dst: str) -> None:  # fault injector: the disk fails at the commit
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "rename", failing_rename)
    with pytest.raises(OSError):
        checkpoint.save(url, _state(4, "0:200"))
    monkeypatch.undo()
    loaded = checkpoint.load_latest(url)
    assert loaded is not None and loaded["updates"] == 2 and loaded["cursor"] == "0:100"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ckpt-00000002", "latest.json"]
    with pytest.raises(TypeError, match="only tensors and JSON"):
        checkpoint.save(url, {**_state(6, "x"), "bad": object()})
    assert checkpoint.load_latest(url)["updates"] == 2


class _Payload:
    """Unpickling this creates a file: the proof that a loader ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.marker),))


def test_a_pickle_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    # 1. An old-style torch.save checkpoint named by latest.json.
    old = tmp_path / "old"
    old.mkdir()
    torch.save({"model": {}, "evil": _Payload(str(marker))}, old / "ckpt-00000002.pt")
    (old / "latest.json").write_text(json.dumps({"name": "ckpt-00000002.pt", "updates": 2}))
    with pytest.raises(CheckpointError, match="pickle"):
        checkpoint.load_latest(str(old))
    # 2. A new-style directory whose tensors file is a pickle.
    new = tmp_path / "new"
    checkpoint.save(str(new), _state(2, "0:1"))
    (new / "ckpt-00000002" / "tensors.safetensors").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        checkpoint.load_latest(str(new))
    # 3. A pointer that escapes the checkpoint directory.
    (new / "latest.json").write_text(json.dumps({"name": "../old/ckpt-00000002.pt"}))
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        checkpoint.load_latest(str(new))
    assert not marker.exists()
