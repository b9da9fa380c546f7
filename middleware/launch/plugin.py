"""steptap's vLLM plugin (``vllm_plugin/``: the ``steptap`` weight-transfer engine) installed into vLLM's
venv.

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
    h = hashlib.sha256(PROBE.encode())  # a changed probe re-runs too
    for f in sorted(PLUGIN_DIR.iterdir()):
        if f.is_file() and f.suffix in (".py", ".toml"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


PROBE = (  # run in vLLM's venv after installing: does this vLLM take the engine (its API drifts by release)?
    "import steptap_vllm_plugin as p\n"
    "missing = sorted(p.SteptapTransferEngine.__abstractmethods__)\n"
    "assert not missing, f'vLLM asks engines for {missing}'\n"
    "from vllm.config.weight_transfer import WeightTransferConfig\n"
    "WeightTransferConfig(backend=p.NAME)\n"
)


def ensure_plugin(venv: Path) -> str | None:
    """Install the plugin into ``venv`` unless this version of it is there already; then whether this vLLM
    takes it: None when it does, else why not (vLLM then starts without the transfer engine, disk swaps
    only)."""
    marker = venv / MARKER
    want = plugin_hash()
    if marker.is_file() and marker.read_text().split("\n", 1)[0] == want:
        return _verdict(marker)
    with open(venv.parent / f".{venv.name}.plugin.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two servers starting at once install it once
        if marker.is_file() and marker.read_text().split("\n", 1)[0] == want:
            return _verdict(marker)
        python = str(venv / "bin" / "python")
        with tempfile.TemporaryDirectory(prefix="steptap-vllm-plugin-") as tmp:
            src = Path(tmp) / "src"
            shutil.copytree(PLUGIN_DIR, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info",
                                                                           "build"))
            out = subprocess.run(
                [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                 "--force-reinstall", str(src)],
                capture_output=True, text=True, check=False,
            )
        if out.returncode != 0:
            raise RuntimeError(f"could not install steptap's vLLM plugin into {venv}: {out.stderr[-2000:]}")
        probe = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=False)
        why = "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["probe failed"])[-1]
        marker.write_text(f"{want}\n{why}\n")
        return why or None


def _verdict(marker: Path) -> str | None:
    lines = marker.read_text().split("\n")
    return lines[1].strip() or None if len(lines) > 1 else None
