"""/app/docs.tar.gz is a gzip tar whose files are exactly the docs the task shipped, under docs/ (their
hashes below). The archive is only read, never extracted."""

import hashlib
import io
import os
import stat
import sys
import tarfile

EXPECTED = {
    "docs/api/items.md": "abcca7f678fa0f6ae32f32142438f07b677cab48f44b25f87db9590a61fdb0fe",
    "docs/guides/install.md": "e861ac4f882592bdf6e27e17d944fa1dc7bc049c7c98b035e9221b4d465e013e",
    "docs/guides/upgrade.md": "72b2ec6f565e0de8a15266eda38b32dd6e7467677e131453e47d9d24d340e33c",
    "docs/index.md": "0c98b8a0a24a50aa9b5e78b91a9dc5e8fe805f3ee34a00204a920212cab51330",
}

MAX_BYTES = 1 << 20


def _read(path: str) -> bytes:
    """``path``'s bytes. It must be a regular file of at most 1 MiB: a link, a FIFO or a device left there
    fails the check rather than hang the verifier (a hung verifier is an infrastructure error, not a 0)."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES, f"{path}: not a regular file of <= 1 MiB"
    with open(path, "rb") as f:
        return f.read(MAX_BYTES + 1)


def test_the_archive_holds_exactly_the_docs() -> None:
    found = {}
    with tarfile.open(fileobj=io.BytesIO(_read("/app/docs.tar.gz")), mode="r:gz") as archive:
        for member in archive.getmembers():
            assert member.isfile() or member.isdir(), f"{member.name} is neither a file nor a directory"
            assert member.size <= MAX_BYTES, f"{member.name} is too large"
            assert member.name == "docs" or member.name.startswith("docs/"), member.name
            if member.isfile():
                data = archive.extractfile(member)
                assert data is not None
                found[member.name] = hashlib.sha256(data.read()).hexdigest()
    assert found == EXPECTED


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
