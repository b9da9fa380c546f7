"""Harbor's own virtualenv (``steptap tasks install-harbor``, adapters/tasks/containers.py): where the tests
read steptap's Harbor formats with Harbor's code (tests/harbor_check.py). Missing: a skip, a failure under
CI=true."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from conftest import missing  # a failure under CI, a skip on a dev machine

from steptap.adapters.tasks import containers

CHECK = Path(__file__).with_name("harbor_check.py")


def harbor_python() -> Path:
    try:
        return containers.harbor_python()
    except containers.HarborError as exc:
        missing(str(exc))


def harbor_check(command: str, *args: str | Path) -> dict[str, Any]:
    """``harbor_check.py COMMAND ARGS`` in Harbor's venv: its summary, or the test fails with its reasons."""
    run = subprocess.run([str(harbor_python()), str(CHECK), command, *map(str, args)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    summary: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return summary
