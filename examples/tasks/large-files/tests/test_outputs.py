"""/app/large_files.txt lists exactly the regular files above 1024 bytes of the data the task shipped (the
answer key below: one of exactly 1024 bytes and a symbolic link to a large file are not in it)."""

import sys

EXPECTED = [".cache/blob.bin", "docs/big file.log", "docs/report.txt", "images/raw/photo1.raw",
            "images/raw/photo2.raw"]


def test_the_list_is_exact() -> None:
    with open("/app/large_files.txt", encoding="utf-8", newline="") as f:
        assert f.read() == "".join(p + "\n" for p in EXPECTED)


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
