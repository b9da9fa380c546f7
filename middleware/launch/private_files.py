"""Files and directories that hold secrets or prompts: directories 0700, files 0600, whatever mode they had.

The control token, the trajectory log (prompts, session keys) and the component logs are readable by whoever
can read the files, so `steptap up` makes them private to the user that runs it. A file that already existed
keeps its old mode under a plain ``open(..., "w")``; these helpers set the mode every time. Directories are
another matter: one that exists is the user's (``/tmp``, ``/run``, the working directory) and keeps its mode;
only what steptap creates is made private, and a secret is refused in a directory others may write.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from steptap.middleware.files import atomic_write


class PrivateDirError(ValueError):
    """A directory that may not hold a secret (its message says why and what to do)."""


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and its missing parents 0700; a directory that already exists keeps its mode."""
    d = Path(path)
    missing = [p for p in (d, *d.parents) if not p.exists()]
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by someone else: theirs, left as it is
            continue
        os.chmod(p, 0o700)  # mkdir's mode is filtered by the umask
    return d


def secret_dir(path: str | os.PathLike[str]) -> Path:
    """``private_dir``, for a directory that holds a secret (a token, a socket): refused when another user
    (root aside) owns it or others may write it, since they could swap, remove or plant the file."""
    d = private_dir(path)
    st = d.stat()
    if st.st_mode & 0o022:
        raise PrivateDirError(f"{d} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): a secret there "
                              "could be swapped or planted; use a directory only you can write")
    if st.st_uid not in (os.getuid(), 0):  # root's own directories (/etc, /run) are as safe as root is
        raise PrivateDirError(f"{d} belongs to another user: keep secrets in a directory of your own")
    return d


def write_private(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a 0600 file atomically and durably (the mode is set before any byte is written)."""
    atomic_write(path, text, mode=0o600)
    return Path(path)


def open_private_log(path: str | os.PathLike[str]) -> int:
    """A file descriptor appending to a 0600 log (created or re-moded); the caller closes it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in a file (first line, stripped); ``ValueError`` when it is empty."""
    token = Path(path).read_text().strip().splitlines()[0:1]
    if not token or not token[0].strip():
        raise ValueError(f"{path}: empty token file")
    return token[0].strip()
