"""/app/bad_commit.txt names the commit of calc.bundle (as the task shipped it) that broke the checks: the
answer is the hash below, fixed by the bundle's contents."""

import sys

BAD = "c40050ffd96809744f2b034dcdae2cc33ce9f3d5"  # "Tidy sub": sub() became abs(a - b)


def test_the_hash_is_the_first_bad_commit() -> None:
    with open("/app/bad_commit.txt", encoding="utf-8") as f:
        assert f.read().strip() == BAD


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
