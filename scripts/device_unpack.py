"""The device side of ``scripts/device_pack.py``: receive the parts each call carries, join and check them,
install each set into its own folder, and say what the device then has (docs/gpu-runbook.md).

Standard library only: it runs with the device image's own ``python3`` before anything is installed.

    python3 scripts/device_unpack.py receive .devpack/calls/03      # check this call's parts, keep them
    python3 scripts/device_unpack.py install [--report]             # join, check, install every set
    python3 scripts/device_unpack.py report                         # what is installed, as JSON too

``receive`` refuses a part whose size or sha256 is not the manifest's (nothing of it is kept: carry that call
again) and moves the good ones to the stash (``--stash``, default /tmp/steptap-devpack), so the next call's
working tree does not carry them back. ``install`` joins each wheel from its parts, checks its sha256,
installs every set with ``pip install --no-index --no-deps --target PREFIX/<set>-site`` and lays out:
- ``PREFIX/learner-site``: steptap itself from this working tree (links to its folders, its entry points), on
  top of the learner set's wheels: ``PYTHONPATH=PREFIX/learner-site`` runs the proxy and the learner;
- ``PREFIX/vllm-env``: what ``steptap vllm`` takes as vLLM's virtualenv (``STEPTAP_VLLM_VENV``): a ``python``
  that puts ``PREFIX/vllm-site`` first, with steptap's vLLM plugin installed beside vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"
MIB = 1 << 20
# The vLLM routes steptap uses (middleware/backend/capabilities.py reads the live server's list)
ROUTES = [
    "/v1/chat/completions",
    "/v1/chat/completions/render",
    "/inference/v1/generate",
    "/v1/chat/completions/derender",
    "/pause",
    "/resume",
    "/is_paused",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/reset_encoder_cache",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/update_weight_version",
    "/weight_info",
    "/server_info",
    "/get_world_size",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/shutdown_weight_transfer_engine",
]


class Refused(Exception):
    """A part or wheel that is not what the manifest says."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def parts_of_call(manifest: dict, call: int) -> list[dict]:
    return [p for w in manifest["wheels"] for p in w["parts"] if p["call"] == call]


def receive(folder: Path, stash: Path) -> dict:
    """Check every part of the call ``folder`` holds; keep them in ``stash``. Raises ``Refused``."""
    manifest = load(folder / MANIFEST)
    call = next((c for c in manifest["calls"] if folder.as_posix().endswith(c["folder"])), None)
    if call is None:
        raise Refused(f"{folder}: not a call folder of its manifest")
    (stash / "parts").mkdir(parents=True, exist_ok=True)
    kept = stash / MANIFEST
    if kept.exists() and load(kept)["made"] != manifest["made"]:
        raise Refused(
            f"{folder} belongs to the pack made {manifest['made']}, the stash holds parts of the pack "
            f"made {load(kept)['made']}: clear {stash} or carry the same pack"
        )
    parts = parts_of_call(manifest, call["call"])
    for p in parts:  # every part checked before any is kept
        src = folder / Path(p["file"]).name
        if not src.is_file():
            raise Refused(f"{src}: missing (call {call['call']} carries {len(parts)} parts)")
        size, digest = src.stat().st_size, sha256(src)
        if size != p["size"] or digest != p["sha256"]:
            raise Refused(
                f"{src}: {size} bytes, sha256 {digest[:16]}..., the manifest says {p['size']} bytes, "
                f"{p['sha256'][:16]}...: refused, nothing of call {call['call']} kept (carry it again)"
            )
    for p in parts:
        shutil.move(str(folder / Path(p["file"]).name), stash / "parts" / Path(p["file"]).name)
    kept.write_text(json.dumps(manifest))
    have = {f.name for f in (stash / "parts").iterdir()}
    total = [p for w in manifest["wheels"] for p in w["parts"]]
    left = sorted({p["call"] for p in total if Path(p["file"]).name not in have})
    return {
        "call": call["call"],
        "parts": len(parts),
        "mib": round(call["bytes"] / MIB, 1),
        "have": len(total) - sum(1 for p in total if Path(p["file"]).name not in have),
        "of": len(total),
        "calls_left": left,
    }


def join(stash: Path) -> list[Path]:
    """Each wheel from its parts, checked against the manifest's sha256 (a bad one is removed)."""
    manifest = load(stash / MANIFEST)
    out = stash / "wheels"
    out.mkdir(exist_ok=True)
    joined = []
    for w in manifest["wheels"]:
        dest = out / w["file"]
        if not (dest.is_file() and dest.stat().st_size == w["size"] and sha256(dest) == w["sha256"]):
            missing = [
                p["call"] for p in w["parts"] if not (stash / "parts" / Path(p["file"]).name).is_file()
            ]
            if missing:
                raise Refused(f"{w['file']}: parts of calls {sorted(set(missing))} not received yet")
            with open(dest, "wb") as f:
                for p in w["parts"]:
                    with open(stash / "parts" / Path(p["file"]).name, "rb") as src:
                        shutil.copyfileobj(src, f, 1 << 22)
            if sha256(dest) != w["sha256"]:
                dest.unlink()
                raise Refused(f"{w['file']}: the joined wheel's sha256 is not the manifest's: refused")
        joined.append(dest)
    return joined


def pip_install(wheels: list[Path], target: Path) -> float:
    t0 = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--disable-pip-version-check",
        "--target",
        str(target),
        *map(str, wheels),
    ]
    subprocess.run(cmd, check=True)
    return time.monotonic() - t0


def lay_out_steptap(site: Path, repo: Path = ROOT) -> None:
    """steptap from this working tree into ``site`` without a build backend: ``steptap.<pkg>`` links to the
    folders pyproject.toml maps, and a dist-info with its entry points (the env registry reads them)."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())
    (site / "steptap").mkdir(parents=True, exist_ok=True)
    for pkg, folder in project["tool"]["setuptools"]["package-dir"].items():
        link = site / pkg.replace(".", "/")
        if link.is_symlink() or link.exists():
            link.unlink() if link.is_symlink() else shutil.rmtree(link)
        link.symlink_to(repo / folder, target_is_directory=True)
    meta = project["project"]
    dist = site / f"steptap-{meta['version']}.dist-info"
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: steptap\nVersion: {meta['version']}\n")
    groups = {"console_scripts": meta.get("scripts", {}), **meta.get("entry-points", {})}
    (dist / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n"
            for group, items in groups.items()
        )
    )
    (dist / "INSTALLER").write_text("device_unpack\n")
    (site / "bin").mkdir(exist_ok=True)
    script = site / "bin" / "steptap"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} -m steptap.middleware.cli "$@"\n')
    script.chmod(0o755)


def lay_out_vllm_env(env: Path, vllm_site: Path, learner_site: Path) -> str | None:
    """What ``steptap vllm`` takes for vLLM's virtualenv: ``bin/python`` runs this interpreter with
    ``vllm_site`` alone added (the learner's older transformers never reaches vLLM), steptap's vLLM plugin
    laid out in ``vllm_site``, and the markers ``launch/vllm_venv.py`` and ``launch/plugin.py`` read. Returns
    why this vLLM does not take steptap's transfer engine (None when it does)."""
    sys.path.insert(0, str(learner_site))
    from steptap.middleware.launch import plugin, vllm_venv

    (env / "bin").mkdir(parents=True, exist_ok=True)
    python = env / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={vllm_site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    for src in plugin.PLUGIN_DIR.glob("*.py"):
        shutil.copy(src, vllm_site / src.name)
    project = tomllib.loads((plugin.PLUGIN_DIR / "pyproject.toml").read_text())["project"]
    dist = vllm_site / f"steptap_vllm_plugin-{project['version']}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    (dist / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n"
            for group, items in project["entry-points"].items()
        )
    )
    probe = subprocess.run([str(python), "-c", plugin.PROBE], capture_output=True, text=True, check=False)
    why = "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["probe failed"])[-1]
    (env / plugin.MARKER).write_text(f"{plugin.plugin_hash()}\n{why}\n")
    (env / vllm_venv.MARKER).write_text("device_unpack\n")
    return why or None


def install(stash: Path, prefix: Path) -> dict:
    t0 = time.monotonic()
    manifest = load(stash / MANIFEST)
    wheels = join(stash)
    joined_s = time.monotonic() - t0
    by_name = {w.name: w for w in wheels}
    seconds = {}
    for name in manifest["sets"]:
        seconds[name] = round(
            pip_install(
                [by_name[w["file"]] for w in manifest["wheels"] if name in w["sets"]], prefix / f"{name}-site"
            ),
            1,
        )
    out: dict = {"joined_s": round(joined_s, 1), "pip_s": seconds}
    if "learner" in manifest["sets"]:
        lay_out_steptap(prefix / "learner-site")
        if "vllm" in manifest["sets"]:
            why = lay_out_vllm_env(prefix / "vllm-env", prefix / "vllm-site", prefix / "learner-site")
            out["transfer_engine"] = why or "taken"
    return out


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
        return p.returncode, (p.stdout + p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, repr(exc)


def static_routes(site: Path) -> dict[str, bool]:
    """Which of steptap's routes the installed vLLM's sources declare (the live server's /openapi.json is
    the word: the proxy reads it at start-up)."""
    found = set()
    for f in (site / "vllm" / "entrypoints").rglob("*.py"):
        text = f.read_text(errors="replace")
        found |= set(re.findall(r'@(?:router|app)\.(?:get|post)\(\s*"(/[^"]*)"', text))
    return {r: r in found for r in ROUTES}


def image_checks(manifest: dict) -> list[dict]:
    """The packages each set expects on the image, against what is installed here."""
    from importlib import metadata

    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # the image lists packaging; without it only presence is checked
        SpecifierSet = None  # noqa: N806
    out = []
    for set_name, s in manifest["sets"].items():
        for e in s["on_image"]:
            try:
                have: str | None = metadata.version(e["name"])
            except metadata.PackageNotFoundError:
                have = None
            ok = have is not None and (
                SpecifierSet is None
                or not e["spec"]
                or SpecifierSet(e["spec"]).contains(have, prereleases=True)
            )
            if not ok:
                out.append({"set": set_name, "name": e["name"], "needs": e["spec"], "has": have})
    return out


def report(stash: Path, prefix: Path) -> dict:
    manifest = load(stash / MANIFEST)
    vllm_site, learner_site = prefix / "vllm-site", prefix / "learner-site"
    out: dict = {"python": sys.version.split()[0]}
    code, text = run(
        [
            sys.executable,
            "-c",
            "import torch, json; print(json.dumps([torch.__version__, "
            "torch.version.cuda, torch.cuda.is_available(), torch.cuda.is_available() and "
            "torch.cuda.get_device_name(0)]))",
        ]
    )
    out["torch"] = json.loads(text.splitlines()[-1]) if code == 0 else text[-500:]
    env = dict(os.environ, PYTHONPATH=str(vllm_site))
    if (vllm_site / "bin" / "vllm").exists():
        code, text = run([sys.executable, str(vllm_site / "bin" / "vllm"), "--version"], env)
        out["vllm_version"] = text.splitlines()[-1] if text else f"exit {code}"
        kernels = "import torch, vllm, vllm._C_stable_libtorch; print('ok')"
        code, text = run([sys.executable, "-c", kernels], env)
        out["vllm_kernels_import"] = "ok" if code == 0 else text[-800:]
        out["routes"] = static_routes(vllm_site)
    if learner_site.exists():
        code, text = run(
            [
                sys.executable,
                "-c",
                "import verl, transformers, steptap.learner.daemon; "
                "print(verl.__version__, transformers.__version__)",
            ],
            dict(os.environ, PYTHONPATH=str(learner_site)),
        )
        out["learner_import"] = text.splitlines()[-1] if code == 0 else text[-800:]
    out["image_mismatches"] = image_checks(manifest)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["receive", "install", "report"])
    ap.add_argument("folder", nargs="?", help="receive: the call's folder (.devpack/calls/NN)")
    ap.add_argument("--stash", default=os.environ.get("STEPTAP_DEVPACK", "/tmp/steptap-devpack"))
    ap.add_argument("--prefix", default=None, help="where the sets are installed (default: STASH/install)")
    ap.add_argument("--report", action="store_true", help="install: report afterwards")
    a = ap.parse_args()
    stash = Path(a.stash)
    prefix = Path(a.prefix) if a.prefix else stash / "install"
    result: dict = {}
    try:
        if a.what == "receive":
            if not a.folder:
                ap.error("receive needs the call's folder")
            result = receive(Path(a.folder), stash)
            print(
                f"call {result['call']}: {result['parts']} parts, {result['mib']} MiB verified; "
                f"{result['have']} of {result['of']} parts here; calls left: {result['calls_left'] or 'none'}"
            )
        if a.what == "install":
            result = install(stash, prefix)
            print(f"installed under {prefix}: {json.dumps(result)}")
        if a.what == "report" or a.report:
            result = {**result, "report": report(stash, prefix)} if result else report(stash, prefix)
            print(json.dumps(result, indent=1))
    except Refused as exc:
        print(f"device_unpack: REFUSED: {exc}", file=sys.stderr)
        return 1
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"device_{a.what}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
