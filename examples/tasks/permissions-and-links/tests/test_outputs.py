"""The modes and the link of /app/release are exactly as asked, and the two files keep the contents the task
shipped (their hashes below)."""

import hashlib
import os
import stat
import sys

ROOT = "/app/release"
CONTENT = {
    "bin/run.sh": "1aff66f9df434e6186098d84e4547e609547a4c9b040b1a12fe5f18804430e60",
    "config/secret.env": "6132f0ac017ff74b90a72793ca6102f52c6d5f32b169b85ac1e67c16c2117251",
}

MAX_BYTES = 1 << 20


def _read(path: str) -> bytes:
    """``path``'s bytes. It must be a regular file of at most 1 MiB: a link, a FIFO or a device left there
    fails the check rather than hang the verifier (a hung verifier is an infrastructure error, not a 0)."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES, f"{path}: not a regular file of <= 1 MiB"
    with open(path, "rb") as f:
        return f.read(MAX_BYTES + 1)


def _regular(path: str) -> os.stat_result:
    st = os.lstat(os.path.join(ROOT, path))
    assert stat.S_ISREG(st.st_mode), f"{path} is not a regular file"
    return st


def test_run_sh_is_mode_755() -> None:
    assert stat.S_IMODE(_regular("bin/run.sh").st_mode) == 0o755


def test_secret_env_is_mode_600() -> None:
    assert stat.S_IMODE(_regular("config/secret.env").st_mode) == 0o600


def test_current_is_a_relative_link_to_v2() -> None:
    assert os.readlink(os.path.join(ROOT, "current")) == "releases/v2"
    assert os.path.isdir(os.path.join(ROOT, "releases/v2"))


def test_the_contents_are_unchanged() -> None:
    for path, digest in CONTENT.items():
        assert hashlib.sha256(_read(os.path.join(ROOT, path))).hexdigest() == digest, path


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
