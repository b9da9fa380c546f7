"""The verl engine's vision rows: what verl's workers take for a row with images, and two fixes to verl.

A vision row carries ``multi_modal_inputs`` (its ``pixel_values`` and ``image_grid_thw``, a dict per row:
verl's ``extract_multi_modal_inputs`` concatenates them per micro-batch) and ``position_ids`` [4, L]: the
text positions, then the model's three M-RoPE rows, computed on the driver by the model class's own
``get_rope_index`` (as verl's agent loop does by binding it to the processor).

The fixes (verl 0.9.1 with torch's jagged nested tensors), both for the 3-D ``position_ids`` of vision rows;
1-D components (every text tensor) keep verl's own path:
- ``fix_nested_select`` (in each worker, and in the driver, which splits a batch among the workers): verl's
  ``nested_tensor_from_tensor_list``, which its micro-batch selection (``index_select_tensor_dict``,
  ``chunk_tensordict``) re-nests every jagged tensor with, builds [4, L_i] components ragged on their first
  dimension and only then sets ``_ragged_idx``: the rows come out scrambled and a later split fails
  ("split_with_sizes expects split_sizes to sum exactly to ..."). The replacement passes ``jagged_dim``.
- ``position_rows``: ``left_right_2_no_padding`` nests them with ``as_nested_tensor``, which for a batch of
  one row takes the 4 as the ragged size.
"""

from __future__ import annotations

import functools
import types
from pathlib import Path
from typing import Any

import torch


def mrope_positions(model_dir: str | Path, ids: Any, grid_thw: Any, image_token_id: int) -> Any:
    """[4, L] position ids of one vision sequence as verl's workers take them: the text positions, then the
    model's own three M-RoPE rows (its class's ``get_rope_index``, as verl binds it to the processor)."""
    from transformers import AutoModel

    config = _config(str(model_dir))
    cls = AutoModel._model_mapping[type(config)]  # Qwen2VLModel, ...: owns get_rope_index
    holder = types.SimpleNamespace(config=config)
    holder.get_vision_position_ids = types.MethodType(cls.get_vision_position_ids, holder)
    ids = torch.as_tensor(ids)[None]
    rope, _ = cls.get_rope_index(holder, input_ids=ids, mm_token_type_ids=(ids == image_token_id).long(),
                                 image_grid_thw=grid_thw)  # [3, 1, L]
    return torch.cat([torch.arange(ids.shape[1])[None], rope[:, 0]], dim=0)


@functools.lru_cache(maxsize=4)
def _config(model_dir: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def verl_fields(model_dir: str | Path, image_token_id: int, visions: list[dict[str, Any] | None],
                input_ids: Any, attn: Any) -> dict[str, Any]:
    """What verl's workers take for rows with images: ``position_ids`` [B, 4, L] (left-padded rows: a text
    row's positions four times, a vision row's from ``mrope_positions``) and ``multi_modal_inputs``, one dict
    per row (empty for a text row)."""
    text = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, L]
    pos = text[:, None, :].repeat(1, 4, 1)
    for r, v in enumerate(visions):
        if v is not None:
            valid = attn[r].bool()
            pos[r][:, valid] = mrope_positions(model_dir, input_ids[r][valid], v["image_grid_thw"],
                                               image_token_id)
    return {"position_ids": pos, "multi_modal_inputs": [dict(v) if v is not None else {} for v in visions]}


def position_rows(td: Any) -> None:
    """``td``'s [B, 4, j] ``position_ids`` re-nested ragged on the sequence (module docstring)."""
    td["position_ids"] = _nested(list(td["position_ids"].unbind()), 2)


def _nested(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Components of 2+ dimensions nested ragged on ``dim`` (1-based past the batch dimension)."""
    lengths = torch.tensor([t.shape[dim - 1] for t in tensors], dtype=torch.long)
    offsets = torch.zeros(len(tensors) + 1, dtype=torch.long)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    values = torch.cat(tensors, dim=dim - 1)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets.to(values.device), jagged_dim=dim)


def fix_nested_select() -> None:
    """Install the fixed re-nesting in verl's tensordict utilities (module docstring); idempotent."""
    from verl.utils import tensordict_utils as tu

    if getattr(tu.nested_tensor_from_tensor_list, "steptap_fixed", False):
        return
    verl_own = tu.nested_tensor_from_tensor_list

    def nested(tensors: list[torch.Tensor], ragged_idx: int | None = None) -> torch.Tensor:
        if tensors[0].dim() == 1:
            return verl_own(tensors, ragged_idx)
        return _nested(list(tensors), ragged_idx or tensors[0].dim())

    nested.steptap_fixed = True  # type: ignore[attr-defined]
    tu.nested_tensor_from_tensor_list = nested
