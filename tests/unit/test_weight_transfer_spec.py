"""The transfer half of ``POST /admin/weights`` refuses what it cannot load before anything pauses: a
malformed ``transfer`` body (clear 400 in the OpenAI error format), tensors that do not fit the served model
(names and shapes from its safetensors headers), and the launcher asks vLLM for steptap's transfer engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_weight_checks import EMBED, HEAD, _model

from steptap.middleware.errors import status_of
from steptap.middleware.exceptions import SwapError
from steptap.middleware.launch import plugin
from steptap.middleware.launch.vllm_server import VLLMServer
from steptap.middleware.weights.swapper import WeightSwapper
from steptap.middleware.weights.transfer import Transfer


def spec(**kw: Any) -> Transfer:
    base: dict[str, Any] = {"address": "127.0.0.1", "port": 29500, "secret": "s" * 64,
                            "names": ["model.embed_tokens.weight",
                            "lm_head.weight"], "dtype_names": ["float32", "float32"],
                            "shapes": [[4, 2], [4, 2]]}
    return Transfer(**{**base, **kw})


@pytest.mark.parametrize("kw, words", [
    ({"port": 0}, "not a TCP port"),
    ({"timeout_s": 0.1}, "timeout_s"),
    ({"names": ["a"]}, "equally long"),
    ({"names": ["a", "a"]}, "repeats"),
    ({"dtype_names": ["float32", "complex999"]}, "unknown dtype"),
    ({"shapes": [[4, -2], [4, 2]]}, "negative"),
    ({"secret": "short"}, "transfer.secret"),
    ({"secret": "s" * 40 + "; rm"}, "transfer.secret"),
])
def test_a_malformed_transfer_is_refused_with_what_is_wrong(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(SwapError) as err:
        spec(**kw).check()
    assert status_of(err.value) == 400 and words in err.value.message


def test_tensors_must_fit_the_served_model(tmp_path: Path) -> None:
    served = _model(tmp_path / "m", {"model_type": "llama"}, {**EMBED, **HEAD})
    spec().check_fits(str(served))  # the same names and shapes
    with pytest.raises(SwapError) as err:
        spec(shapes=[[4, 2], [5, 2]]).check_fits(str(served))
    assert (
        err.value.code == "weights_mismatch" and "lm_head.weight [5, 2] (served: [4, 2])" in err.value.message
    )
    with pytest.raises(SwapError) as err:
        spec(names=["model.embed_tokens.weight", "lm_head.bias"]).check_fits(str(served))
    assert "missing lm_head.weight" in err.value.message and "unknown lm_head.bias" in err.value.message


def test_the_swapper_refuses_a_bad_transfer_before_calling_any_backend() -> None:
    # A backend nobody listens on: a refusal that reached it would say "unreachable" instead.
    sw = WeightSwapper("http://127.0.0.1:9", validate_paths=False)
    with pytest.raises(SwapError) as err:
        asyncio.run(sw.swap(transfer=spec(port=70000)))
    assert status_of(err.value) == 400 and sw.version == 0
    with pytest.raises(SwapError) as err:
        asyncio.run(sw.swap(path="/x", transfer=spec()))
    assert "exactly one" in err.value.message


def test_the_launcher_asks_vllm_for_the_transfer_engine(tmp_path: Path) -> None:
    served = _model(tmp_path / "m", {"model_type": "llama"}, {**EMBED, **HEAD})
    cmd = VLLMServer(served, gpu=False, port=1).command(Path("python"))
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "steptap"}'
    off = VLLMServer(served, gpu=False, port=1)
    off.transfer = False  # what start() sets when the installed vLLM refuses the engine (launch/plugin.py)
    assert "--weight-transfer-config" not in off.command(Path("python"))
    given = VLLMServer(served, gpu=False, port=1, extra_args=["--weight-transfer-config", "{}"])
    assert given.command(Path("python")).count("--weight-transfer-config") == 1
    # The plugin's sources ship beside the launcher, hashed for the install marker.
    assert (plugin.PLUGIN_DIR / "steptap_vllm_plugin.py").is_file() and len(plugin.plugin_hash()) == 16


async def test_a_refused_transfer_ends_the_learners_wait_with_the_proxys_error(aiohttp_client: Any,
                                                                                tmp_path: Path) -> None:
    # A proxy whose only backend is down: it answers 503 before any worker could join the learner's group.
    import torch

    from steptap.learner.publish import PublishError
    from steptap.learner.transfer import send_collective
    from steptap.middleware.app import create_app
    from steptap.middleware.config import ProxyConfig

    client = await aiohttp_client(create_app(ProxyConfig(backend="http://127.0.0.1:9",
                                                         log=str(tmp_path / "log"),
                                                         control_token="t")))
    url = str(client.make_url("")).rstrip("/")
    with pytest.raises(PublishError) as err:
        await asyncio.to_thread(send_collective, [("w", torch.zeros(2))], url, "t", timeout_s=30.0,
                                swap_timeout_s=60.0)
    assert status_of(err.value) >= 500, err.value
    assert "transfer refused" in str(err.value)
