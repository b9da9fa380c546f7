"""The durable-write helpers: atomic replace with the right mode, durable directory creation."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from steptap.middleware import files


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_atomic_write_replaces_contents_and_mode(tmp_path: Path) -> None:
    path = tmp_path / "cursor.json"
    path.write_text("old")
    os.chmod(path, 0o644)  # an existing file keeps no looser mode than asked
    files.atomic_write(path, '{"cursor": "1:8"}')
    assert path.read_text() == '{"cursor": "1:8"}' and _mode(path) == 0o600
    files.atomic_write(path, b"\x00\x01", mode=0o640)
    assert path.read_bytes() == b"\x00\x01" and _mode(path) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cursor.json"]  # no temporary file left behind


def test_a_failed_atomic_write_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    files.atomic_write(path, "old")

    def fail(fd: int, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_all", fail)
    with pytest.raises(OSError):
        files.atomic_write(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_makedirs_creates_missing_parents_private(tmp_path: Path) -> None:
    d = files.makedirs(tmp_path / "a" / "b" / "c")
    assert d.is_dir() and all(_mode(p) == 0o700 for p in (tmp_path / "a", tmp_path / "a" / "b", d))
    assert files.makedirs(d) == d  # existing: fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        files.makedirs(tmp_path / "file")


def test_append_durable(tmp_path: Path) -> None:
    path = tmp_path / "seen"
    files.append_durable(path, "a\n")
    files.append_durable(path, b"b\n")
    assert path.read_text() == "a\nb\n" and _mode(path) == 0o600


@pytest.mark.parametrize("per_write_sync", [True, False])
def test_positioned_durable_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   per_write_sync: bool) -> None:
    """``write_all(fd, data, offset, dsync=True)``: the bytes land at ``offset`` (the file position is not
    used) and are synced, by the write itself (RWF_DSYNC) or, where that is missing, by a datasync after
    it."""
    import os

    synced: list[int] = []
    real = files.datasync
    monkeypatch.setattr(files, "datasync", lambda fd: (synced.append(fd), real(fd)))
    if not per_write_sync:
        monkeypatch.setattr(files, "_RWF_DSYNC", 0)
    path = tmp_path / "seg"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        files.write_all(fd, b"head", 0)
        files.write_all(fd, memoryview(b"xxTAILxx")[2:6], 4, dsync=True)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
    finally:
        os.close(fd)
    assert path.read_bytes() == b"headTAIL"
    # one datasync where the write could not sync itself, none where it did
    assert synced == ([] if per_write_sync and files._RWF_DSYNC else [fd])


def test_atomic_write_never_follows_a_planted_temp_name(tmp_path: Path) -> None:
    """Issue 25 (lows): the temp name was predictable (``.NAME.tmp-PID``) and opened without
    O_EXCL|O_NOFOLLOW: a symlink planted there made the write land in (and truncate) the file it points to."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "f"
    (tmp_path / f".f.tmp-{os.getpid()}").symlink_to(victim)
    files.atomic_write(target, "new")
    assert victim.read_text() == "keep me" and target.read_text() == "new" and not target.is_symlink()


def test_replace_dir_moves_a_complete_directory_into_place_or_leaves_the_old(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("old")

    def broken(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.replace_dir(out, broken)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary folder left beside it
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    files.replace_dir(out, lambda tmp: (tmp / "config.json").write_text("{}"))
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
