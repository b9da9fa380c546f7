"""The distribution and the layering: every module ships in the package mapping, and the proxy side never
imports the ML stack (DESIGN.md, "Layout and layering")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"middleware": "steptap.middleware", "adapters": "steptap.adapters", "learner": "steptap.learner"}
HEAVY = ("torch", "transformers", "ray", "verl", "peft")


def _source_modules() -> list[str]:
    names = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            names.append(".".join([package, *parts]))
    return names


def _run(code: str) -> dict:
    # A fresh interpreter outside the repo root, so only the installed package can be imported.
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_source_module_is_importable_from_the_installed_package() -> None:
    modules = _source_modules()
    assert "steptap.middleware.records" in modules
    result = _run(
        "import importlib, json, sys\n"
        f"mods = {modules!r}\n"
        "files = {m: importlib.import_module(m).__file__ for m in mods}\n"
        "print(json.dumps(files))"
    )
    assert set(result) == set(modules)
    if os.environ.get("STEPTAP_WHEEL_TEST") == "1":
        # scripts/test.sh installed the built wheel: nothing may come from the source folders.
        leaked = {m: f for m, f in result.items() if not f.startswith(sys.prefix)}
        assert not leaked, f"modules imported from outside the installed wheel: {leaked}"


@pytest.mark.parametrize("package", ["steptap.middleware", "steptap.adapters"])
def test_proxy_side_never_imports_the_ml_stack(package: str) -> None:
    folder = next(f for f, p in PACKAGES.items() if p == package)
    modules = [m for m in _source_modules() if m.startswith(package)]
    assert modules, folder
    loaded = _run(
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(h for h in {HEAVY!r} if h in sys.modules)))"
    )
    assert loaded == [], f"{package} imported {loaded}"


def test_cli_lists_every_command_without_the_ml_stack() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from steptap.middleware.cli import main; main(['--help']);"
         f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    for command in ("serve", "vllm", "learn", "up", "run", "tiny-model", "adapters", "plot", "env", "eval", "export"):
        assert f"  {command} " in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"
