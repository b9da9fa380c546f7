"""/app/error_counts.txt holds each top-level log's ERROR count, sorted by name. The counts are the answer
key of the files the task shipped (the agent may have changed /app/logs; that changes nothing here)."""

import sys

EXPECTED = "api.log 4\ndb.log 6\nweb.log 6\nworker.log 0\n"


def test_counts_are_exact() -> None:
    with open("/app/error_counts.txt", encoding="utf-8") as f:
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
