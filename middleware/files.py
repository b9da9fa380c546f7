"""Durable file writes, in one place: atomic replace, directory sync, durable directory creation.

A rename is atomic but not durable until the directory holding the new name is synced, and a file's data is
not durable until the file is synced before the rename (else a crash can leave the new name on empty or
partial contents). ``atomic_write`` does all four steps. Files default to mode 0600 and new directories to
0700: what steptap writes holds prompts, session keys and tokens.

Light on purpose (stdlib only): the proxy, the learner and ``steptap up`` all use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700

StrPath = str | os.PathLike[str]


def cache_root() -> Path:
    """steptap's per-user cache (the vLLM virtualenv, the agent CLIs, server logs):
    $XDG_CACHE_HOME/steptap."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "steptap"


def datasync(fd: int) -> None:
    """``fdatasync`` where the platform has it (the file's data and the metadata needed to read it back)."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def fsync_path(path: StrPath) -> None:
    """Sync a file or a directory (a new, renamed or removed entry) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# pwritev2's per-write O_DSYNC (Linux 4.7+): the write and its fdatasync in one call. 0 where it is missing
# (or found unsupported at the first try): a write is then followed by ``datasync``.
_RWF_DSYNC = getattr(os, "RWF_DSYNC", 0) if hasattr(os, "pwritev") else 0


def write_all(fd: int, data: bytes | memoryview, offset: int | None = None, dsync: bool = False) -> None:
    """``os.write`` until every byte is written (a short write is legal). With ``offset``: positioned writes
    from there (the file position is not used). With ``dsync``: durable when it returns, as if followed by
    ``datasync``; where the platform can, each write is synced by the same system call (``RWF_DSYNC``): one
    call instead of two, and a writer thread takes the GIL back once instead of twice."""
    global _RWF_DSYNC
    view = memoryview(data)
    if offset is None:
        while view:
            n = os.write(fd, view)
            view = view[n:]
    else:
        while view:
            flags = _RWF_DSYNC if dsync else 0
            if flags:
                try:
                    n = os.pwritev(fd, [view], offset, flags)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                        raise
                    _RWF_DSYNC = 0  # this kernel or filesystem has no per-write sync: write, then datasync
                    continue
            else:
                n = os.pwrite(fd, view, offset)
            offset += n
            view = view[n:]
        if dsync and _RWF_DSYNC:
            return
    if dsync:
        datasync(fd)


def makedirs(path: StrPath, mode: int = DIR_MODE) -> Path:
    """Create ``path`` and any missing parents, durably: each new directory's entry is synced in its parent,
    so a crash cannot lose a directory that files were already synced into."""
    path = Path(path)
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:  # created concurrently
            continue
        fsync_path(d.parent)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    return path


def private_dir(path: StrPath) -> Path:
    """``makedirs`` with every directory it creates 0700 (durable; the mode set past the umask). A directory
    that already exists is the user's (``/tmp``, ``/run``, the working directory) and keeps its mode: a secret
    in one goes through ``secret_dir``."""
    path = Path(path)
    new = [p for p in (path, *path.parents) if not p.exists()]
    makedirs(path)
    for d in new:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(d, DIR_MODE)  # mkdir's mode is filtered by the umask
    return path


class PrivateDirError(ValueError):
    """A directory that may not hold a secret (its message says why and what to do)."""


def secret_dir(path: StrPath) -> Path:
    """``private_dir``, for a directory that holds a secret (a token, a socket): refused when another user
    (root aside) owns it or others may write it, since they could swap, remove or plant the file."""
    d = private_dir(path)
    st = d.stat()
    if st.st_mode & 0o022:
        raise PrivateDirError(f"{d} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): a secret "
                              "there could be swapped or planted; use a directory only you can write")
    if st.st_uid not in (os.getuid(), 0):  # root's own directories (/etc, /run) are as safe as root is
        raise PrivateDirError(f"{d} belongs to another user: keep secrets in a directory of your own")
    return d


def atomic_write(path: StrPath, data: bytes | str, *, mode: int = FILE_MODE, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old contents or the new, never part of
    either. With ``durable`` (the default) the new contents survive a crash once this returns: the temporary
    file is synced before the rename and the directory after it. The file gets ``mode`` even when it
    replaces one with another mode."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    # A fresh unpredictable name, created here or not at all: in a shared directory a planted file or symlink
    # at a guessable name would otherwise take the write.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        try:
            os.fchmod(fd, mode)  # O_CREAT's mode is filtered by the umask
            write_all(fd, payload)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_path(path.parent)


def append_durable(path: StrPath, data: bytes | str, *, mode: int = FILE_MODE) -> None:
    """Append ``data`` to ``path`` (created with ``mode``) and sync it; a new file's entry is synced too."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
    try:
        write_all(fd, payload)
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_path(path.parent)


def sync_tree(path: StrPath) -> None:
    """Sync every regular file directly in directory ``path``, then the directory (before renaming it into
    place: a published directory must not appear with unsynced contents)."""
    root = Path(path)
    for f in root.iterdir():
        if f.is_file() and not f.is_symlink():
            fsync_path(f)
    fsync_path(root)


def replace_dir(path: StrPath, fill: Callable[[Path], None]) -> Path:
    """``path`` replaced by a directory that ``fill(tmp)`` writes beside it, moved into place only once
    complete: an interrupted write (a model conversion or export) never leaves a half-written directory
    that looks whole."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        fill(tmp)
        sync_tree(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


__all__ = [
    "DIR_MODE", "FILE_MODE", "append_durable", "atomic_write", "datasync", "fsync_path", "makedirs",
    "private_dir", "replace_dir", "sync_tree",
    "write_all",
]
