"""The control token: its environment variables, its 0600 file, and the default a client takes."""

from __future__ import annotations

import os
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
    """Take the control token (and the name of its file) out of this process's environment once read: every
    process started from here (an agent, a tool, a grader) would inherit it, and with it the power to post
    its own rewards."""
    os.environ.pop(TOKEN_ENV, None)
    os.environ.pop(TOKEN_FILE_ENV, None)


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
