"""Harbor's own virtualenv (scripts/install_harbor.sh): where the tests read steptap's Harbor formats with
Harbor's code (tests/harbor_check.py). Missing: a skip, a failure under CI=true."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from steptap.middleware.files import cache_root

CHECK = Path(__file__).with_name("harbor_check.py")


def harbor_python() -> Path:
    python = cache_root() / "harbor" / "bin" / "python"
    if not (cache_root() / "harbor" / ".steptap-stamp").is_file() or not python.is_file():
        message = f"Harbor's virtualenv is missing ({python.parent.parent}): bash scripts/install_harbor.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return python


def harbor_check(command: str, *args: str | Path) -> dict[str, Any]:
    """``harbor_check.py COMMAND ARGS`` in Harbor's venv: its summary, or the test fails with its reasons."""
    run = subprocess.run([str(harbor_python()), str(CHECK), command, *map(str, args)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    summary: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return summary
