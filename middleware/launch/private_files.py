"""Files and directories that hold secrets or prompts: directories 0700, files 0600, whatever mode they had.

The control token, the trajectory log (prompts, session keys) and the component logs are readable by whoever
can read the files, so `steptap up` makes them private to the user that runs it. A file that already existed
keeps its old mode under a plain ``open(..., "w")``; these helpers set the mode every time. Directories are
another matter: one that exists is the user's (``/tmp``, ``/run``, the working directory) and keeps its mode;
only what steptap creates is made private, and a secret is refused in a directory others may write.
"""

from __future__ import annotations

import os
from pathlib import Path

from steptap.middleware.files import atomic_write


def write_private(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a 0600 file atomically and durably (the mode is set before any byte is written)."""
    atomic_write(path, text, mode=0o600)
    return Path(path)


def open_private_log(path: str | os.PathLike[str]) -> int:
    """A file descriptor appending to a 0600 log (created or re-moded); the caller closes it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return fd

