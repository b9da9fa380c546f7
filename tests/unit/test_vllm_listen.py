"""Where `steptap vllm` listens (issue 25, item 2). vLLM runs in dev mode (pause, reload weights, weight
transfer, LoRA loads: no auth of their own), so it serves on unix sockets in a private directory, replicas
included, and TCP is refused unless the user says it is meant: ``--insecure-tcp``. vLLM's own ``--api-key`` is
not enough: it guards only paths under /v1 (vllm/entrypoints/serve/middleware/authenticate.py,
GUARDED_PREFIX), never /pause, /collective_rpc or /init_weight_transfer_engine. Decided before anything
starts: no vLLM needed."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from steptap.learner.tiny_model import build_tiny_model
from steptap.middleware.launch import vllm_command

STEPTAP = [sys.executable, "-m", "steptap.middleware.cli"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("extra", [[], ["--replicas", "2"], ["--", "--api-key", "k"]])
def test_tcp_in_dev_mode_is_refused_without_insecure_tcp(model_dir: Path, extra: list[str]) -> None:
    out = subprocess.run([*STEPTAP, "vllm", "--model", str(model_dir), "--port", "1", *extra],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--insecure-tcp" in out.stderr and "--api-key" in out.stderr, out.stderr[-2000:]


def test_tcp_is_allowed_when_asked_for(model_dir: Path) -> None:
    for argv in (["--port", "1", "--insecure-tcp"], ["--port", "1", "--insecure-tcp", "--", "--api-key",
                                                     "k"]):
        args, extra = vllm_command.parse(["--model", str(model_dir), *argv])
        servers, _ = vllm_command.plan_servers(args, extra)
        assert [s.url for s in servers] == ["http://127.0.0.1:1"]


def test_replicas_serve_on_their_own_unix_sockets_in_a_private_directory(model_dir: Path) -> None:
    args, extra = vllm_command.parse(["--model", str(model_dir), "--replicas", "3"])
    servers, own_dir = vllm_command.plan_servers(args, extra)
    try:
        assert own_dir is not None and stat.S_IMODE(Path(own_dir).stat().st_mode) == 0o700
        socks = [s.uds for s in servers]
        assert len(set(socks)) == 3 and all(s is not None and s.parent == Path(own_dir) for s in socks)
        for s in servers:
            cmd = s.command(Path("python"))
            assert "--uds" in cmd and "--port" not in cmd and "--host" not in cmd
    finally:
        if own_dir:
            Path(own_dir).rmdir()


def test_lora_rank_zero_serves_without_lora_and_float32_lora_on_a_gpu_is_refused(model_dir: Path) -> None:
    """vLLM 0.26's LoRA kernels on CUDA assert fp16/bf16: on the H200 a float32 server with LoRA died at
    start. Refused before anything starts, naming both ways out; rank 0 serves without LoRA."""
    from steptap.middleware.launch.vllm_server import VLLMServer, VLLMStartError

    def command(**kw: object) -> list[str]:
        return VLLMServer(model_dir, **kw).command(Path("python"))  # type: ignore[arg-type]

    cmd = command(gpu=True, max_lora_rank=0, extra_args=["--dtype", "float32"])
    assert "--enable-lora" not in cmd and "--max-lora-rank" not in cmd
    assert "--enable-lora" in command(gpu=False, extra_args=["--dtype=float32"])
    for dtype in (["--dtype", "float32"], ["--dtype=float"], ["--dtype", "bfloat16", "--dtype", "float32"]):
        with pytest.raises(VLLMStartError, match="--max-lora-rank 0.*--dtype bfloat16"):
            VLLMServer(model_dir, gpu=True, extra_args=dtype)
    assert "--enable-lora" in command(gpu=True, extra_args=["--dtype", "bfloat16"])
