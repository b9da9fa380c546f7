"""/app/totals.csv is exactly the revenue per region of the sales the task shipped (the answer key below:
a changed /app/sales.csv changes nothing here)."""

import sys

EXPECTED = "region,revenue\nEast,1196.61\nNorth,1452.72\nSouth,434.79\nWest,906.63\n"


def test_totals_are_exact() -> None:
    with open("/app/totals.csv", encoding="utf-8", newline="") as f:
        assert f.read() == EXPECTED


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
