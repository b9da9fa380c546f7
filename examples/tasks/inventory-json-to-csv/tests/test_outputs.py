"""/app/inventory.csv holds exactly the rows of the inventory the task shipped (the answer key below), read
back as CSV: any valid quoting of the same fields passes, a different value or order does not."""

import csv
import sys

EXPECTED = [
    ["sku", "name", "qty", "price", "currency", "tags"],
    ["A-009", "Wood screw", "0", "0.10", "EUR", "metal;wood;small"],
    ["A-100", "Plain washer", "5000", "0.02", "EUR", ""],
    ["B-220", "Hex bolt, M6", "1200", "0.08", "EUR", "metal;small"],
    ["C-031", 'The "big" hammer', "7", "24.50", "USD", "tool"],
    ["D-404", "Tape measure 5 m", "31", "9.00", "GBP", "tool;measure"],
]


def test_the_rows_are_exact() -> None:
    with open("/app/inventory.csv", encoding="utf-8", newline="") as f:
        assert list(csv.reader(f)) == EXPECTED


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
