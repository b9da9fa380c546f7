"""/app/.env is exactly the merge of the two files the task shipped (the answer key below)."""

import sys

EXPECTED = """\
APP_NAME=steptap-demo
CACHE_DIR=/tmp/cache
DATABASE_URL=postgres://app@db:5432/app?sslmode=disable
FEATURE_FLAGS="search,export"
LOG_LEVEL=debug
PORT=9000
"""


def test_the_merged_file_is_exact() -> None:
    with open("/app/.env", encoding="utf-8", newline="") as f:
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
