"""Where vLLM replicas run: whether this machine has a GPU, and each replica's GPU or CPU threads (one rule,
for `steptap vllm --replicas` and `steptap up --replicas`)."""

from __future__ import annotations

import os
import shutil
import subprocess


def has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def replica_threads(replicas: int, gpu: bool, given: int | None) -> int | None:
    """CPU replicas share the cores (vLLM's default would give each half of them); else ``given``."""
    if replicas > 1 and not gpu:
        return given or max(1, (os.cpu_count() or 2) // (2 * replicas))
    return given


def replica_env(i: int, replicas: int, gpu: bool) -> dict[str, str] | None:
    """Replica ``i``'s GPU: one each when there are several replicas on a GPU machine; one replica sees every
    GPU (its own ``--tensor-parallel-size`` may use them)."""
    return {"CUDA_VISIBLE_DEVICES": str(i)} if replicas > 1 and gpu else None
