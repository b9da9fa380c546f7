"""Carrying wheels to the GPU device in parts (scripts/device_pack.py here, scripts/device_unpack.py there),
on a real wheel set: torch 2.13.0's CPU wheel (183 MiB, over one call) and typing-extensions, resolved against
an image list that has torch's other dependencies. Packed once per session (pip takes the torch wheel from
this machine's disk), cut into calls of 60 MiB, each call folder received as the device receives it, joined
byte for byte, installed into a target folder and imported from there; a part with a wrong hash is refused.
These are the scripts the device runs; only the interpreter differs (this machine's Python 3.11 here, cp311
wheels).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import missing  # a failure under CI, a skip on a dev machine

ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / "scripts" / "device_pack.py"
UNPACK = ROOT / "scripts" / "device_unpack.py"
MIB = 1 << 20
TORCH = "torch==2.13.0+cpu"  # the CPU wheel this machine keeps on disk (pip finds it there, in seconds)
# what the test's "image" has: torch's other dependencies, all in the project's venv
IMAGE = ["filelock", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "setuptools"]


@dataclass
class Pack:
    out: Path
    manifest: dict
    plan: str


@pytest.fixture(scope="session")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Pack:
    out = tmp_path_factory.mktemp("devpack")
    image = out / "image.txt"
    image.write_text("# a test image\n" + "\n".join(IMAGE) + "\n")
    run = subprocess.run(
        [
            sys.executable,
            str(PACK),
            "--out",
            str(out / "pack"),
            "--image",
            str(image),
            "--python",
            f"{sys.version_info.major}.{sys.version_info.minor}",
            "--set",
            f"probe={TORCH},typing-extensions",
            "--call-mib",
            "60",
            "--repo-bytes",
            str(3 * MIB),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        missing(f"device_pack could not pack {TORCH} here:\n{run.stderr[-3000:]}")
    return Pack(out / "pack", json.loads((out / "pack" / "manifest.json").read_text()), run.stdout)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unpack(*args: str, stash: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(UNPACK), *args, "--stash", str(stash)],
        capture_output=True,
        text=True,
        check=False,
    )


def carried(pack: Pack, call: dict, device: Path) -> Path:
    """The call's folder as a call leaves it on the device: a copy of what was carried."""
    dest = device / ".devpack" / call["folder"]
    shutil.copytree(pack.out / call["folder"], dest)
    return dest


def test_the_plan_cuts_a_wheel_over_a_call_into_the_fewest_calls(pack: Pack) -> None:
    m = pack.manifest
    names = sorted(w["name"] for w in m["wheels"])
    assert names == ["torch", "typing-extensions"]  # the image's packages are not carried
    torch = next(w for w in m["wheels"] if w["name"] == "torch")
    assert torch["size"] > 60 * MIB and len(torch["parts"]) > 1
    assert m["capacity"] == 60 * MIB - 3 * MIB - (256 << 10)  # the repository's bytes counted
    total = sum(w["size"] for w in m["wheels"])
    assert len(m["calls"]) == math.ceil(total / m["capacity"])
    assert all(c["bytes"] <= m["capacity"] for c in m["calls"])
    for call in m["calls"]:  # each call folder holds its parts and the manifest, and nothing else
        folder = pack.out / call["folder"]
        parts = {Path(p["file"]).name for w in m["wheels"] for p in w["parts"] if p["call"] == call["call"]}
        assert {f.name for f in folder.iterdir()} == parts | {"manifest.json"}
        assert sum(f.stat().st_size for f in folder.iterdir() if f.name != "manifest.json") == call["bytes"]
    assert f"{len(m['calls'])} calls of <= 60 MiB" in pack.plan
    image = {e["name"]: e for e in m["sets"]["probe"]["on_image"]}
    assert {"filelock", "sympy", "networkx", "jinja2", "fsspec"} <= image.keys()


def test_parts_received_call_by_call_join_byte_for_byte_install_and_import(
    pack: Pack, tmp_path: Path
) -> None:
    stash, device = tmp_path / "stash", tmp_path / "device"
    for call in pack.manifest["calls"]:
        got = unpack("receive", str(carried(pack, call, device)), stash=stash)
        assert got.returncode == 0, got.stderr
        assert f"call {call['call']}:" in got.stdout
        assert not any((device / ".devpack" / call["folder"]).glob("*.part*"))  # moved, not copied
    assert "calls left: none" in got.stdout
    prefix = tmp_path / "install"
    done = subprocess.run(
        [sys.executable, str(UNPACK), "install", "--stash", str(stash), "--prefix", str(prefix)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for w in pack.manifest["wheels"]:
        joined = stash / "wheels" / w["file"]
        original = pack.out / "wheels" / w["file"]
        assert joined.read_bytes() == original.read_bytes()
        assert sha(joined) == w["sha256"]
    site = prefix / "probe-site"
    env = dict(os.environ, PYTHONPATH=str(site))
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, typing_extensions as t; "
            "print(torch.__version__, torch.__file__, t.__file__, float(torch.ones(3).sum()))",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    version, torch_file, te_file, total = probe.stdout.split()
    assert version == "2.13.0+cpu" and total == "3.0"
    assert Path(torch_file).is_relative_to(site) and Path(te_file).is_relative_to(site)


def test_a_part_with_a_wrong_hash_is_refused_and_nothing_of_its_call_kept(pack: Pack, tmp_path: Path) -> None:
    stash, device = tmp_path / "stash", tmp_path / "device"
    call = pack.manifest["calls"][0]
    folder = carried(pack, call, device)
    part = next(folder.glob("*.part*"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed, the size kept
    part.write_bytes(bytes(data))
    got = unpack("receive", str(folder), stash=stash)
    assert got.returncode == 1
    assert "REFUSED" in got.stderr and part.name in got.stderr and "carry it again" in got.stderr
    assert not (stash / "parts").exists() or not any((stash / "parts").iterdir())
    installed = unpack("install", stash=stash)  # nothing to join from: refused, not a stack trace
    assert installed.returncode != 0


def test_steptap_laid_out_from_the_working_tree_has_its_entry_points(tmp_path: Path) -> None:
    site = tmp_path / "site"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import device_unpack as d; "
        "from pathlib import Path; d.lay_out_steptap(Path(sys.argv[2]))"
    )
    subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts"), str(site)], check=True)
    probe = (
        "import sys; from importlib.metadata import entry_points; import steptap.middleware.cli.main as c; "
        "eps = [e for e in entry_points(group='steptap.envs') if str(e.dist._path).startswith(sys.argv[1])]; "
        "print(sorted(e.name for e in eps), c.__file__)"
    )
    got = subprocess.run(
        [sys.executable, "-c", probe, str(site)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(site)),
        cwd=tmp_path,  # not the repo root: its steptap.egg-info (an editable build's) would shadow the site's
        check=True,
    )
    names, cli = got.stdout.rsplit(" ", 1)
    assert "tool_agent" in names and "calculator" in names
    assert Path(cli.strip()).resolve() == (ROOT / "middleware" / "cli" / "main.py").resolve()
    assert (site / "bin" / "steptap").stat().st_mode & 0o111
