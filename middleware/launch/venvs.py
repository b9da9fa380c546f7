"""Virtualenvs of their own for what cannot share steptap's (vLLM's pins; Harbor's Python >= 3.12): built once
per machine under a file lock, in a temporary folder beside the target, and renamed into place when complete,
so a half-built one is never used and two processes never build at once; or adopted when built by hand."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

MARKER = ".steptap-venv-complete"  # written last: a venv without it was never finished


def _imports(python: Path, module: str) -> bool:
    # An import may take seconds (vLLM's); done only when a venv has no marker yet.
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0


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


def build_once(target: Path, *, python: str, installs: list[list[str]], removals: list[str], imports: str,
               label: str, constraints: Path | None = None) -> Path:
    """A complete virtualenv at ``target`` made by ``python -m venv`` and the pip ``installs`` in order (then
    the ``removals``), checked by importing ``imports``; built first if needed (minutes, once per machine).
    ``constraints``: a pip constraints file every install honours (the versions of what they pull in)."""
    venv_python = target / "bin" / "python"
    if (target / MARKER).exists() and venv_python.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it
        if (target / MARKER).exists() and venv_python.exists():
            return target
        if venv_python.exists() and _imports(venv_python, imports):  # built by hand with the same recipe
            (target / MARKER).write_text("adopted\n")
            return target
        for stale in target.parent.glob(f".{target.name}.build-*"):  # crashed builds; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.parent / f".{target.name}.build-{os.getpid()}"
        print(f"steptap: building the {label} virtualenv at {target} (once, minutes)", file=sys.stderr)
        try:
            subprocess.run([python, "-m", "venv", str(tmp)], check=True)
            pip = [str(tmp / "bin" / "python"), "-m", "pip"]
            subprocess.run([*pip, "install", "-q", "-U", "pip"], check=True)
            pinned = ["-c", str(constraints)] if constraints is not None else []
            for pkgs in installs:
                subprocess.run([*pip, "install", *pinned, *pkgs], check=True)
            if removals:
                subprocess.run([*pip, "uninstall", "-y", *removals], check=True)
            if not _imports(tmp / "bin" / "python", imports):
                raise RuntimeError(f"{imports} does not import in the freshly built {tmp}")
            _relocate_scripts(tmp / "bin", tmp, target)
            (tmp / MARKER).write_text("built\n")
            if target.exists():  # an unfinished or broken venv from an older build
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
