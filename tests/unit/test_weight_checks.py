"""``ties_embeddings``: the one answer to "does this model tie its output layer to its embeddings", used by
the weight swap's refusal and by ``steptap vllm``/``up`` (they disagreed on a config without the flag)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from steptap.middleware.exceptions import SwapError
from steptap.middleware.launch import vllm_server
from steptap.middleware.weights.checks import check_weights_dir, ties_embeddings


def _model(root: Path, config: dict[str, Any], tensors: dict[str, list[int]]) -> Path:
    """config.json and one safetensors file whose header names ``tensors`` (written by hand: no torch)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors.items():
        size = shape[0] * shape[1] * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * offset)
    return root


EMBED = {"model.embed_tokens.weight": [4, 2]}
HEAD = {"lm_head.weight": [4, 2]}


def test_a_config_without_the_flag_and_an_lm_head_tensor_is_untied_everywhere(tmp_path: Path) -> None:
    # Llama and Qwen2 configs default to untied in transformers, and a tied model is saved without lm_head.
    d = _model(tmp_path / "m", {"model_type": "llama"}, {**EMBED, **HEAD})
    assert ties_embeddings(d) is False
    assert vllm_server.ties_embeddings is ties_embeddings  # one definition, not a copy
    check_weights_dir(str(d), cpu_backend=True)  # the swap accepts it (it refused it before)


def test_a_config_without_the_flag_and_no_lm_head_is_tied(tmp_path: Path) -> None:
    d = _model(tmp_path / "m", {"model_type": "llama"}, EMBED)
    assert ties_embeddings(d) is True
    with pytest.raises(SwapError) as err:
        check_weights_dir(str(d), cpu_backend=True)
    assert err.value.code == "tied_embeddings"


@pytest.mark.parametrize(
    ("config", "tied"),
    [
        ({"tie_word_embeddings": True}, True),  # the flag wins over the tensors present
        ({"tie_word_embeddings": False}, False),
        ({"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": True}}, True),
        ({"text_config": {"tie_word_embeddings": False}}, False),
    ],
)
def test_an_explicit_flag_decides(tmp_path: Path, config: dict[str, Any], tied: bool) -> None:
    assert ties_embeddings(_model(tmp_path / "m", config, {**EMBED, **HEAD})) is tied


def test_no_readable_weights_means_tied(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert ties_embeddings(tmp_path) is True
