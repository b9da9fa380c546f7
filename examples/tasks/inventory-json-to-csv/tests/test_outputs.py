"""/app/inventory.csv holds exactly the rows of the inventory the task shipped (the answer key below), read
back as CSV: any valid quoting of the same fields passes, a different value or order does not."""

import csv
import io
import os
import stat
import sys

EXPECTED = [
    ["sku", "name", "qty", "price", "currency", "tags"],
    ["A-009", "Wood screw", "0", "0.10", "EUR", "metal;wood;small"],
    ["A-100", "Plain washer", "5000", "0.02", "EUR", ""],
    ["B-220", "Hex bolt, M6", "1200", "0.08", "EUR", "metal;small"],
    ["C-031", 'The "big" hammer', "7", "24.50", "USD", "tool"],
    ["D-404", "Tape measure 5 m", "31", "9.00", "GBP", "tool;measure"],
]

MAX_BYTES = 1 << 20


def _read(path: str) -> bytes:
    """``path``'s bytes. It must be a regular file of at most 1 MiB: a link, a FIFO or a device left there
    fails the check rather than hang the verifier (a hung verifier is an infrastructure error, not a 0)."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES, f"{path}: not a regular file of <= 1 MiB"
    with open(path, "rb") as f:
        return f.read(MAX_BYTES + 1)


def test_the_rows_are_exact() -> None:
    text = _read("/app/inventory.csv").decode()
    assert list(csv.reader(io.StringIO(text, newline=""))) == EXPECTED


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
