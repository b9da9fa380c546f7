"""/app/unique.txt is exactly the first-seen list of the addresses the task shipped (the answer key below)."""

import sys

EXPECTED = ["zoe@example.org", "adam@example.org", "bob@example.net", "carol@example.com", "dave@example.com",
            "erin@example.org", "alice@example.com"]


def test_the_list_is_exact() -> None:
    with open("/app/unique.txt", encoding="utf-8", newline="") as f:
        assert f.read() == "".join(e + "\n" for e in EXPECTED)


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
