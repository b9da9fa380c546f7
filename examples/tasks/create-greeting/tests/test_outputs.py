"""/app/out holds exactly hello.txt, whose content is exactly "Hello, Harbor!" and a newline."""

import os
import stat
import sys

MAX_BYTES = 1 << 20


def _read(path: str) -> bytes:
    """``path``'s bytes. It must be a regular file of at most 1 MiB: a link, a FIFO or a device left there
    fails the check rather than hang the verifier (a hung verifier is an infrastructure error, not a 0)."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES, f"{path}: not a regular file of <= 1 MiB"
    with open(path, "rb") as f:
        return f.read(MAX_BYTES + 1)


def test_out_is_a_directory_holding_only_hello_txt() -> None:
    assert not os.path.islink("/app/out") and os.path.isdir("/app/out")
    assert sorted(os.listdir("/app/out")) == ["hello.txt"]


def test_hello_txt_has_the_exact_line() -> None:
    assert _read("/app/out/hello.txt") == b"Hello, Harbor!\n"


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
