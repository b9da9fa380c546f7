"""/app/out holds exactly hello.txt, whose content is exactly "Hello, Harbor!" and a newline."""

import os
import sys


def test_out_is_a_directory_holding_only_hello_txt() -> None:
    assert not os.path.islink("/app/out") and os.path.isdir("/app/out")
    assert sorted(os.listdir("/app/out")) == ["hello.txt"]


def test_hello_txt_has_the_exact_line() -> None:
    assert not os.path.islink("/app/out/hello.txt")
    with open("/app/out/hello.txt", "rb") as f:
        assert f.read() == b"Hello, Harbor!\n"


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
