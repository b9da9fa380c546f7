"""/app/backup.sh run (in its own bash, on fresh directories in /tmp) on names with spaces and on a source
without .txt files: DEST_DIR holds exactly the expected copies."""

import os
import stat
import subprocess
import sys
import tempfile
import time

SOURCE = {
    "plain.txt": "plain\n",
    "two words.txt": "with a space\n",
    "  lead and trail .txt": "spaces around\n",
    "notes.md": "not a text file\n",
    "archive.txt.gz": "not .txt either\n",
}

MAX_BYTES = 1 << 20

DEADLINE = time.monotonic() + 20  # every command together, well inside the verifier's 30 s


def _left() -> float:
    return max(0.1, DEADLINE - time.monotonic())


def _read(path: str) -> bytes:
    """``path``'s bytes. It must be a regular file of at most 1 MiB: a link, a FIFO or a device left there
    fails the check rather than hang the verifier (a hung verifier is an infrastructure error, not a 0)."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES, f"{path}: not a regular file of <= 1 MiB"
    with open(path, "rb") as f:
        return f.read(MAX_BYTES + 1)


def _run(src: str, dest: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/bash", "/app/backup.sh", src, dest], capture_output=True, text=True,
                          timeout=_left(), cwd="/tmp")


def _tree(path: str) -> dict[str, str]:
    """Each file of ``path`` (a directory) by name, with its text."""
    out = {}
    for name in os.listdir(path):
        out[name] = _read(os.path.join(path, name)).decode()
    return out


def test_names_with_spaces_are_copied() -> None:
    with tempfile.TemporaryDirectory(prefix="backup test ") as tmp:
        src, dest = os.path.join(tmp, "my files"), os.path.join(tmp, "backup dir", "today")
        os.makedirs(os.path.join(src, "sub dir.txt"))  # a directory is not a file to copy
        for name, text in SOURCE.items():
            with open(os.path.join(src, name), "w", encoding="utf-8") as f:
                f.write(text)
        run = _run(src, dest)
        assert run.returncode == 0, run.stderr
        assert _tree(dest) == {n + ".bak": t for n, t in SOURCE.items() if n.endswith(".txt")}
        os.rmdir(os.path.join(src, "sub dir.txt"))
        assert _tree(src) == SOURCE  # the source is read, never changed


def test_a_source_without_txt_files_gives_an_empty_dest() -> None:
    with tempfile.TemporaryDirectory(prefix="backup test ") as tmp:
        src, dest = os.path.join(tmp, "empty src"), os.path.join(tmp, "out dir")
        os.makedirs(src)
        with open(os.path.join(src, "readme.md"), "w", encoding="utf-8") as f:
            f.write("no text files here\n")
        run = _run(src, dest)
        assert (run.returncode, run.stdout, run.stderr) == (0, "", "")
        assert os.path.isdir(dest) and os.listdir(dest) == []


def _main() -> int:
    """Runs the test_ functions in order, stopping at the first failure (the file also runs under pytest,
    where there is one)."""
    for name, test in list(globals().items()):
        if name.startswith("test_") and callable(test):
            try:
                test()
            except Exception as exc:  # a failed assertion, an output that cannot be read, a timeout
                print(f"FAILED {name}: {exc!r}")
                return 1
            print(f"passed {name}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
