"""/app/backup.sh run (in its own bash, on fresh directories in /tmp) on names with spaces and on a source
without .txt files: DEST_DIR holds exactly the expected copies."""

import os
import subprocess
import sys
import tempfile

SOURCE = {
    "plain.txt": "plain\n",
    "two words.txt": "with a space\n",
    "  lead and trail .txt": "spaces around\n",
    "notes.md": "not a text file\n",
    "archive.txt.gz": "not .txt either\n",
}


def _run(src: str, dest: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/bash", "/app/backup.sh", src, dest], capture_output=True, text=True,
                          timeout=20, cwd="/tmp")


def _tree(path: str) -> dict[str, str]:
    """Each file of ``path`` (a directory) by name, with its text."""
    out = {}
    for name in os.listdir(path):
        with open(os.path.join(path, name), encoding="utf-8") as f:
            out[name] = f.read()
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
        assert run.returncode == 0, run.stderr
        assert os.path.isdir(dest) and os.listdir(dest) == []


def _main() -> int:
    """Runs every test_ function (the file also runs under pytest, where there is one)."""
    failed = 0
    for name, test in list(globals().items()):
        if name.startswith("test_") and callable(test):
            try:
                test()
            except Exception as exc:  # a failed assertion, or an output that cannot be read
                failed += 1
                print(f"FAILED {name}: {exc!r}")
            else:
                print(f"passed {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main())
