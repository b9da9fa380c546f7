"""Private directories and secret files (issue 25, item 9): steptap makes private only the directories it
creates (``--uds /run/vllm.sock``, ``--log ./vllm.log`` and ``--control-token-file /tmp/tok`` re-moded /run,
the working directory and /tmp to 0700), and it refuses to keep a secret in a directory others may write (they
could swap or plant the file). Real files and modes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from steptap.middleware.files import PrivateDirError, private_dir, secret_dir

STEPTAP = [sys.executable, "-m", "steptap.middleware.cli"]


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_private_dir_makes_private_only_what_it_creates(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    assert private_dir(shared) == shared and _mode(shared) == 0o755  # existing: left as it is
    new = private_dir(shared / "a" / "b")
    assert _mode(shared) == 0o755 and _mode(shared / "a") == 0o700 and _mode(new) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_secret_is_refused_in_a_directory_others_may_write(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(PrivateDirError, match="writable by others"):
        secret_dir(d)
    assert _mode(d) == mode
    assert secret_dir(tmp_path / "mine") == tmp_path / "mine" and _mode(tmp_path / "mine") == 0o700


def test_serve_refuses_a_token_file_in_a_world_writable_directory(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    out = subprocess.run([*STEPTAP, "serve", "--backend", "http://127.0.0.1:9", "--port", "0", "--log",
                          str(tmp_path / "log"), "--control-token-file", str(d / "tok")],
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "STEPTAP_CONTROL_TOKEN"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "writable by others" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not (d / "tok").exists() and _mode(d) == 0o777


def test_serve_refuses_to_adopt_a_token_file_planted_in_a_shared_directory(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    (d / "tok").write_text("planted-by-someone-else\n")
    out = subprocess.run([*STEPTAP, "serve", "--backend", "http://127.0.0.1:9", "--port", "0", "--log",
                          str(tmp_path / "log"), "--control-token-file", str(d / "tok")],
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "STEPTAP_CONTROL_TOKEN"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "writable by others" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_up_refuses_to_adopt_a_token_file_planted_in_a_shared_directory(tmp_path: Path) -> None:
    """Issue 25 (lows): ``steptap up`` adopted an existing token file wherever it was; one planted in a
    directory others may write is refused before anything starts, and its content is never used."""
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    (d / "tok").write_text("planted-by-someone-else\n")
    workdir = tmp_path / "up"
    out = subprocess.run([*STEPTAP, "up", "--backend", "http://127.0.0.1:9", "--no-learner", "--no-view",
                          "--port", "0", "--workdir", str(workdir), "--control-token-file", str(d / "tok")],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "STEPTAP_CONTROL_TOKEN"})
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "writable by others" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not (workdir / "logs" / "serve.log").exists()  # nothing was started
    assert (d / "tok").read_text() == "planted-by-someone-else\n"
