"""steptap's vLLM plugin (``vllm_plugin/``: the ``steptap`` weight-transfer engine) installed into vLLM's venv.

The plugin runs inside vLLM's processes and imports torch and vLLM, so it is never imported here: its folder
ships as package data and is pip-installed into vLLM's own virtualenv from a copy (the build writes beside the
sources), offline (``--no-index``, no build isolation: vLLM's venv has setuptools). A marker holding the
sources' hash makes it idempotent: installed once per venv, again only when the plugin changed.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

PLUGIN_DIR = Path(__file__).parent / "vllm_plugin"
MARKER = ".steptap-vllm-plugin"  # in the venv: the hash of the installed plugin's sources
BACKEND = "steptap"  # the engine's name: vLLM's --weight-transfer-config '{"backend": "steptap"}'


def plugin_hash() -> str:
    h = hashlib.sha256()
    for f in sorted(PLUGIN_DIR.iterdir()):
        if f.is_file() and f.suffix in (".py", ".toml"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def ensure_plugin(venv: Path) -> None:
    """Install the plugin into ``venv`` unless this version of it is there already."""
    marker = venv / MARKER
    want = plugin_hash()
    if marker.is_file() and marker.read_text().strip() == want:
        return
    with open(venv.parent / f".{venv.name}.plugin.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two servers starting at once install it once
        if marker.is_file() and marker.read_text().strip() == want:
            return
        with tempfile.TemporaryDirectory(prefix="steptap-vllm-plugin-") as tmp:
            src = Path(tmp) / "src"
            shutil.copytree(PLUGIN_DIR, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
            out = subprocess.run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                 "--no-build-isolation", "--force-reinstall", str(src)],
                capture_output=True, text=True, check=False,
            )
        if out.returncode != 0:
            raise RuntimeError(f"could not install steptap's vLLM plugin into {venv}: {out.stderr[-2000:]}")
        marker.write_text(want + "\n")
