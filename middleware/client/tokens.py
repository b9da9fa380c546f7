"""The control token: its environment variables, its 0600 file, and the default a client takes."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

TOKEN_ENV = "STEPTAP_CONTROL_TOKEN"
# A 0600 file holding it (how `steptap up` hands it to a driver)
TOKEN_FILE_ENV = "STEPTAP_CONTROL_TOKEN_FILE"


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in a file: its first line, stripped. ``ValueError`` when the file is empty or unreadable (a
    token file with no token is a mistake to report, never the same as no file)."""
    try:
        lines = Path(path).read_text().strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the token ({exc})") from exc
    if not lines or not lines[0].strip():
        raise ValueError(f"{path}: empty token file")
    return lines[0].strip()


def forget_control_token() -> None:
    """Take the control token (and the name of its file) out of this process's reach once read: every process
    started from here (an agent, a tool, a grader) would inherit it, and with it the power to post its own
    rewards. Out of the environment children inherit (``os.environ``); out of the process's initial
    environment block too, which ``/proc/PID/environ`` shows whatever the environment became since (its
    bytes overwritten in place); and the process made undumpable (``PR_SET_DUMPABLE``), so another process of
    the same user (not root) cannot read its memory or ``/proc/PID/environ`` at all."""
    names = [name for name in (TOKEN_ENV, TOKEN_FILE_ENV) if os.environ.pop(name, None) is not None]
    if sys.platform.startswith("linux"):
        _scrub_initial_environment(names)
        _undumpable()


def _scrub_initial_environment(names: list[str]) -> None:
    """Overwrite the values of ``names`` in the environment block the kernel placed at the top of the stack
    (``/proc/self/stat``'s ``env_start``..``env_end``; what setproctitle writes over too): C's ``environ`` no
    longer points at them (``os.environ.pop`` unset them), so nothing reads these bytes again."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51 of stat(5)
    except (OSError, IndexError, ValueError):
        return
    if not 0 < start < end:
        return
    block = ctypes.string_at(start, end - start)
    offset = 0
    for entry in block.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and value and name.decode(errors="replace") in names:
            ctypes.memset(start + offset + len(name) + 1, 0, len(value))
        offset += len(entry) + 1


def _undumpable() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


_PR_SET_DUMPABLE = 4


def default_control_token() -> str | None:
    """The control token from ``$STEPTAP_CONTROL_TOKEN``, else from the file ``$STEPTAP_CONTROL_TOKEN_FILE``
    names (``read_token_file``), else None."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV)
    if not path:
        return None
    try:
        return read_token_file(path)
    except ValueError as exc:
        raise ValueError(f"${TOKEN_FILE_ENV}={exc}") from None
